"""The layer-norm family with bf16 input, output and parameters and fp32 statistics (what the model
runs when its weights are bf16: ``deepspeed.bf16_weights``), in each implementation: torch's
(the reference and ``auto`` path on CPU), the C++ CPU twin, and the CUDA kernels under the SIMT
emulator. Each is judged against an fp64 computation on the same bf16 values: its error may be at
most twice the error of torch's own bf16 layer norm (plus a floor at bf16's half-ulp scale for
values that round to the same bf16 either way), and its statistics must be fp32 and as accurate
as fp32 sums give (a bf16 statistic would be ~100x off)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bertdist.ops import fused
from tests.ops._util import ext, rel_err

BF16 = torch.bfloat16
EPS = 1e-5


def _ops(impl: str):
    """(layer_norm_fwd op, bias_dropout_add_layer_norm_fwd op, layer_norm, bias_dropout_add_layer_norm)."""
    if impl == "fused":
        ext()
        return (torch.ops.bertdist.layer_norm_fwd, torch.ops.bertdist.bias_dropout_add_layer_norm_fwd,
                fused.layer_norm, fused.bias_dropout_add_layer_norm)
    from tests.emu._util import emu

    emu()
    from bertdist.ops import emulated

    return (torch.ops.bertdist_emu.layer_norm_fwd, torch.ops.bertdist_emu.bias_dropout_add_layer_norm_fwd,
            emulated.layer_norm, emulated.bias_dropout_add_layer_norm)


def _inputs(rows: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # an offset mean and an uneven scale: a bf16 sum would lose the mean, a bf16 variance the scale
    x = (3.0 + 2.0 * torch.randn(rows, hidden, generator=g)).to(BF16)
    residual = torch.randn(rows, hidden, generator=g).to(BF16)
    bias = (0.1 * torch.randn(hidden, generator=g)).to(BF16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(BF16)
    b = (0.1 * torch.randn(hidden, generator=g)).to(BF16)
    dy = torch.randn(rows, hidden, generator=g).to(BF16)
    return x, residual, bias, w, b, dy


def _ln64(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor):
    """(y, mean, rstd) in fp64 of the exact bf16 values."""
    h64 = h.double()
    mean = h64.mean(-1)
    rstd = torch.rsqrt(h64.var(-1, unbiased=False) + EPS)
    return F.layer_norm(h64, (h.shape[-1],), w.double(), b.double(), EPS), mean, rstd


def _grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, dy)


def _within_twice_torch(got: torch.Tensor, torch_bf16: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    assert got.dtype == BF16, f"{what}: dtype {got.dtype}, not bf16"
    e_got, e_ref = rel_err(got, exact), rel_err(torch_bf16, exact)
    floor = 1e-6  # both exact
    assert e_got <= 2 * e_ref + floor, f"{what}: error {e_got:.3e} > 2 x torch's bf16 error {e_ref:.3e} + {floor:.1e}"


# emulated: the vectorised kernels (768), the scalar path (770) and the streaming kernels (9001)
@pytest.mark.parametrize("impl,rows,hidden", [("fused", 64, 1024), ("fused", 5, 1000), ("emulated", 4, 768),
                                              ("emulated", 3, 770), ("emulated", 2, 9001)])
def test_layer_norm_bf16_io_fp32_statistics(impl, rows, hidden):
    ln_fwd, _, layer_norm, _ = _ops(impl)
    x, _, _, w, b, dy = _inputs(rows, hidden, seed=hidden)
    y, mean, rstd = ln_fwd(x, w, b, EPS)
    y64, mean64, rstd64 = _ln64(x, w, b)
    assert (y.dtype, mean.dtype, rstd.dtype) == (BF16, torch.float32, torch.float32)
    # fp32 statistics: a few fp32 ulps off the fp64 ones (a bf16 statistic: ~4e-3)
    assert rel_err(mean, mean64) < 1e-5 and rel_err(rstd, rstd64) < 1e-5, (rel_err(mean, mean64), rel_err(rstd, rstd64))
    y_torch, d_torch = _grads(lambda *a: F.layer_norm(a[0], (hidden,), a[1], a[2], EPS), (x, w, b), dy)
    _within_twice_torch(y, y_torch, y64, f"{impl} y")
    y_got, d_got = _grads(lambda *a: layer_norm(*a, EPS), (x, w, b), dy)
    assert torch.equal(y_got, y)
    _, d64 = _grads(lambda *a: F.layer_norm(a[0], (hidden,), a[1], a[2], EPS), (x.double(), w.double(), b.double()),
                    dy.double())
    for name, got, ref, exact in zip(("dx", "dweight", "dbias"), d_got, d_torch, d64):
        _within_twice_torch(got, ref, exact, f"{impl} {name}")


@pytest.mark.parametrize("impl,rows,hidden", [("fused", 64, 1024), ("emulated", 4, 768)])
def test_bias_dropout_add_layer_norm_bf16_io_fp32_statistics(impl, rows, hidden):
    """The residual stream in bf16: h = residual + (x + bias) is stored in bf16 and the statistics
    are the fp32 ones of that stored h (the backward recomputes from it)."""
    _, bdaln_fwd, _, bdaln = _ops(impl)
    x, residual, bias, w, b, dy = _inputs(rows, hidden, seed=7 * hidden)
    y, h, mean, rstd, _ = bdaln_fwd(x, bias, residual, w, b, 0.0, EPS, None, 0)
    assert (y.dtype, h.dtype, mean.dtype, rstd.dtype) == (BF16, BF16, torch.float32, torch.float32)
    h_exact = residual.double() + x.double() + bias.double()
    assert rel_err(h, h_exact) <= 2.0 ** -8, "h is not the bf16 rounding of residual + x + bias"
    y64, mean64, rstd64 = _ln64(h, w, b)
    assert rel_err(mean, mean64) < 1e-5 and rel_err(rstd, rstd64) < 1e-5

    def torch_bdaln(x_, bias_, res_, w_, b_):
        return F.layer_norm(res_ + (x_ + bias_), (hidden,), w_, b_, EPS)

    y_torch, d_torch = _grads(torch_bdaln, (x, bias, residual, w, b), dy)
    exact_y = F.layer_norm(h_exact, (hidden,), w.double(), b.double(), EPS)
    _within_twice_torch(y, y_torch, exact_y, f"{impl} y")
    y_got, d_got = _grads(lambda *a: bdaln(*a, p=0.0, training=True, eps=EPS), (x, bias, residual, w, b), dy)
    assert torch.equal(y_got, y)
    _, d64 = _grads(torch_bdaln, tuple(t.double() for t in (x, bias, residual, w, b)), dy.double())
    for name, got, ref, exact in zip(("dx", "dbias", "dresidual", "dweight", "dln_bias"), d_got, d_torch, d64):
        _within_twice_torch(got, ref, exact, f"{impl} {name}")


@pytest.mark.parametrize("impl", ["fused", "emulated"])
def test_bf16_parameters_reach_the_kernels_without_a_cast(impl):
    """With bf16 weights the kernels read gamma, beta and the dense bias as bf16 and write their
    gradients as bf16 (summed in fp32, rounded once): no cast or copy runs in this forward and
    backward, where kernels that took fp32 parameters only cost 14 casts (each parameter cast in
    per call, each gradient cast out)."""
    from torch.profiler import ProfilerActivity, profile

    _, _, layer_norm, bdaln = _ops(impl)
    x, residual, bias, w, b, dy = _inputs(4, 256, seed=5)
    for t in (x, bias, w, b):  # not the residual: autograd would copy the gradient it shares with x
        t.requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = bdaln(x, bias, residual, w, b, p=0.0, training=True, eps=EPS)
        z = layer_norm(y, w, b, EPS)
        z.backward(dy)
    casts = {e.key: e.count for e in prof.key_averages() if e.key in ("aten::_to_copy", "aten::copy_")}
    assert casts == {}, f"{impl}: casts or copies inside the bf16 layer norms: {casts}"
    assert (w.grad.dtype, b.grad.dtype, bias.grad.dtype) == (BF16, BF16, BF16)


def test_bf16_custom_ops_pass_opcheck():
    """The fake (meta) kernels give the real ones' dtypes with bf16 parameters (the dense bias's
    gradient in bf16), which torch.compile traces with."""
    ext()
    x, residual, bias, w, b, dy = _inputs(6, 128, seed=9)
    torch.library.opcheck(torch.ops.bertdist.layer_norm_fwd, (x, w, b, EPS))
    torch.library.opcheck(torch.ops.bertdist.bias_dropout_add_layer_norm_fwd, (x, bias, residual, w, b, 0.0, EPS, 0, 0))
    _, h, mean, rstd, rng = torch.ops.bertdist.bias_dropout_add_layer_norm_fwd(x, bias, residual, w, b, 0.2, EPS, 3, 0)
    torch.library.opcheck(torch.ops.bertdist.bias_dropout_add_layer_norm_bwd, (dy, h, mean, rstd, w, True, 0.2, rng))
    _, mean, rstd = torch.ops.bertdist.layer_norm_fwd(x, w, b, EPS)
    torch.library.opcheck(torch.ops.bertdist.layer_norm_bwd, (dy, x, mean, rstd, w))
