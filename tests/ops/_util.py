"""Helpers shared by the fused-op tests: error metrics and explicit-mask reference twins."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bertdist.ops import fused
from bertdist.ops.reference import _additive_mask, reference_layer_norm


def ext():
    """The loaded extension; a test fails (saying why it is missing) when it did not load, since
    `make test` builds it: a missing extension is a broken build, not a reason to skip."""
    mod, why = fused._extension.load()
    if mod is None:
        pytest.fail(f"bertdist._C did not load: {why}")
    return mod


# Scale floor: a gradient that is exactly zero in exact arithmetic (e.g. dq for a single
# key) is judged by absolute error against 1e-2 rather than divided by zero.
SCALE_FLOOR = 1e-2


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to the scale (max |expected|) of the expected tensor."""
    if expected.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item() / max(e.abs().max().item(), SCALE_FLOOR)


def assert_close_rel(actual, expected, tol=1e-5, what=""):
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative max error {err:.3e} > {tol:.0e}"


def assert_low_precision_ok(fused_lp, ref_lp, ref_fp32, what="", floor=1e-6):
    """The fused low-precision result may be at most 2x as far from the fp32 reference as the
    reference computed in the same low precision is."""
    e_fused, e_ref = rel_err(fused_lp, ref_fp32), rel_err(ref_lp, ref_fp32)
    assert e_fused <= 2 * e_ref + floor, f"{what}: fused error {e_fused:.3e} > 2 x reference error {e_ref:.3e}"


def attention_with_mask(q, k, v, key_padding_mask, keep, p, scale=None):
    """reference_attention_math with an explicit dropout keep mask [B*H, S, S] (fp32 math)."""
    b, h, s, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if key_padding_mask is not None:
        scores = scores + _additive_mask(key_padding_mask, torch.float32)
    probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep.view(b, h, s, s).to(probs.dtype) / (1 - p)
    return torch.matmul(probs, v.float()).to(q.dtype)


def bdaln_with_mask(x, bias, residual, weight, ln_bias, keep, p, eps):
    """LN(residual + dropout(x + bias)) with an explicit keep mask [rows, hidden]."""
    hsum = x if bias is None else x + bias
    if keep is not None:
        hsum = hsum * keep.view(hsum.shape).to(hsum.dtype) / (1 - p)
    return reference_layer_norm(residual + hsum, weight, ln_bias, eps)


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True)


def packed_qkv(b, s, h, d, dtype=torch.float32, seed=0):
    """q, k, v as the model makes them: permuted views of a packed [B, S, 3, H, D] tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, 3, h, d, generator=g, dtype=torch.float32).to(dtype)
    qkv = qkv.permute(2, 0, 3, 1, 4)
    return [t.detach().requires_grad_(True) for t in (qkv[0], qkv[1], qkv[2])]


def padding_mask(lengths, s):
    return torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]


def leaf(t):
    return t.detach().clone().requires_grad_(True)


F = F  # re-exported for tests
