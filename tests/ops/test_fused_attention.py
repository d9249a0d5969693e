"""Fused attention (C++ CPU kernels through the custom ops) against the reference twins."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import fused
from bertdist.ops.reference import reference_attention, reference_attention_math, reference_varlen_attention
from tests.ops._util import (
    assert_close_rel,
    assert_low_precision_ok,
    attention_with_mask,
    ext,
    grads,
    leaf,
    packed_qkv,
    padding_mask,
)

SEQ_LENS = [1, 7, 127, 128, 129, 511, 512]


def _lengths(s):
    # Variable lengths in one batch: full, and about two thirds (at least 1).
    return [s, max(1, (2 * s) // 3)]


@pytest.mark.parametrize("s", SEQ_LENS)
def test_fp32_forward_and_grads_match_reference(s):
    ext()
    q, k, v = packed_qkv(2, s, 2, 64, seed=s)
    mask = padding_mask(_lengths(s), s)
    out = fused.attention(q, k, v, mask)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert out.shape == ref.shape
    assert_close_rel(out, ref, 1e-5, f"out s={s}")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name} s={s}")


def test_all_but_one_token_padded():
    ext()
    s = 129
    q, k, v = packed_qkv(3, s, 2, 64, seed=1)
    mask = torch.zeros(3, s, dtype=torch.bool)
    mask[0, 0] = True
    mask[1, 77] = True  # the one real token need not be first
    mask[2, :] = False  # fully padded sequence: uniform attention, as the reference gives
    out = fused.attention(q, k, v, mask)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


def test_padded_keys_do_not_change_real_outputs():
    ext()
    s, lengths = 40, [40, 13]
    q, k, v = packed_qkv(2, s, 2, 64, seed=2)
    mask = padding_mask(lengths, s)
    out1 = fused.attention(q, k, v, mask).detach()
    k2, v2, q2 = k.detach().clone(), v.detach().clone(), q.detach().clone()
    k2[1, :, 13:] = 1e4 * torch.randn_like(k2[1, :, 13:])
    v2[1, :, 13:] = 1e4 * torch.randn_like(v2[1, :, 13:])
    q2[1, :, 13:] = torch.randn_like(q2[1, :, 13:])
    out2 = fused.attention(q2, k2, v2, mask)
    assert torch.equal(out1[:, :, :13], out2[:, :, :13]), "padded inputs changed real-token outputs"
    assert torch.equal(out1[0], out2[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [128, 129])
def test_low_precision_within_twice_reference_error(dtype, s):
    ext()
    q, k, v = packed_qkv(2, s, 2, 64, dtype=dtype, seed=3)
    mask = padding_mask(_lengths(s), s)
    g = torch.randn(2, 2, s, 64).to(dtype)
    out = fused.attention(q, k, v, mask)
    d_fused = grads(out, (q, k, v), g)
    lp_in = [leaf(t) for t in (q, k, v)]
    ref_lp = reference_attention(*lp_in, mask)  # torch's own op in the same precision
    d_lp = grads(ref_lp, lp_in, g)
    f32_in = [leaf(t.float()) for t in (q, k, v)]
    ref32 = reference_attention_math(*f32_in, mask)
    d32 = grads(ref32, f32_in, g.float())
    assert out.dtype == dtype
    assert_low_precision_ok(out, ref_lp, ref32, f"out {dtype}")
    for name, a, b, c in zip("qkv", d_fused, d_lp, d32):
        assert_low_precision_ok(a, b, c, f"d{name} {dtype}")


def test_dropout_matches_explicit_mask_reference():
    C = ext()
    s, p, seed, offset = 129, 0.1, 1234, 7
    q, k, v = packed_qkv(2, s, 2, 64, seed=4)
    mask = padding_mask(_lengths(s), s)
    out = fused.attention(q, k, v, mask, dropout_p=p, training=True, seed=seed, offset=offset)
    keep = C.attention_keep_mask(4, s, s, p, seed, offset)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = attention_with_mask(*ref_in, mask, keep, p)
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


def test_dropout_keep_rate_and_mask_revealed_by_output():
    # q = k = 0 gives uniform probabilities 1/S; with V = identity the output row i is the
    # keep mask of row i scaled by 1 / (S (1 - p)), so the op's own mask can be read off.
    C = ext()
    s, p, seed = 64, 0.1, 99
    q = torch.zeros(2, 2, s, s)
    v = torch.eye(s).expand(2, 2, s, s).contiguous()
    out = fused.attention(q, q, v, None, dropout_p=p, training=True, seed=seed)
    kept = out * s * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-4)
    kept = kept.round().bool()
    assert torch.equal(kept.reshape(4, s, s), C.attention_keep_mask(4, s, s, p, seed, 0))
    rate, n = kept.float().mean().item(), kept.numel()
    sigma = ((1 - p) * p / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma, f"keep rate {rate:.4f} vs {1 - p} (5 sigma = {5 * sigma:.4f})"


def test_fixed_seed_reproduces_and_seeds_differ():
    ext()
    q, k, v = packed_qkv(2, 33, 2, 64, seed=5)
    kw = dict(dropout_p=0.2, training=True)
    torch.manual_seed(0)
    a = fused.attention(q, k, v, None, **kw)
    torch.manual_seed(0)
    b = fused.attention(q, k, v, None, **kw)
    c = fused.attention(q, k, v, None, **kw)  # next draw of the generator
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(fused.attention(q, k, v, None, seed=5, **kw), fused.attention(q, k, v, None, seed=5, **kw))
    assert torch.equal(fused.attention(q, k, v, None, dropout_p=0.2, training=False),
                       fused.attention(q, k, v, None))  # eval: no dropout


def test_gradcheck_float64():
    ext()
    q, k, v = (torch.randn(2, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = padding_mask([5, 3], 5)
    assert torch.autograd.gradcheck(lambda a, b, c: fused.attention(a, b, c, mask), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused.attention(a, b, c, mask, dropout_p=0.3, training=True, seed=11), (q, k, v)
    )


def test_varlen_matches_reference_and_padded_path():
    C = ext()
    lengths = [5, 1, 0, 17, 9]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total, h, d = int(cu[-1]), 3, 64
    q, k, v = (torch.randn(total, h, d, requires_grad=True) for _ in range(3))
    out = fused.varlen_attention(q, k, v, cu, max(lengths))
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_varlen_attention(*ref_in, cu, max(lengths))
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")
    # With dropout, sequence b's mask is the padded path's mask of batch index b.
    p, seed = 0.25, 3
    out_d = fused.varlen_attention(q, k, v, cu, max(lengths), dropout_p=p, training=True, seed=seed)
    for b, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s1 == s0:
            continue
        keep = C.attention_keep_mask((b + 1) * h, s1 - s0, s1 - s0, p, seed, 0)[b * h:]
        qs, ks, vs = (t[s0:s1].transpose(0, 1).unsqueeze(0).detach() for t in (q, k, v))
        ref_b = attention_with_mask(qs, ks, vs, None, keep, p).squeeze(0).transpose(0, 1)
        assert_close_rel(out_d[s0:s1], ref_b, 1e-5, f"dropout sequence {b}")


def test_model_layout_is_not_copied_and_output_reshapes_free():
    ext()
    q, k, v = packed_qkv(2, 16, 4, 64, seed=6)
    assert not q.is_contiguous()
    out = fused.attention(q, k, v, None)
    # [B, H, S, D] view of [B, S, H, D] memory: the model's transpose(1, 2) is contiguous.
    assert out.transpose(1, 2).is_contiguous()


def test_bad_arguments_name_expected_and_actual():
    ext()
    q = torch.randn(2, 2, 8, 64)
    with pytest.raises(RuntimeError, match=r"k must have q's shape \[2, 2, 8, 64\], got \[2, 2, 9, 64\]"):
        fused.attention(q, torch.randn(2, 2, 9, 64), q, None)
    with pytest.raises(RuntimeError, match=r"v must have dtype Float, got Double"):
        fused.attention(q, q, q.double(), None)
    with pytest.raises(RuntimeError, match=r"key_padding_mask must have dtype Bool, got Long"):
        fused.attention(q, q, q, torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"key_padding_mask must have shape \[batch, seq\] = \[2, 8\], got \[2, 7\]"):
        fused.attention(q, q, q, torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"dropout probability must be in \[0, 1\), got 1"):
        fused.attention(q, q, q, None, dropout_p=1.0, training=True)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    t = torch.randn(8, 2, 64)
    with pytest.raises(RuntimeError, match=r"sequence 1 has length 5 > max_seqlen 4"):
        fused.varlen_attention(t, t, t, cu, 4)
    with pytest.raises(RuntimeError, match=r"cu_seqlens must have dtype Int, got Long"):
        fused.varlen_attention(t, t, t, cu.long(), 5)


def test_custom_ops_pass_opcheck():
    ext()
    q, k, v = packed_qkv(1, 5, 2, 32, seed=7)
    mask = padding_mask([3], 5)
    torch.library.opcheck(torch.ops.bertdist.attention_fwd, (q, k, v, mask, 0.2, 0.0, 0, 0))
    torch.library.opcheck(torch.ops.bertdist.attention_fwd, (q, k, v, None, 0.2, 0.5, 3, 1))
    _, _, rng = torch.ops.bertdist.attention_fwd(q, k, v, None, 0.2, 0.5, 3, 1)
    assert rng.tolist() == [3, 1]  # the (seed, offset) record the backward regenerates the mask from
    assert torch.ops.bertdist.attention_fwd(q, k, v, None, 0.2, 0.0, None, 0)[2].shape == (0,)
    with pytest.raises(RuntimeError, match=r"dropout on cpu needs an explicit seed"):
        torch.ops.bertdist.attention_fwd(q, k, v, None, 0.2, 0.5, None, 0)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    t = [torch.randn(5, 2, 32, requires_grad=True) for _ in range(3)]
    torch.library.opcheck(torch.ops.bertdist.varlen_attention_fwd, (*t, cu, 3, 0.2, 0.0, 0, 0))


def test_torch_compile_traces_the_custom_ops():
    # aot_eager runs the fake implementations and the registered autograd formula through
    # AOTAutograd without inductor's C++ compile; fullgraph proves there is no graph break.
    ext()
    q, k, v = packed_qkv(2, 9, 2, 32, seed=8)
    mask = padding_mask([9, 4], 9)
    w, b = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)

    def block(q, k, v, w, b):
        ctx = fused.attention(q, k, v, mask).transpose(1, 2).reshape(2, 9, 64)
        return fused.layer_norm(ctx, w, b, 1e-5)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out, ref = compiled(q, k, v, w, b), block(q, k, v, w, b)
    assert_close_rel(out, ref, 1e-6, "compiled out")
    g = torch.randn_like(ref)
    for a, c in zip(grads(out, (q, k, v, w, b), g), grads(ref, (q, k, v, w, b), g)):
        assert_close_rel(a, c, 1e-6, "compiled grad")
