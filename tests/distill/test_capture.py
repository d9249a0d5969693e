"""TinyBERT's intermediate signals: layer outputs and attention maps read from our encoder, and a
distillation run that uses them across different widths."""
import json

import pytest
import torch

from bertdist.distill.capture import LayerCapture
from bertdist.finetune.heads import BertForTask
from bertdist.model import BertConfig
from tests.distill import fixtures as fx


def test_capture_gives_every_layer_output_and_attention_rows_over_real_keys():
    torch.manual_seed(0)
    cfg = BertConfig.from_preset("tiny", vocab_size=50, kernels="reference", hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    model = BertForTask(cfg, "token", 3, device_type="cpu").eval()
    cap = LayerCapture(model.bert, attention=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ids = torch.randint(5, 50, (2, 4))
    with torch.no_grad():
        seq, _ = model.bert(ids, mask, torch.zeros_like(ids))
        probs = cap.probs(mask)
    assert len(cap.hidden) == 2 and torch.equal(cap.hidden[-1], seq)
    assert probs[0].shape == (2, 2, 4, 4)
    assert torch.allclose(probs[0].sum(-1), torch.ones(2, 2, 4))
    assert probs[0][0, :, :, 3].abs().max() == 0  # the padded key gets no attention
    # the recomputed distribution is the layer's own: probs @ V reproduces its attention context
    sa = model.bert.encoder.layer[0].attention.self
    h = cap.inputs[0]
    v = sa.value(h).view(2, 4, 2, 64).transpose(1, 2)
    ctx = (probs[0] @ v).transpose(1, 2).reshape(2, 4, 128)
    with torch.no_grad():
        want = sa(h, mask.bool())
    assert torch.allclose(ctx[1], want[1], atol=1e-5) and torch.allclose(ctx[0, :3], want[0, :3], atol=1e-5)
    cap.remove()
    cap.clear()
    with torch.no_grad():
        model.bert(ids, mask, torch.zeros_like(ids))
    assert cap.hidden == []


@pytest.mark.slow
def test_hidden_and_attention_losses_train_a_narrower_student(tmp_path):
    from bertdist.distill.train import run_distill

    vocab = fx.write_vocab(tmp_path / "vocab.txt")
    data = fx.write_sst2(tmp_path / "sst2")
    teacher = fx.teacher(tmp_path, "sst2", data, vocab, steps=2, hidden_size=192, intermediate_size=384)
    unl = fx.write_unlabeled_text(tmp_path / "u.txt", n=16)
    out = tmp_path / "out"
    cfg = fx.distill_config("sst2", teacher, data, [unl], out, student="preset:tiny", hidden_weight=1.0,
                            attention_weight=1.0, layer_map=[0, 1], steps=3)
    run_distill(cfg)
    r = json.loads((out / "report.json").read_text())
    assert r["student_spec"]["hidden_size"] == 128 and r["hidden_weight"] == 1.0
    assert r["student"]["parameters"] < r["teacher"]["parameters"]
