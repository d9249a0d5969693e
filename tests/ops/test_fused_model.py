"""Model level: BertForPreTraining with kernels=fused against kernels=reference, same weights."""
from __future__ import annotations

import pytest
import torch

from bertdist.model.bert import BertForPreTraining
from bertdist.model.config import BertConfig
from tests.ops._util import assert_close_rel, ext


def _pair(preset, **overrides):
    torch.manual_seed(0)
    ref = BertForPreTraining(BertConfig.from_preset(preset, kernels="reference", **overrides), device_type="cpu")
    fus = BertForPreTraining(BertConfig.from_preset(preset, kernels="fused", **overrides), device_type="cpu")
    fus.load_state_dict(ref.state_dict())
    assert set(fus.bert.kernels.sources.values()) == {"fused"}
    assert set(ref.bert.kernels.sources.values()) == {"reference"}
    return ref, fus


def _batch(cfg, b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (b, s), generator=g)
    lengths = torch.tensor([s] + [max(2, s // 2)] * (b - 1))
    attn = (torch.arange(s)[None, :] < lengths[:, None]).long()
    types = (torch.arange(s)[None, :] >= (lengths[:, None] // 2)).long() * attn
    labels = torch.full((b, s), -100)
    pick = (torch.rand(b, s, generator=g) < 0.3) & attn.bool()
    labels[pick] = ids[pick]
    nsp = torch.randint(0, 2, (b,), generator=g)
    return dict(input_ids=ids, attention_mask=attn, token_type_ids=types, labels=labels, next_sentence_label=nsp)


def _compare(ref, fus, batch, tol_out, tol_grad):
    ref.train()
    fus.train()
    out_r, out_f = ref(**batch), fus(**batch)
    assert_close_rel(out_f.prediction_logits, out_r.prediction_logits, tol_out, "prediction_logits")
    assert_close_rel(out_f.seq_relationship_logits, out_r.seq_relationship_logits, tol_out, "nsp logits")
    assert_close_rel(out_f.loss, out_r.loss, tol_out, "loss")
    out_r.loss.backward()
    out_f.loss.backward()
    params_f = dict(fus.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert params_f[name].grad is None, name
            continue
        assert_close_rel(params_f[name].grad, p.grad, tol_grad, f"grad {name}")


@pytest.mark.parametrize(
    "preset,overrides,b,s",
    [
        ("tiny", {}, 3, 40),
        # base width, two of its twelve layers, short sequences: the same kernels at base
        # shapes (hidden 768, 12 heads x 64) in a few seconds of CPU.
        ("base", {"num_hidden_layers": 2}, 2, 32),
    ],
)
def test_fused_matches_reference(preset, overrides, b, s):
    ext()
    # Dropout off so both paths compute the same function (their RNGs differ by design).
    ref, fus = _pair(preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)
    _compare(ref, fus, _batch(ref.config, b, s), 1e-5, 1e-4)


def test_eval_mode_ignores_dropout_probability():
    ext()
    ref, fus = _pair("tiny")
    ref.eval()
    fus.eval()
    batch = _batch(ref.config, 2, 24, seed=1)
    with torch.no_grad():
        assert_close_rel(fus(**batch).prediction_logits, ref(**batch).prediction_logits, 1e-5, "logits")


def test_training_with_dropout_is_reproducible_under_manual_seed():
    ext()
    _, fus = _pair("tiny")
    fus.train()
    batch = _batch(fus.config, 2, 24, seed=2)
    torch.manual_seed(5)
    a = fus(**batch).loss
    torch.manual_seed(5)
    b = fus(**batch).loss
    c = fus(**batch).loss
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_fused_layer_norms_run_in_fp32_under_autocast_like_torch_on_cuda():
    """Under torch.autocast a bf16 GEMM output meets an fp32 residual: the fused layer norms used to
    reject the mix; they now autocast to fp32, as torch's layer_norm does on CUDA."""
    ext()
    ref, fus = _pair("tiny", vocab_size=300, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch = _batch(ref.config, 3, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_r, out_f = ref(**batch), fus(**batch)
    assert out_f.loss.dtype == torch.float32 and torch.isfinite(out_f.loss)
    assert abs(out_f.loss.item() - out_r.loss.item()) < 2e-2 * abs(out_r.loss.item())  # bf16 GEMMs on both sides
    out_f.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in fus.parameters() if p.grad is not None)
