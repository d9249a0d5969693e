"""The CUDA layer-norm kernels, run by the emulator through the custom ops, against the reference
and the C++ CPU twin (``fused``): the same entry points a GPU call takes."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import emulated, fused
from bertdist.ops.reference import reference_bias_dropout_add_layer_norm, reference_layer_norm
from tests.emu._util import emu, launched
from tests.ops._util import assert_close_rel, assert_low_precision_ok, bdaln_with_mask, ext, grads, leaf

EPS = 1e-12


def _inputs(rows, hidden, dtype=torch.float32, seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).requires_grad_(True)

    x, residual = r(rows, hidden), r(rows, hidden)
    bias = r(hidden, scale=0.1) if with_bias else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).requires_grad_(True)
    return x, bias, residual, weight, r(hidden, scale=0.1)


# Vectorised (768, 4096) and scalar (770) layouts, one to four vectors per thread; 9 and 13
# rows exceed the emulated device's 8 backward blocks, so its grid-stride loop runs.
@pytest.mark.parametrize("rows,hidden", [(9, 128), (13, 770), (3, 4096)])
def test_layer_norm_fp32_forward_and_grads(rows, hidden):
    emu()
    x, _, _, w, b = _inputs(rows, hidden, seed=hidden)
    out = emulated.layer_norm(x, w, b, EPS)
    ref_in = [leaf(t) for t in (x, w, b)]
    ref = reference_layer_norm(*ref_in, EPS)
    assert_close_rel(out, ref, 1e-5, "y")
    g = torch.randn_like(ref)
    for name, a, c in zip(("dx", "dweight", "dbias"), grads(out, (x, w, b), g), grads(ref, ref_in, g)):
        assert_close_rel(a, c, 1e-5, f"{name} hidden={hidden}")


@pytest.mark.parametrize("hidden", [128, 770])
def test_dropout_bit_identical_to_cpu_twin(hidden):
    # The same seed and offset give the CUDA kernel and the C++ CPU kernel the same Philox mask:
    # the saved pre-norm sums h are equal bit for bit, and the backward regenerates that mask.
    C = ext()
    emu()
    rows, p, seed, offset = 11, 0.25, 1234, 7
    inputs = _inputs(rows, hidden, seed=hidden + 3)
    e_fwd, f_fwd = torch.ops.bertdist_emu.bias_dropout_add_layer_norm_fwd, torch.ops.bertdist.bias_dropout_add_layer_norm_fwd
    y_e, h_e, mean_e, rstd_e, rng_e = e_fwd(*inputs, p, EPS, seed, offset)
    y_f, h_f, _, _, rng_f = f_fwd(*inputs, p, EPS, seed, offset)
    assert torch.equal(h_e, h_f), "pre-norm sums differ: the dropout masks are not the CPU twin's"
    assert rng_e.tolist() == rng_f.tolist() == [seed, offset]
    assert_close_rel(y_e, y_f, 1e-5, "y against the CPU twin")
    x, bias, res, w, b = inputs
    keep = C.hidden_keep_mask(rows, hidden, p, seed, offset)
    ref_in = [leaf(t) for t in inputs]
    ref = bdaln_with_mask(*ref_in, keep, p, EPS)
    assert_close_rel(y_e, ref, 1e-5, "y against the explicit-mask reference")
    gy = torch.randn(rows, hidden)
    dh, dx, dw, dlnb, dbias = torch.ops.bertdist_emu.bias_dropout_add_layer_norm_bwd(gy, h_e, mean_e, rstd_e, w, True,
                                                                                    p, rng_e)
    assert torch.equal(dx != 0, keep & (dh != 0)), "the backward's mask is not the forward's"
    out = emulated.bias_dropout_add_layer_norm(*inputs, p=p, training=True, eps=EPS, seed=seed, offset=offset)
    for name, a, c in zip(("x", "bias", "residual", "weight", "ln_bias"), grads(out, inputs, gy), grads(ref, ref_in, gy)):
        assert_close_rel(a, c, 1e-5, f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_reference_error(dtype):
    emu()
    inputs = _inputs(10, 768, dtype=dtype, seed=11)
    kw = dict(p=0.1, training=False, eps=1e-5)
    g = torch.randn(10, 768).to(dtype)
    out = emulated.bias_dropout_add_layer_norm(*inputs, **kw)
    d_emu = grads(out, inputs, g)
    lp_in = [leaf(t) for t in inputs]
    ref_lp = reference_bias_dropout_add_layer_norm(*lp_in, **kw)
    d_lp = grads(ref_lp, lp_in, g)
    f32_in = [leaf(t.float()) for t in inputs]
    ref32 = reference_bias_dropout_add_layer_norm(*f32_in, **kw)
    d32 = grads(ref32, f32_in, g.float())
    assert out.dtype == dtype
    assert_low_precision_ok(out, ref_lp, ref32, f"y {dtype}")
    for name, a, b, c in zip(("x", "bias", "residual", "weight", "ln_bias"), d_emu, d_lp, d32):
        assert_low_precision_ok(a, b, c, f"d{name} {dtype}")
    # fp32 weights with low-precision activations (autocast's mix), a scalar-path width.
    x = leaf(torch.randn(6, 770).to(dtype))
    w, b = leaf(1 + 0.1 * torch.randn(770)), leaf(0.1 * torch.randn(770))
    assert_low_precision_ok(emulated.layer_norm(x, w, b, 1e-5), reference_layer_norm(x, w.to(dtype), b.to(dtype), 1e-5),
                            reference_layer_norm(x.float(), w, b, 1e-5), f"layer_norm {dtype}")


def test_misaligned_inputs_take_the_scalar_path():
    # A view one element into its storage is not 16-byte aligned: the launcher must pick
    # scalar accesses (the emulator faults on a misaligned vector access, as a GPU does).
    emu()
    base = torch.randn(5 * 768 + 1)
    x = base[1:].view(5, 768)
    assert x.data_ptr() % 16 != 0
    w, b = torch.randn(768), torch.randn(768)
    assert_close_rel(emulated.layer_norm(x, w, b, 1e-5), reference_layer_norm(x, w, b, 1e-5), 1e-5, "y")


# The odd width streams both ways; the unaligned views stream forward, while the backward's
# own tensors (h, the incoming gradient) are aligned and vectorised.
@pytest.mark.parametrize("hidden,misaligned,streamed", [
    (12289, False, {"ln_fwd_stream_kernel", "ln_bwd_stream_kernel"}),
    (16384, True, {"ln_fwd_stream_kernel", "ln_bwd_kernel"}),
])
def test_rows_too_wide_for_registers_take_the_streaming_kernels(hidden, misaligned, streamed):
    # The emulator found this: an odd hidden size above 8192, or an unaligned row above 8192,
    # needs more than 8 scalar elements per thread, and the CUDA launcher refused it ("hidden
    # size too large") although the op accepts up to 16384 and the CPU kernel takes any width.
    C = emu()
    before = C.emulator_counts()
    x, bias, res, w, b = _inputs(3, hidden, seed=5)
    if misaligned:  # views one element into their storage: not 16-byte aligned
        x, res = (torch.cat([torch.zeros(1), t.detach().view(-1)])[1:].view(3, hidden).requires_grad_(True)
                  for t in (x, res))
        assert x.data_ptr() % 16 != 0
    inputs = (x, bias, res, w, b)
    kw = dict(p=0.0, training=False, eps=EPS)
    out = emulated.bias_dropout_add_layer_norm(*inputs, **kw)
    ref_in = [leaf(t) for t in inputs]
    ref = reference_bias_dropout_add_layer_norm(*ref_in, **kw)
    assert_close_rel(out, ref, 1e-5, "y")
    g = torch.randn_like(ref)
    for name, a, c in zip(("x", "bias", "residual", "weight", "ln_bias"), grads(out, inputs, g), grads(ref, ref_in, g)):
        assert_close_rel(a, c, 1e-5, f"d{name}")
    assert streamed <= launched(before, C.emulator_counts())


def test_the_cuda_kernels_ran():
    C = emu()
    before = C.emulator_counts()
    x, bias, res, w, b = _inputs(4, 128, seed=1)
    emulated.bias_dropout_add_layer_norm(x, bias, res, w, b, p=0.1, training=True, eps=EPS).sum().backward()
    assert launched(before, C.emulator_counts()) == {"ln_fwd_kernel", "ln_bwd_kernel", "column_sum_kernel"}


def test_entry_points_check_arguments_as_on_cuda():
    emu()
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[64\], got \[32\]"):
        emulated.layer_norm(x, torch.randn(32), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"float64 is supported by the C\+\+ CPU kernels only"):
        emulated.layer_norm(x.double(), w.double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match=r"dropout on cpu needs an explicit seed"):
        torch.ops.bertdist_emu.bias_dropout_add_layer_norm_fwd(x, None, x, w, w, 0.1, 1e-5, None, 0)
    torch.library.opcheck(torch.ops.bertdist_emu.layer_norm_fwd, (x, w, w, 1e-5))
    assert fused.layer_norm is not emulated.layer_norm


@pytest.mark.parametrize("rows", [0, 5])
def test_column_sum_gradients_are_exact_with_and_without_rows(rows):
    """dweight, dbias and the dense bias's gradient: allocated uninitialised where the kernels
    write every column, zeros where there is no row to sum."""
    emu()
    for attempt in range(2):  # a second call reuses freed memory: garbage would show
        x, bias, res, w, b = _inputs(rows, 768, seed=attempt)
        out = emulated.bias_dropout_add_layer_norm(x, bias, res, w, b, p=0.0, training=True, eps=EPS)
        ref_in = [leaf(t) for t in (x, bias, res, w, b)]
        ref = reference_bias_dropout_add_layer_norm(*ref_in, p=0.0, training=True, eps=EPS)
        g = torch.randn_like(ref)
        for name, a, c in zip(("dbias", "dweight", "dln_bias"), grads(out, (bias, w, b), g),
                              grads(ref, ref_in[1:2] + ref_in[3:], g)):
            if rows == 0:
                assert torch.equal(a, torch.zeros_like(a)), name
            else:
                assert_close_rel(a, c, 1e-5, name)


def test_registered_from_cpp_in_its_own_namespace():
    """_C_emu registers the layer-norm family as bertdist_emu (its emulated CUDA kernels under the
    CPU key, no CUDA kernel), beside _C's bertdist in the same process."""
    emu()
    ext()
    ops = [f"{op}_{way}" for op in ("layer_norm", "bias_dropout_add_layer_norm") for way in ("fwd", "bwd")]
    for op in ops:
        name = f"bertdist_emu::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name
        assert torch._library.custom_ops._maybe_get_opdef(name) is None, name
    assert torch.Tag.nondeterministic_seeded in torch.ops.bertdist_emu.bias_dropout_add_layer_norm_fwd.default.tags
    x, w = torch.randn(4, 64, requires_grad=True), torch.ones(64, requires_grad=True)
    y = emulated.layer_norm(x, w, w, 1e-5)
    assert "LayerNormFunction" in y.grad_fn.name()
    C = emu()
    before = C.emulator_counts()
    y.sum().backward()
    assert launched(before, C.emulator_counts()) == {"ln_bwd_kernel", "column_sum_kernel"}
