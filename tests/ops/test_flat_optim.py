"""The flat-buffer optimizer ops: the C++ CPU twin (``fused_optim`` on CPU tensors) and the
reference twins, against bertdist.train.lamb.Lamb and torch.optim.AdamW.

Tolerances: both sides compute each element's update with the same fp32 formula; they differ in
the order of the norm sums (per chunk, then over chunks, against torch's own reductions), which
moves the trust ratio and the clip coefficient by a few ulps, and in fused multiply-adds. Over 4
steps that stays below 1e-6 of the tensors' scale (measured: under 1e-7), far below what a wrong
formula gives (a missing bias correction or a swapped ratio moves the params by >1e-3).
"""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import fused_optim
from bertdist.ops.flat_layout import flat_layout
from bertdist.ops.optim_dispatch import REFERENCE
from tests.ops._util import assert_close_rel, ext
from tests.ops.flat_optim_cases import (SHAPES, ZERO_PARAM, clip_coefficient, flat, make_grads, make_params,
                                        run_flat, run_torch, step_with_bf16_copy)

TOL = 1e-6
WD_MIXED = [0.01, 0.0, 0.01, 0.01, 0.0, 0.01]  # two param groups' worth: decay on some tensors, off on others


def _twin():
    ext()
    return fused_optim._OPS


def _impls():
    return [pytest.param("twin", id="cpu_twin"), pytest.param("reference", id="reference")]


def _ops(name):
    return _twin() if name == "twin" else REFERENCE


def test_layout_cuts_each_segment_into_its_own_chunks():
    layout = flat_layout([5, 0, 1, 12], chunk_size=4)
    assert layout.table.tolist() == [[0, 5, 5, 6, 18], [0, 2, 2, 3, 6]]
    assert layout.num_chunks == 6 and layout.numel == 18
    assert layout.spans() == [(0, 5), (5, 5), (5, 6), (6, 18)]
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1, got 0"):
        flat_layout([3], 0)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("chunk_size", [1, 7, 65536])
def test_grad_norm_is_the_global_vector_norm(impl, chunk_size):
    ops = _ops(impl)
    gs = make_grads(steps=1)[0]
    g = flat(gs)
    layout = flat_layout([t.numel() for t in gs], chunk_size)
    seg, stats = ops.grad_norm(g, layout.table, layout.num_chunks, chunk_size, 0.0)
    want = torch.linalg.vector_norm(g.double())
    assert abs(stats[0].item() - want.item()) <= 1e-6 * want.item(), (stats.tolist(), want.item())
    assert stats[1].item() == 1.0, "max_norm 0 must disable clipping"
    want_seg = torch.stack([(t.double() ** 2).sum() for t in gs])
    assert_close_rel(seg, want_seg, TOL, "per-segment sums of g^2")
    _, clipped = ops.grad_norm(g, layout.table, layout.num_chunks, chunk_size, 0.5)
    assert abs(clipped[1].item() - 0.5 / (want.item() + 1e-6)) <= 1e-6, clipped.tolist()
    _, loose = ops.grad_norm(g, layout.table, layout.num_chunks, chunk_size, 1e6)
    assert loose[1].item() == 1.0, loose.tolist()


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("chunk_size", [7, 64, 65536])
def test_lamb_matches_lamb_optimizer(impl, chunk_size):
    params, grads = make_params(), make_grads(steps=4)
    p, m, v, _ = run_flat(_ops(impl), "lamb", params, grads, WD_MIXED, chunk_size=chunk_size)
    rp, rm, rv = run_torch("lamb", params, grads, WD_MIXED)
    assert_close_rel(p, rp, TOL, "params")
    assert_close_rel(m, rm, TOL, "exp_avg")
    assert_close_rel(v, rv, TOL, "exp_avg_sq")
    # The all-zero parameter has ||p|| = 0, so r = 1: its first update is lr * u exactly.
    layout = flat_layout([t.numel() for t in params])
    a, b = layout.spans()[ZERO_PARAM]
    assert not torch.equal(p[a:b], torch.zeros(b - a)), "the zero tensor was not updated"


@pytest.mark.parametrize("impl", _impls())
def test_lamb_without_bias_correction_matches_lamb_optimizer(impl):
    params, grads = make_params(), make_grads(steps=3)
    p, m, v, _ = run_flat(_ops(impl), "lamb", params, grads, WD_MIXED, bias_correction=False)
    rp, rm, rv = run_torch("lamb", params, grads, WD_MIXED, bias_correction=False)
    for name, a, b in (("params", p, rp), ("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
        assert_close_rel(a, b, TOL, name)


@pytest.mark.parametrize("impl", _impls())
def test_lamb_trust_ratio_rules(impl):
    # One step from m = v = 0 makes u = g / (|g| + eps) ~ sign(g): ||u|| ~ sqrt(n). Scaled params
    # push ||p|| / ||u|| above max_coeff and below min_coeff; a zero gradient with no weight decay
    # gives ||u|| = 0 and so r = 1 (the parameter stays).
    shapes = [(16,), (16,), (16,), (16,)]
    params = [torch.full((16,), 100.0), torch.full((16,), 1e-4), torch.zeros(16), torch.full((16,), 3.0)]
    grads = make_grads(shapes, steps=1, zero_last=True)
    wd = [0.0, 0.0, 0.0, 0.0]
    p, _, _, _ = run_flat(_ops(impl), "lamb", params, grads, wd, chunk_size=5, max_coeff=10.0, min_coeff=0.01)
    for i, r in ((0, 10.0), (1, 0.01), (2, 1.0)):
        u = grads[0][i] / (grads[0][i].abs() + 1e-6)  # bias correction cancels at step 1
        want = params[i] - 0.02 * r * u
        assert_close_rel(p[16 * i:16 * (i + 1)], want, TOL, f"tensor {i}: trust ratio {r}")
    assert torch.equal(p[48:], params[3]), "a zero update must leave the parameter as it was"


@pytest.mark.parametrize("impl", _impls())
def test_adamw_matches_torch_adamw(impl):
    params, grads = make_params(), make_grads(steps=5)
    p, m, v, _ = run_flat(_ops(impl), "adamw", params, grads, WD_MIXED, eps=1e-8)
    rp, rm, rv = run_torch("adamw", params, grads, WD_MIXED, eps=1e-8)
    assert_close_rel(p, rp, TOL, "params")
    assert_close_rel(m, rm, TOL, "exp_avg")
    assert_close_rel(v, rv, TOL, "exp_avg_sq")


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_clipping_equals_prescaled_gradients(impl, kind):
    params, grads = make_params(), make_grads(steps=3)
    max_norm = 0.25 * torch.linalg.vector_norm(flat(grads[0])).item()
    p, m, v, stats = run_flat(_ops(impl), kind, params, grads, WD_MIXED, max_norm=max_norm)
    scaled = [[g * clip_coefficient(gs, max_norm) for g in gs] for gs in grads]
    sp, sm, sv, _ = run_flat(REFERENCE, kind, params, scaled, WD_MIXED)
    assert_close_rel(p, sp, TOL, "params")
    assert_close_rel(m, sm, TOL, "exp_avg")
    assert_close_rel(v, sv, TOL, "exp_avg_sq")
    for gs, s in zip(grads, stats):
        norm = torch.linalg.vector_norm(flat(gs).double()).item()
        assert abs(s[0].item() - norm) <= 1e-6 * norm and s[1].item() < 1.0, (s.tolist(), norm)
    rp, _, _ = run_torch(kind, params, grads, WD_MIXED, max_norm=max_norm)
    assert_close_rel(p, rp, TOL, f"params against the per-tensor {kind} with clip_grad_norm_")


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_the_bf16_copy_is_the_updated_params_rounded(impl, kind):
    p, p_bf16 = step_with_bf16_copy(_ops(impl), kind)
    assert torch.equal(p_bf16, p.to(torch.bfloat16)), (p_bf16 - p.to(torch.bfloat16)).abs().max()


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_twin_matches_reference_with_bf16_gradients(kind):
    params, grads = make_params(), make_grads(steps=3)
    a = run_flat(_twin(), kind, params, grads, WD_MIXED, grad_dtype=torch.bfloat16, max_norm=1.0)
    b = run_flat(REFERENCE, kind, params, grads, WD_MIXED, grad_dtype=torch.bfloat16, max_norm=1.0)
    for name, x, y in zip(("params", "exp_avg", "exp_avg_sq"), a[:3], b[:3]):
        assert_close_rel(x, y, TOL, name)


def test_twin_is_deterministic_across_thread_counts():
    params, grads = make_params(), make_grads(steps=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_flat(_twin(), "lamb", params, grads, WD_MIXED, chunk_size=7)
        torch.set_num_threads(max(2, threads))
        many = run_flat(_twin(), "lamb", params, grads, WD_MIXED, chunk_size=7)
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(one[:3], many[:3]):
        assert torch.equal(x, y)


def test_entry_points_check_arguments():
    ops = _twin()
    layout = flat_layout([3, 4], 2)
    p, g = torch.zeros(7), torch.zeros(7)
    wd, stats = torch.zeros(2), torch.ones(2)
    kw = dict(step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6)
    with pytest.raises(RuntimeError, match=r"exp_avg must be a flat \[7\] buffer, got shape \[6\]"):
        ops.lamb_step_(p, g, torch.zeros(6), torch.zeros(7), layout.table, 4, 2, wd, stats, **kw)
    with pytest.raises(RuntimeError, match=r"segment 1 of 4 elements needs 2 chunks of 2, the table gives it 3"):
        bad = layout.table.clone()
        bad[1, 2] = 5
        ops.adamw_step_(p, g, torch.zeros(7), torch.zeros(7), bad, 5, 2, wd, stats, **kw)
    with pytest.raises(RuntimeError, match=r"the segments cover 7 elements, the buffers have 8"):
        ops.grad_norm(torch.zeros(8), layout.table, 4, 2, 0.0)
    with pytest.raises(RuntimeError, match=r"weight_decay must have shape \[2\], got \[3\]"):
        ops.adamw_step_(p, g, torch.zeros(7), torch.zeros(7), layout.table, 4, 2, torch.zeros(3), stats, **kw)
    with pytest.raises(RuntimeError, match=r"grads must be float32 or bfloat16, got Half"):
        ops.grad_norm(g.half(), layout.table, 4, 2, 0.0)
    with pytest.raises(RuntimeError, match=r"step must be >= 1 \(the count including this step\), got 0"):
        ops.lamb_step_(p, g, torch.zeros(7), torch.zeros(7), layout.table, 4, 2, wd, stats, **{**kw, "step": 0})
    with pytest.raises(RuntimeError, match=r"params_bf16 must have dtype BFloat16, got Float"):
        ops.adamw_step_(p, g, torch.zeros(7), torch.zeros(7), layout.table, 4, 2, wd, stats, **kw,
                        params_bf16=torch.zeros(7))
    with pytest.raises(RuntimeError, match=r"need 0 <= min_coeff <= max_coeff, got min_coeff 2, max_coeff 1"):
        ops.lamb_step_(p, g, torch.zeros(7), torch.zeros(7), layout.table, 4, 2, wd, stats, **kw, max_coeff=1.0,
                       min_coeff=2.0)


def test_fake_kernels_pass_opcheck():
    _twin()
    layout = flat_layout([3, 4], 2)
    g = torch.randn(7)
    torch.library.opcheck(torch.ops.bertdist.flat_grad_norm, (g, layout.table, 4, 2, 1.0))
    args = (torch.randn(7), g, torch.zeros(7), torch.zeros(7), layout.table, 4, 2, torch.zeros(2), torch.ones(2), 1,
            0.1, 0.9, 0.999, 1e-6)
    torch.library.opcheck(torch.ops.bertdist.flat_adamw_step, args + (torch.empty(7, dtype=torch.bfloat16),))
    torch.library.opcheck(torch.ops.bertdist.flat_lamb_step, args + (True, 10.0, 0.01, torch.empty(0, dtype=torch.bfloat16)))

