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


def _tiny_modernbert(unpad: bool, local_attention: int = 4):
    from bertdist.model.modernbert import ModernBertModel
    from bertdist.model.modernbert_config import ModernBertConfig

    torch.manual_seed(0)
    cfg = ModernBertConfig.from_preset("tiny", vocab_size=50, max_position_embeddings=16, pad_token_id=0,
                                       local_attention=local_attention, unpad=unpad)
    return ModernBertModel(cfg).eval()


@pytest.mark.parametrize("unpad", [False, True])
def test_a_modernbert_capture_gives_its_layers_residual_streams_and_windowed_attention(unpad):
    """ModernBERT: each layer's output as [B, S, H] (put back from the unpadded layout), the final
    norm of the last one the model's output; attention recomputed with the layer's RoPE, over real
    keys and, in a local layer, the keys of its window, and it reproduces the layer's own output."""
    model = _tiny_modernbert(unpad)
    padded = _tiny_modernbert(False)
    cap = LayerCapture(model, attention=True)
    mask = torch.tensor([[1] * 9 + [0] * 3, [1] * 12])
    ids = torch.randint(5, 50, (2, 12))
    with torch.no_grad():
        out = model(ids, mask)
        want = padded(ids, mask)
        states, probs, allowed = cap.states(mask), cap.probs(mask), cap.allowed(mask)
    real = mask.bool()
    assert len(states) == 3 and states[0].shape == (2, 12, 64)
    assert torch.allclose(model.final_norm(states[-1])[real], out[real], atol=1e-5)
    assert torch.allclose(model.final_norm(states[-1])[real], want[real], atol=1e-5)  # same as the padded run
    assert [a is None for a in allowed] == [True, False, False]  # layer 0 global, 1 and 2 local
    assert torch.equal(allowed[1], (torch.arange(12)[:, None] - torch.arange(12)[None, :]).abs() <= 2)
    for p in probs:
        assert p.shape == (2, 2, 12, 12) and torch.isfinite(p).all()
        rows = p.sum(-1).transpose(1, 2)[real]  # [real queries, heads]
        assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)
        assert p[0, :, :, 9:].abs().max() == 0  # padded keys get nothing
    assert probs[1][1, :, 0, 3:].abs().max() == 0 and probs[1][1, :, 0, :3].min() > 0  # outside the window: 0
    assert probs[0][1, :, 0, 3:].min() > 0  # the global layer sees every key
    # probs @ V through Wo is the layer's attention output (layer 1: local, its attention norm on)
    layer = model.layers[1]
    h = layer.attn_norm(cap._padded(cap.inputs[1], mask))
    _, _, v = layer.attn.Wqkv(h).view(2, 12, 3, 2, 32).unbind(-3)
    ctx = (probs[1] @ v.transpose(1, 2).float()).transpose(1, 2).reshape(2, 12, 64)
    rope = model.rotary["local"](torch.arange(12))
    with torch.no_grad():
        ref = padded.layers[1].attn(h, rope, real)
        got = layer.attn.Wo(ctx)
    assert torch.allclose(got[real], ref[real], atol=1e-5)
    cap.remove()


def test_the_attention_loss_compares_a_windowed_layer_on_its_window():
    """Student layer local (window +-1), teacher layer global: both renormalised over the window, so
    the loss is finite, zero when they agree there, and what a hand-computed KL gives; without
    windows the loss is unchanged."""
    from bertdist.distill.losses import attention_kl, renormalised

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1]])
    window = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs() <= 1
    teacher = torch.softmax(torch.randn(1, 2, 5, 5), -1)
    student = renormalised(torch.softmax(torch.randn(1, 2, 5, 5), -1), window)
    loss = attention_kl([student], [teacher], [0], mask, [window], [None])
    t = renormalised(teacher, window)
    kl = (t * ((t + 1e-12).log() - (student + 1e-12).log())).sum(-1)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(kl.mean().item(), rel=1e-5)
    assert attention_kl([student], [teacher], [0], mask).item() > 10  # unrestricted: the zeros blow it up
    agree = attention_kl([renormalised(teacher, window)], [teacher], [0], mask, [window], [None])
    assert agree.item() == pytest.approx(0.0, abs=1e-6)
    plain = attention_kl([teacher], [student], [0], mask)
    assert plain.item() == attention_kl([teacher], [student], [0], mask, [None], [None]).item()
