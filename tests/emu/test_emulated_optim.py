"""The CUDA flat-buffer optimizer kernels, run by the emulator through the custom ops
(``emulated.OPTIM``), against bertdist.train.lamb.Lamb, torch.optim.AdamW, the reference twins
and the C++ CPU twin. Tolerances as tests/ops/test_flat_optim.py: the same fp32 formulas, sums in
another order (the kernels reduce each chunk as a tree in fp32), under 1e-6 of the scale."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import emulated, fused_optim
from bertdist.ops.flat_layout import flat_layout
from bertdist.ops.optim_dispatch import REFERENCE
from bertdist.train.flat_optim import FlatLamb
from bertdist.train.lamb import Lamb
from tests.emu._util import emu, launched
from tests.ops._util import assert_close_rel, ext
from tests.ops.flat_optim_cases import (clip_coefficient, flat, make_grads, make_params, run_flat, run_torch,
                                        step_with_bf16_copy)
from tests.train.test_flat_optim import flat_params, groups, model, train

TOL = 1e-6
WD_MIXED = [0.01, 0.0, 0.01, 0.01, 0.0, 0.01]


def _emu_ops():
    emu()
    return emulated.OPTIM


# chunk 7: one segment spans up to 43 chunks, so the apply kernel's per-segment sum runs across
# blocks and threads; 1024: every segment is one chunk shorter than a block's 256 threads x 4.
@pytest.mark.parametrize("chunk_size", [7, 1024])
def test_lamb_matches_lamb_optimizer(chunk_size):
    params, grads = make_params(), make_grads(steps=4)
    p, m, v, _ = run_flat(_emu_ops(), "lamb", params, grads, WD_MIXED, chunk_size=chunk_size)
    rp, rm, rv = run_torch("lamb", params, grads, WD_MIXED)
    assert_close_rel(p, rp, TOL, "params")
    assert_close_rel(m, rm, TOL, "exp_avg")
    assert_close_rel(v, rv, TOL, "exp_avg_sq")


def test_lamb_trust_ratio_clamps_and_the_zero_rules():
    # As tests/ops: ||p|| / ||u|| of 100 clamps to max_coeff, of 1e-4 to min_coeff; a zero
    # parameter (||p|| = 0) and a zero update (||u|| = 0) take r = 1.
    params = [torch.full((16,), 100.0), torch.full((16,), 1e-4), torch.zeros(16), torch.full((16,), 3.0)]
    grads = make_grads([(16,)] * 4, steps=1, zero_last=True)
    p, _, _, _ = run_flat(_emu_ops(), "lamb", params, grads, [0.0] * 4, chunk_size=5)
    for i, r in ((0, 10.0), (1, 0.01), (2, 1.0)):
        u = grads[0][i] / (grads[0][i].abs() + 1e-6)
        assert_close_rel(p[16 * i:16 * (i + 1)], params[i] - 0.02 * r * u, TOL, f"tensor {i}: trust ratio {r}")
    assert torch.equal(p[48:], params[3]), "a zero update must leave the parameter as it was"


def test_adamw_matches_torch_adamw():
    params, grads = make_params(), make_grads(steps=5)
    p, m, v, _ = run_flat(_emu_ops(), "adamw", params, grads, WD_MIXED, chunk_size=7, eps=1e-8)
    rp, rm, rv = run_torch("adamw", params, grads, WD_MIXED, eps=1e-8)
    assert_close_rel(p, rp, TOL, "params")
    assert_close_rel(m, rm, TOL, "exp_avg")
    assert_close_rel(v, rv, TOL, "exp_avg_sq")


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_clipping_equals_prescaled_gradients_and_reports_the_norm(kind):
    params, grads = make_params(), make_grads(steps=3)
    max_norm = 0.25 * torch.linalg.vector_norm(flat(grads[0])).item()
    p, m, v, stats = run_flat(_emu_ops(), kind, params, grads, WD_MIXED, chunk_size=7, max_norm=max_norm)
    scaled = [[g * clip_coefficient(gs, max_norm) for g in gs] for gs in grads]
    sp, sm, sv, _ = run_flat(REFERENCE, kind, params, scaled, WD_MIXED)
    for name, a, b in (("params", p, sp), ("exp_avg", m, sm), ("exp_avg_sq", v, sv)):
        assert_close_rel(a, b, TOL, name)
    for gs, s in zip(grads, stats):
        norm = torch.linalg.vector_norm(flat(gs).double()).item()
        assert abs(s[0].item() - norm) <= 1e-6 * norm, (s.tolist(), norm)
        assert abs(s[1].item() - max_norm / (norm + 1e-6)) <= 1e-6, (s.tolist(), max_norm, norm)


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_bf16_gradients_match_the_cpu_twin(kind):
    ext()
    params, grads = make_params(), make_grads(steps=2)
    a = run_flat(_emu_ops(), kind, params, grads, WD_MIXED, chunk_size=7, grad_dtype=torch.bfloat16, max_norm=1.0)
    b = run_flat(fused_optim._OPS, kind, params, grads, WD_MIXED, chunk_size=7, grad_dtype=torch.bfloat16,
                 max_norm=1.0)
    for name, x, y in zip(("params", "exp_avg", "exp_avg_sq"), a[:3], b[:3]):
        assert_close_rel(x, y, TOL, name)


def test_a_lamb_step_is_four_launches_whatever_the_tensor_count():
    C = emu()
    for count in (3, 40):
        sizes = [5 + i for i in range(count)]
        layout = flat_layout(sizes, 4)
        n = layout.numel
        p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
        before = C.emulator_counts()
        _, stats = emulated.OPTIM.grad_norm(g, layout.table, layout.num_chunks, 4, 1.0)
        emulated.OPTIM.lamb_step_(p, g, m, v, layout.table, layout.num_chunks, 4, torch.zeros(count), stats, step=1,
                                  lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6)
        after = C.emulator_counts()
        names = launched(before, after)
        assert names == {"flat_sumsq_kernel", "flat_norm_finalize_kernel", "flat_lamb_moments_kernel",
                         "flat_lamb_apply_kernel"}, names
        launches = {k: after["kernels"][k][0] - before["kernels"].get(k, (0, 0, 0))[0] for k in names}
        assert launches == dict.fromkeys(names, 1), f"{count} tensors: {launches}"


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_the_bf16_copy_is_the_updated_params_rounded(kind):
    p, p_bf16 = step_with_bf16_copy(_emu_ops(), kind)
    assert torch.equal(p_bf16, p.to(torch.bfloat16)), (p_bf16.float() - p).abs().max()


def test_repeated_runs_are_bitwise_equal():
    params, grads = make_params(), make_grads(steps=2)
    a = run_flat(_emu_ops(), "lamb", params, grads, WD_MIXED, chunk_size=7, max_norm=1.0)
    b = run_flat(_emu_ops(), "lamb", params, grads, WD_MIXED, chunk_size=7, max_norm=1.0)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert all(torch.equal(s, t) for s, t in zip(a[3], b[3]))


def test_flat_lamb_optimizer_on_the_emulated_kernels():
    emu()
    a, b = model(), model()
    opt = FlatLamb(groups(a), lr=0.01, max_grad_norm=0.05, kernels="emulated", chunk_size=32)
    assert opt.kernel_source == "emulated"
    train(a, opt, 3)
    train(b, Lamb(groups(b), lr=0.01), 3, clip=0.05)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params against Lamb with clip_grad_norm_")


def test_bf16_parameters_on_the_emulated_kernels_track_their_fp32_masters():
    """bf16 weights (``param_dtype``): given the same bf16 gradients, the CUDA kernels keep the fp32
    masters within the tolerance of the C++ twin's, and write each bf16 parameter as its own
    master's rounding."""
    emu()
    a, b = model(), model()
    opts = [FlatLamb(groups(m), lr=0.01, max_grad_norm=0.05, kernels=k, chunk_size=32, param_dtype=torch.bfloat16)
            for m, k in ((a, "emulated"), (b, "fused"))]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in opts[0]._params]
        for opt in opts:
            opt.zero_grad()
            for p, grad in zip(opt._params, grads):
                p.grad.copy_(grad)
            opt.step()
    emu_opt, twin = opts
    assert_close_rel(emu_opt.flat_params, twin.flat_params, TOL, "fp32 masters against the C++ twin's")
    for p, master in zip(emu_opt._params, emu_opt.master_params()):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), master.to(torch.bfloat16))
