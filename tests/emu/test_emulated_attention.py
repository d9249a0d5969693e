"""The CUDA attention kernels, run by the emulator through the custom ops, against the reference
and the C++ CPU twin (``fused``): padded and varlen, forward and dQ/dK/dV, dropout on and off."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import emulated, fused
from bertdist.ops.reference import reference_attention, reference_attention_math, reference_varlen_attention
from tests.emu._util import emu, launched
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


def _lengths(s):
    return [s, max(1, (2 * s) // 3)]


def _check_fp32(s, d, heads=2):
    q, k, v = packed_qkv(2, s, heads, d, seed=s + d)
    mask = padding_mask(_lengths(s), s)
    out = emulated.attention(q, k, v, mask)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert out.shape == ref.shape
    assert_close_rel(out, ref, 1e-5, f"out s={s} d={d}")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name} s={s} d={d}")


# One and several query/key tiles (64 rows for head_dim 64), partial last tiles.
@pytest.mark.parametrize("s", [1, 7, 37, 64, 65, 129])
def test_fp32_forward_and_grads_match_reference(s):
    emu()
    _check_fp32(s, 64)


@pytest.mark.parametrize("d,s", [(32, 37), (128, 65)])
def test_head_dims_32_and_128(d, s):
    emu()
    _check_fp32(s, d)


def test_fully_padded_and_single_token_sequences():
    emu()
    s = 65
    q, k, v = packed_qkv(3, s, 2, 64, seed=1)
    mask = torch.zeros(3, s, dtype=torch.bool)
    mask[0, 0] = True
    mask[1, 40] = True
    out = emulated.attention(q, k, v, mask)  # sequence 2 fully padded: uniform attention
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert torch.isfinite(out).all()
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 32)])
def test_low_precision_within_twice_reference_error(dtype, d):
    emu()
    s = 65
    q, k, v = packed_qkv(2, s, 2, d, dtype=dtype, seed=3)
    mask = padding_mask(_lengths(s), s)
    g = torch.randn(2, 2, s, d).to(dtype)
    out = emulated.attention(q, k, v, mask)
    d_emu = grads(out, (q, k, v), g)
    lp_in = [leaf(t) for t in (q, k, v)]
    ref_lp = reference_attention(*lp_in, mask)  # torch's own op in the same precision
    d_lp = grads(ref_lp, lp_in, g)
    f32_in = [leaf(t.float()) for t in (q, k, v)]
    ref32 = reference_attention_math(*f32_in, mask)
    d32 = grads(ref32, f32_in, g.float())
    assert out.dtype == dtype
    assert_low_precision_ok(out, ref_lp, ref32, f"out {dtype}")
    for name, a, b, c in zip("qkv", d_emu, d_lp, d32):
        assert_low_precision_ok(a, b, c, f"d{name} {dtype}")


def test_dropout_bit_identical_to_cpu_twin_and_explicit_mask():
    C = ext()
    emu()
    s, p, seed, offset = 37, 0.1, 1234, 7
    q, k, v = packed_qkv(2, s, 2, 64, seed=4)
    mask = padding_mask(_lengths(s), s)
    kw = dict(dropout_p=p, training=True, seed=seed, offset=offset)
    out = emulated.attention(q, k, v, mask, **kw)
    twin = fused.attention(*(leaf(t) for t in (q, k, v)), mask, **kw)
    assert_close_rel(out, twin, 1e-5, "out against the CPU twin")
    keep = C.attention_keep_mask(4, s, s, p, seed, offset)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = attention_with_mask(*ref_in, mask, keep, p)
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


def test_dropout_mask_read_off_the_output():
    # q = k = 0: probabilities 1/S; V = I: output row i is row i's keep mask / (S (1 - p)).
    C = emu()
    twin = ext()
    s, p, seed = 64, 0.1, 99
    q = torch.zeros(1, 2, s, s)
    v = torch.eye(s).expand(1, 2, s, s).contiguous()
    _, _, rng = torch.ops.bertdist_emu.attention_fwd(q, q, v, None, 0.125, p, seed, 3)
    assert rng.tolist() == [seed, 3]
    out = emulated.attention(q, q, v, None, dropout_p=p, training=True, seed=seed, offset=3)
    kept = out * s * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-4)
    assert torch.equal(kept.round().bool().reshape(2, s, s), twin.attention_keep_mask(2, s, s, p, seed, 3))
    assert C.build_info()["emulated"]


def test_varlen_matches_reference_and_cpu_twin_with_dropout():
    C = ext()
    emu()
    lengths = [5, 1, 0, 17, 9]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    total, h, d = int(cu[-1]), 3, 64
    g0 = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(total, h, d, generator=g0, requires_grad=True) for _ in range(3))
    out = emulated.varlen_attention(q, k, v, cu, max(lengths))
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_varlen_attention(*ref_in, cu, max(lengths))
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")
    p, seed = 0.25, 3
    kw = dict(dropout_p=p, training=True, seed=seed)
    out_d = emulated.varlen_attention(q, k, v, cu, max(lengths), **kw)
    twin_in = [leaf(t) for t in (q, k, v)]
    twin = fused.varlen_attention(*twin_in, cu, max(lengths), **kw)
    assert_close_rel(out_d, twin, 1e-5, "dropout out against the CPU twin")
    for name, a, b in zip("qkv", grads(out_d, (q, k, v), g), grads(twin, twin_in, g)):
        assert_close_rel(a, b, 1e-5, f"dropout d{name} against the CPU twin")
    for b, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s1 > s0:
            keep = C.attention_keep_mask((b + 1) * h, s1 - s0, s1 - s0, p, seed, 0)[b * h:]
            qs, ks, vs = (t[s0:s1].transpose(0, 1).unsqueeze(0).detach() for t in (q, k, v))
            ref_b = attention_with_mask(qs, ks, vs, None, keep, p).squeeze(0).transpose(0, 1)
            assert_close_rel(out_d[s0:s1], ref_b, 1e-5, f"dropout sequence {b}")


def test_the_cuda_kernels_ran_and_launch_errors_surface():
    C = emu()
    before = C.emulator_counts()
    q, k, v = packed_qkv(1, 9, 2, 32, seed=5)
    emulated.attention(q, k, v, None).sum().backward()
    assert launched(before, C.emulator_counts()) == {"attn_fwd_kernel", "attn_delta_kernel", "attn_dq_kernel",
                                                     "attn_dkdv_kernel"}
    with pytest.raises(RuntimeError, match=r"head_dim must be 32, 64 or 128 on CUDA, got 48"):
        emulated.attention(*(torch.randn(1, 2, 5, 48) for _ in range(3)), None)
    with pytest.raises(RuntimeError, match=r"float64 is supported by the C\+\+ CPU kernels only"):
        emulated.attention(*(torch.randn(1, 2, 5, 32, dtype=torch.float64) for _ in range(3)), None)
    torch.library.opcheck(torch.ops.bertdist_emu.attention_fwd, (q, k, v, None, 0.2, 0.0, 0, 0))
