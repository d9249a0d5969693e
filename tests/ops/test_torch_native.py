"""Torch-native ops (what kernels: reference runs on CUDA) on CPU: SDPA with a boolean mask, the
packing and unpacking around varlen kernels against the padded path, and varlen_attn's limits."""
from __future__ import annotations

import pytest
import torch

from bertdist.model import BertConfig, BertForPreTraining
from bertdist.ops import REFERENCE, TORCH_NATIVE, torch_native
from bertdist.ops.reference import reference_attention_math, reference_varlen_attention
from tests.ops._util import assert_close_rel, grads, leaf, packed_qkv, padding_mask

LENGTHS = [13, 1, 9, 13]


def _real(t, mask):
    return t * mask[:, None, :, None]


def test_sdpa_with_boolean_mask_matches_the_math_reference():
    s = 13
    q, k, v = packed_qkv(4, s, 2, 16, seed=1)
    mask = padding_mask(LENGTHS, s)
    out = torch_native.sdpa_attention(q, k, v, mask)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert_close_rel(_real(out, mask), _real(ref, mask), 1e-5, "out")
    g = _real(torch.randn_like(ref), mask)  # the model sends no gradient into padded positions
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


def _packed(lengths, h=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, h, d, generator=g).to(dtype)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(1))
    cu = torch.nn.functional.pad(torch.cumsum(torch.tensor(lengths), 0), (1, 0)).to(torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("lengths", [LENGTHS, [5, 0, 7]])
def test_repadded_sdpa_matches_the_per_sequence_reference(lengths):
    q, k, v, cu = _packed(lengths)
    out = torch_native.varlen_attention_sdpa(q, k, v, cu, max(lengths))
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_varlen_attention(*ref_in, cu, max(lengths))
    assert out.shape == q.shape
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


def test_pack_and_unpack_round_trip_and_index_without_host_sync():
    lengths, s = [3, 0, 5, 1], 6
    cu = torch.nn.functional.pad(torch.cumsum(torch.tensor(lengths), 0), (1, 0)).to(torch.int32)
    index = torch_native.packed_index(cu, sum(lengths), s)
    mask = torch_native.lengths_mask(cu, s)
    assert index.tolist() == mask.reshape(-1).nonzero().squeeze(1).tolist()
    x = torch.randn(sum(lengths), 2, 4)
    padded = torch_native.repad(x, index, len(lengths), s)
    assert padded.shape == (4, 2, s, 4) and padded[1].abs().sum() == 0 and padded[0, :, 3:].abs().sum() == 0
    assert torch.equal(torch_native.unpad(padded, index), x)
    idx, cu2, max_len = torch_native.padded_index(mask)
    assert torch.equal(idx, index) and torch.equal(cu2, cu) and max_len == 5


def test_padded_attention_through_a_varlen_kernel_matches_the_padded_path():
    # The packing/unpacking around varlen_attn, with the per-sequence reference in its place (varlen_attn is CUDA-only).
    s = 13
    q, k, v = packed_qkv(4, s, 2, 16, seed=2)
    mask = padding_mask(LENGTHS, s)
    out = torch_native.attention_via_varlen(q, k, v, mask, varlen=reference_varlen_attention)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert_close_rel(_real(out, mask), _real(ref, mask), 1e-5, "out")
    assert _real(out, ~mask).abs().sum() == 0  # padded query positions are zero
    g = _real(torch.randn_like(ref), mask)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


def test_varlen_attn_is_not_used_where_it_cannot_run():
    q, k, v, cu = _packed([4, 2])
    assert "dropout" in torch_native.varlen_attn_unsupported(q, dropout_active=True)
    assert "CUDA" in torch_native.varlen_attn_unsupported(q, dropout_active=False)
    with pytest.raises(ValueError, match="no dropout"):
        torch_native.varlen_attention_flash(q, k, v, cu, 4, dropout_p=0.1, training=True)
    # The torch-native rule falls back to re-padded SDPA (here: CPU), with dropout too.
    out = torch_native.varlen_attention(q, k, v, cu, 4, dropout_p=0.1, training=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
    # As a kernels=auto candidate on CUDA: only without dropout, in fp16/bf16, head_dim % 8 == 0 and <= 256.
    from bertdist.ops.candidates import Case, varlen_attn_case_unsupported as why

    ok = dict(op="varlen_attention", device_type="cuda", batch=2, seq=8, hidden=128, heads=2)
    assert why(Case(dtype="bfloat16", dropout=False, **ok)) is None
    assert "dropout" in why(Case(dtype="bfloat16", dropout=True, **ok))
    assert "float16/bfloat16" in why(Case(dtype="float32", dropout=False, **ok))
    assert "multiple of 8" in why(Case(dtype="float16", dropout=False, **{**ok, "hidden": 24}))


def test_torch_native_unpadded_model_matches_the_padded_reference_model():
    cfg = BertConfig.from_preset("tiny", vocab_size=300, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    padded = BertForPreTraining(cfg, device_type="cpu", kernels=REFERENCE)
    unpadded = BertForPreTraining(BertConfig.from_mapping({**cfg.__dict__, "unpad": True}), device_type="cpu",
                                  kernels=TORCH_NATIVE)
    unpadded.load_state_dict(padded.state_dict())
    ids = torch.randint(5, 300, (4, 13))
    mask = padding_mask(LENGTHS, 13).long()
    labels = torch.where(mask.bool() & (torch.rand(4, 13) < 0.3), ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]
    nsp = torch.tensor([0, 1, 1, 0])
    a = padded(ids, mask, labels=labels, next_sentence_label=nsp)
    b = unpadded(ids, mask, labels=labels, next_sentence_label=nsp)
    assert torch.allclose(a.loss, b.loss, atol=1e-5)
    a.loss.backward()
    b.loss.backward()
    other = dict(unpadded.named_parameters())
    for name, p in padded.named_parameters():
        assert torch.allclose(p.grad, other[name].grad, atol=5e-5, rtol=1e-4), name
