"""The layer-norm family as registered from C++ (csrc/bindings.cpp): with the dispatcher (schema, tag,
CPU, Meta, autocast and autograd kernels), passing opcheck, with the reference twin's gradients, and
running no Python past the public function, in the forward or the backward."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bertdist.ops import fused
from bertdist.ops.reference import reference_bias_dropout_add_layer_norm, reference_layer_norm
from tests.ops._util import assert_close_rel, ext, grads, leaf

REPO = Path(__file__).resolve().parents[2]
FWD_OPS = ("layer_norm_fwd", "bias_dropout_add_layer_norm_fwd")
BWD_OPS = ("layer_norm_bwd", "bias_dropout_add_layer_norm_bwd")
EPS = 1e-5


def _inputs(rows, hidden, dtype, seed, param_dtype=None):
    g = torch.Generator().manual_seed(seed)
    pd = param_dtype or dtype

    def r(*shape, dt=dtype, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dt).requires_grad_(True)

    x, residual = r(rows, hidden), r(rows, hidden)
    bias = r(hidden, dt=pd, scale=0.1)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(pd).requires_grad_(True)
    return x, bias, residual, weight, r(hidden, dt=pd, scale=0.1)


def test_ops_are_registered_with_the_dispatcher():
    ext()
    for op in FWD_OPS + BWD_OPS:
        name = f"bertdist::{op}"
        for key in ("CPU", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), f"{name}: no {key} kernel"
        # defined in C++, not by torch.library.custom_op (whose ops carry a Python CustomOpDef)
        assert torch._library.custom_ops._maybe_get_opdef(name) is None, name
    for op in FWD_OPS:  # Autograd: the alias key, for every backend's autograd key
        for key in ("Autograd", "AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"bertdist::{op}", key), f"{op}: no {key} kernel"
        assert "bindings.cpp" in torch._C._dispatch_dump(f"bertdist::{op}").split("Autograd[alias]:")[1], op
    for op in BWD_OPS:  # the backwards run under the forward's autograd node, without one of their own
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"bertdist::{op}", "Autograd"), op
    seeded = torch.Tag.nondeterministic_seeded
    assert seeded in torch.ops.bertdist.bias_dropout_add_layer_norm_fwd.default.tags
    assert seeded not in torch.ops.bertdist.layer_norm_fwd.default.tags
    # the attention ops stay Python custom ops in the same namespace
    assert torch._library.custom_ops._maybe_get_opdef("bertdist::attention_fwd") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_opcheck_forward_and_backward(dtype, p):
    ext()
    x, bias, res, w, b = _inputs(6, 128, dtype, seed=4)
    ops = torch.ops.bertdist
    torch.library.opcheck(ops.layer_norm_fwd, (x, w, b, EPS))
    torch.library.opcheck(ops.bias_dropout_add_layer_norm_fwd, (x, bias, res, w, b, p, EPS, 7, 2))
    torch.library.opcheck(ops.bias_dropout_add_layer_norm_fwd, (x, None, res, w, b, p, EPS, 7, 2))
    with torch.no_grad():
        dy = torch.randn(6, 128).to(dtype)
        _, mean, rstd = ops.layer_norm_fwd(x, w, b, EPS)
        _, h, mean2, rstd2, rng = ops.bias_dropout_add_layer_norm_fwd(x, bias, res, w, b, p, EPS, 7, 2)
    torch.library.opcheck(ops.layer_norm_bwd, (dy, x.detach(), mean, rstd, w.detach()))
    for has_bias in (True, False):
        torch.library.opcheck(ops.bias_dropout_add_layer_norm_bwd, (dy, h, mean2, rstd2, w.detach(), has_bias, p, rng))


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtypes", [(torch.float32, None), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)])
def test_gradients_match_the_reference_twin(p, dtypes):
    """Gradients of every input, dropout off (the reference computes it) and on (an explicit mask
    from the same Philox stream), with the dense bias's gradient in the bias's own dtype."""
    mod = ext()
    dtype, param_dtype = dtypes
    rows, hidden, seed, offset = 12, 256, 19, 4
    inputs = _inputs(rows, hidden, dtype, seed=3, param_dtype=param_dtype)
    kw = dict(p=p, training=p > 0, eps=EPS)
    out = fused.bias_dropout_add_layer_norm(*inputs, **kw, seed=seed, offset=offset)
    ref_in = [leaf(t.float()) for t in inputs]
    if p > 0:
        from tests.ops._util import bdaln_with_mask

        ref = bdaln_with_mask(*ref_in, mod.hidden_keep_mask(rows, hidden, p, seed, offset), p, EPS)
    else:
        ref = reference_bias_dropout_add_layer_norm(*ref_in, **kw)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype
    assert_close_rel(out, ref, tol, "y")
    g = torch.randn(rows, hidden)
    fused_grads = grads(out, inputs, g.to(dtype))
    names = ("x", "bias", "residual", "weight", "ln_bias")
    for name, t, a, c in zip(names, inputs, fused_grads, grads(ref, ref_in, g)):
        assert a.dtype == t.dtype, f"d{name}: {a.dtype}, input {t.dtype}"
        assert_close_rel(a, c, tol, f"d{name} p={p} {dtypes}")
    x, w, b = (leaf(inputs[i]) for i in (0, 3, 4))
    y = fused.layer_norm(x, w, b, EPS)
    ref_in = [leaf(t.float()) for t in (x, w, b)]
    ref = reference_layer_norm(*ref_in, EPS)
    for name, a, c in zip(("x", "weight", "bias"), grads(y, (x, w, b), g.to(dtype)), grads(ref, ref_in, g)):
        assert_close_rel(a, c, tol, f"layer_norm d{name} {dtypes}")


def test_autograd_node_is_the_cpp_function():
    ext()
    x, bias, res, w, b = _inputs(4, 64, torch.float32, seed=1)
    y = fused.layer_norm(x, w, b, EPS)
    z = fused.bias_dropout_add_layer_norm(x, bias, res, w, b, p=0.1, training=True, eps=EPS, seed=3)
    for out, fn in ((y, "LayerNormFunction"), (z, "BiasDropoutAddLayerNormFunction")):
        name = out.grad_fn.name()
        assert "CppNode" in name and fn in name, name
        assert not isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction), type(out.grad_fn)
    # the forward's statistics, pre-norm sum and dropout record are not differentiable
    _, h, mean, rstd, rng = torch.ops.bertdist.bias_dropout_add_layer_norm_fwd(x, bias, res, w, b, 0.1, EPS, 3, 0)
    assert not any(t.requires_grad for t in (h, mean, rstd, rng))


def test_forward_and_backward_run_no_python_past_the_public_function():
    """A profile hook sees every Python function call: the forward may run the public function and
    the seed draw, the backward nothing of torch.library's or torch.autograd.Function's or ours."""
    ext()
    x, bias, res, w, b = _inputs(4, 64, torch.float32, seed=2)
    dy = torch.randn(4, 64)
    fused.layer_norm(x, w, b, EPS).backward(dy)  # first call: loads and resolves once
    calls: list[str] = []

    def hook(frame, event, arg):
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    def ours_or_library(c):
        return (os.sep + "bertdist" + os.sep in c or os.sep.join(("torch", "_library")) in c
                or os.sep.join(("autograd", "function.py")) in c)

    sys.setprofile(hook)
    try:
        y = fused.layer_norm(x, w, b, EPS)
        z = fused.bias_dropout_add_layer_norm(x, bias, res, w, b, p=0.1, training=True, eps=EPS, seed=3)
        fwd_calls, calls[:] = list(calls), []
        torch.autograd.backward((y, z), (dy, dy))
    finally:
        sys.setprofile(None)
    fwd_ours = sorted({c.rsplit(":", 1)[1] for c in fwd_calls if ours_or_library(c)})
    assert fwd_ours == ["_op_seed", "bias_dropout_add_layer_norm", "layer_norm"], fwd_ours
    assert not [c for c in calls if ours_or_library(c)], calls


def test_autocast_runs_the_layer_norms_in_fp32():
    ext()
    x = torch.randn(4, 64).bfloat16()
    w, b = torch.ones(64), torch.zeros(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused.layer_norm(x, w, b, EPS)
        z = fused.bias_dropout_add_layer_norm(x, None, torch.randn(4, 64), w, b, p=0.0, training=False, eps=EPS)
    assert y.dtype == torch.float32 and z.dtype == torch.float32
    assert_close_rel(y, reference_layer_norm(x.float(), w, b, EPS), 1e-6, "autocast y")


@pytest.mark.parametrize("order", ["extension first", "custom ops first"])
def test_cpp_and_python_registrations_of_one_namespace_load_in_either_order(order):
    """The C++ fragment and the Python custom ops (attention, flat optimizer) share the namespace;
    torch.compile traces the ops before any eager call."""
    first = "import bertdist._C" if order == "extension first" else "from bertdist.ops import fused, fused_optim"
    code = textwrap.dedent(f"""
        import torch
        {first}
        from bertdist.ops import fused, fused_optim
        from bertdist.ops import _extension
        assert _extension.load()[0] is not None
        x, w = torch.randn(3, 64, requires_grad=True), torch.ones(64, requires_grad=True)
        # traced before any eager call of the public function: the trace must not load anything
        f = torch.compile(lambda x, w: fused.bias_dropout_add_layer_norm(
            x, w, x, w, w, p=0.2, training=True, eps=1e-5, seed=5), backend="aot_eager", fullgraph=True)
        assert torch.equal(f(x, w), fused.bias_dropout_add_layer_norm(x, w, x, w, w, p=0.2, training=True,
                                                                      eps=1e-5, seed=5))
        fused.layer_norm(x, w, w, 1e-5).sum().backward()
        q = torch.randn(1, 1, 4, 32)
        fused.attention(q, q, q, None)
        print("ok", x.grad.shape)
        """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "BERTDIST_JIT": "0"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok torch.Size([3, 64])" in r.stdout, r.stderr[-3000:]


def test_compiled_with_dynamic_shapes_matches_eager_forward_and_backward():
    ext()

    def f(x, bias, res, w, b):
        y = fused.bias_dropout_add_layer_norm(x, bias, res, w, b, p=0.25, training=True, eps=EPS, seed=11, offset=2)
        return fused.layer_norm(y, w, b, EPS)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (5, 9):
        inputs = _inputs(rows, 128, torch.float32, seed=rows)
        out, ref = compiled(*inputs), f(*inputs)
        assert torch.equal(out, ref)
        g = torch.randn_like(ref)
        for a, c in zip(grads(out, inputs, g), grads(ref, inputs, g)):
            assert torch.equal(a, c)
