"""Fused LayerNorm and bias + dropout + residual + LayerNorm (C++ CPU kernels) vs the reference."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import fused
from bertdist.ops.reference import reference_bias_dropout_add_layer_norm, reference_layer_norm
from tests.ops._util import assert_close_rel, assert_low_precision_ok, bdaln_with_mask, ext, grads, leaf

HIDDEN = [128, 768, 1000, 4096]
EPS = 1e-12


def _inputs(rows, hidden, dtype=torch.float32, seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_(True)

    x, residual = r(rows, hidden), r(rows, hidden)
    bias = r(hidden, scale=0.1) if with_bias else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).requires_grad_(True)
    ln_bias = r(hidden, scale=0.1)
    return x, bias, residual, weight, ln_bias


@pytest.mark.parametrize("hidden", HIDDEN)
def test_layer_norm_fp32_forward_and_grads(hidden):
    ext()
    x, _, _, w, b = _inputs(37, hidden, seed=hidden)
    x3 = x.detach().view(1, 37, hidden).requires_grad_(True)
    out = fused.layer_norm(x3, w, b, EPS)
    ref_in = [leaf(t) for t in (x3, w, b)]
    ref = reference_layer_norm(*ref_in, EPS)
    assert_close_rel(out, ref, 1e-5, "y")
    g = torch.randn_like(ref)
    for name, a, c in zip(("dx", "dweight", "dbias"), grads(out, (x3, w, b), g), grads(ref, ref_in, g)):
        assert_close_rel(a, c, 1e-5, f"{name} hidden={hidden}")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_bias_dropout_add_ln_fp32_no_dropout(hidden, with_bias):
    ext()
    inputs = _inputs(29, hidden, seed=hidden + 1, with_bias=with_bias)
    kw = dict(p=0.1, training=False, eps=EPS)  # eval: dropout off
    out = fused.bias_dropout_add_layer_norm(*inputs, **kw)
    ref_in = [None if t is None else leaf(t) for t in inputs]
    ref = reference_bias_dropout_add_layer_norm(*ref_in, **kw)
    assert_close_rel(out, ref, 1e-5, "y")
    g = torch.randn_like(ref)
    live = [t for t in inputs if t is not None]
    live_ref = [t for t in ref_in if t is not None]
    for a, c in zip(grads(out, live, g), grads(ref, live_ref, g)):
        assert_close_rel(a, c, 1e-5, f"grad hidden={hidden}")


@pytest.mark.parametrize("hidden", [128, 768])
def test_dropout_matches_explicit_mask_reference(hidden):
    C = ext()
    p, seed, offset, rows = 0.1, 77, 3, 33
    inputs = _inputs(rows, hidden, seed=5)
    out = fused.bias_dropout_add_layer_norm(*inputs, p=p, training=True, eps=EPS, seed=seed, offset=offset)
    keep = C.hidden_keep_mask(rows, hidden, p, seed, offset)
    ref_in = [leaf(t) for t in inputs]
    ref = bdaln_with_mask(*ref_in, keep, p, EPS)
    assert_close_rel(out, ref, 1e-5, "y")
    g = torch.randn_like(ref)
    for name, a, c in zip(("x", "bias", "residual", "weight", "ln_bias"), grads(out, inputs, g), grads(ref, ref_in, g)):
        assert_close_rel(a, c, 1e-5, f"d{name}")


def test_dropout_keep_rate_and_reproducibility():
    # With zero residual, x = 1, no bias and identity-ish LN inputs, h = keep / (1 - p)
    # is visible through the fused op's saved pre-norm sum; read it via the custom op.
    ext()
    rows, hidden, p = 256, 768, 0.1
    x = torch.ones(rows, hidden)
    zero = torch.zeros(rows, hidden)
    w, b = torch.ones(hidden), torch.zeros(hidden)
    _, h, _, _, _ = torch.ops.bertdist.bias_dropout_add_layer_norm_fwd(x, None, zero, w, b, p, EPS, 1234, 0)
    kept = (h > 0).float()
    assert torch.allclose(h[h > 0], torch.full_like(h[h > 0], 1 / (1 - p)))
    rate, n = kept.mean().item(), kept.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma, f"keep rate {rate:.4f} vs {1 - p}"
    inputs = _inputs(8, 128, seed=9)
    kw = dict(p=0.3, training=True, eps=EPS)
    torch.manual_seed(1)
    a = fused.bias_dropout_add_layer_norm(*inputs, **kw)
    torch.manual_seed(1)
    c = fused.bias_dropout_add_layer_norm(*inputs, **kw)
    d = fused.bias_dropout_add_layer_norm(*inputs, **kw)
    assert torch.equal(a, c) and not torch.equal(a, d)


def test_dropout_record_drives_the_backward():
    # The forward returns the (seed, offset) it used; the backward regenerates the mask from
    # that record alone (on CUDA it may hold a pair drawn on the device under graph capture).
    C = ext()
    rows, hidden, p = 16, 128, 0.3
    x, bias, res, w, b = _inputs(rows, hidden, seed=12)
    fwd, bwd = torch.ops.bertdist.bias_dropout_add_layer_norm_fwd, torch.ops.bertdist.bias_dropout_add_layer_norm_bwd
    _, h, mean, rstd, rng = fwd(x, bias, res, w, b, p, EPS, 41, 5)
    assert rng.dtype == torch.int64 and rng.tolist() == [41, 5]
    gy = torch.randn(rows, hidden)
    dh, dx, *_ = bwd(gy, h, mean, rstd, w, True, p, rng)
    keep = C.hidden_keep_mask(rows, hidden, p, 41, 5)
    assert torch.equal(dx != 0, keep & (dh != 0))
    assert torch.allclose(dx[keep], dh[keep] / (1 - p), rtol=1e-6, atol=0)
    _, dx_other, *_ = bwd(gy, h, mean, rstd, w, True, p, torch.tensor([41, 6]))
    assert torch.equal(dx_other != 0, C.hidden_keep_mask(rows, hidden, p, 41, 6) & (dh != 0))
    assert not torch.equal(dx, dx_other)
    with pytest.raises(RuntimeError, match=r"rng_state must be the forward's contiguous \[2\] \(seed, offset\) "
                                           r"record, got shape \[3\]"):
        bwd(gy, h, mean, rstd, w, True, p, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"rng_state must have dtype Long, got Int"):
        bwd(gy, h, mean, rstd, w, True, p, rng.int())
    with pytest.raises(RuntimeError, match=r"dropout on cpu needs an explicit seed \(only CUDA tensors draw one"):
        fwd(x, bias, res, w, b, p, EPS, None, 0)
    assert fwd(x, bias, res, w, b, 0.0, EPS, None, 0)[4].shape == (0,)  # no dropout, no record


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_reference_error(dtype):
    ext()
    inputs = _inputs(64, 768, dtype=dtype, seed=11)
    kw = dict(p=0.1, training=False, eps=1e-5)
    g = torch.randn(64, 768).to(dtype)
    out = fused.bias_dropout_add_layer_norm(*inputs, **kw)
    d_fused = grads(out, inputs, g)
    lp_in = [leaf(t) for t in inputs]
    ref_lp = reference_bias_dropout_add_layer_norm(*lp_in, **kw)
    d_lp = grads(ref_lp, lp_in, g)
    f32_in = [leaf(t.float()) for t in inputs]
    ref32 = reference_bias_dropout_add_layer_norm(*f32_in, **kw)
    d32 = grads(ref32, f32_in, g.float())
    assert out.dtype == dtype
    assert_low_precision_ok(out, ref_lp, ref32, f"y {dtype}")
    for name, a, b, c in zip(("x", "bias", "residual", "weight", "ln_bias"), d_fused, d_lp, d32):
        assert_low_precision_ok(a, b, c, f"d{name} {dtype}")
    # Plain LayerNorm, and fp32 weights with low-precision activations (autocast's mix).
    x, w, b = lp_in[0], f32_in[3], f32_in[4]
    assert_low_precision_ok(fused.layer_norm(x, w, b, 1e-5), reference_layer_norm(x, w.to(dtype), b.to(dtype), 1e-5),
                            reference_layer_norm(x.float(), w, b, 1e-5), f"layer_norm {dtype}")


def test_gradcheck_float64():
    ext()
    x, bias, res, w, b = (t.detach().double().requires_grad_(True) for t in _inputs(3, 8, seed=3))
    assert torch.autograd.gradcheck(lambda *a: fused.layer_norm(*a, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(
        lambda *a: fused.bias_dropout_add_layer_norm(*a, p=0.0, training=False, eps=1e-5), (x, bias, res, w, b)
    )
    assert torch.autograd.gradcheck(
        lambda *a: fused.bias_dropout_add_layer_norm(*a, p=0.4, training=True, eps=1e-5, seed=21),
        (x, bias, res, w, b),
    )


def test_bad_arguments_name_expected_and_actual():
    ext()
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[64\], got \[32\]"):
        fused.layer_norm(x, torch.randn(32), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"residual must have x's shape \[4, 64\], got \[4, 32\]"):
        fused.bias_dropout_add_layer_norm(x, None, torch.randn(4, 32), w, w, p=0.0, training=False, eps=1e-5)
    with pytest.raises(RuntimeError, match=r"residual must have dtype Float, got BFloat16"):
        fused.bias_dropout_add_layer_norm(x, None, x.bfloat16(), w, w, p=0.0, training=False, eps=1e-5)
    with pytest.raises(RuntimeError, match=r"expected dtype float32, float16 or bfloat16 \(float64 on CPU\), got Int"):
        fused.layer_norm(x.int(), w, w, 1e-5)
    with pytest.raises(RuntimeError, match=r"x must be contiguous, got strides"):
        torch.ops.bertdist.layer_norm_fwd(x.t(), torch.randn(4), torch.randn(4), 1e-5)


def test_custom_ops_pass_opcheck():
    ext()
    x, bias, res, w, b = _inputs(6, 128, seed=4)
    torch.library.opcheck(torch.ops.bertdist.layer_norm_fwd, (x, w, b, 1e-5))
    torch.library.opcheck(torch.ops.bertdist.bias_dropout_add_layer_norm_fwd, (x, bias, res, w, b, 0.0, 1e-5, 0, 0))
    torch.library.opcheck(torch.ops.bertdist.bias_dropout_add_layer_norm_fwd, (x, None, res, w, b, 0.2, 1e-5, 5, 1))
    torch.library.opcheck(torch.ops.bertdist.bias_dropout_add_layer_norm_fwd, (x, None, res, w, b, 0.0, 1e-5, None, 0))
