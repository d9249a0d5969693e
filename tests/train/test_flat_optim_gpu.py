"""FlatLamb and FlatAdamW on a CUDA device: the CUDA kernels against DeepSpeed's FusedLamb, torch's
fused AdamW, our Lamb and the C++ CPU twin; no host sync and a fixed launch count per step.

Tolerance 1e-6 of the scale against torch's own optimizers on the same device (same fp32
formulas, sums in another order), 1e-5 against DeepSpeed's FusedLamb (its kernel takes each
tensor's norms in its own chunked order and computes the trust ratio with its own rounding)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bertdist.ops import fused_optim
from bertdist.ops.flat_layout import flat_layout
from bertdist.train.flat_optim import FlatAdamW, FlatLamb
from bertdist.train.lamb import Lamb
from tests.ops._util import assert_close_rel
from tests.ops.flat_optim_cases import make_grads, make_params, run_flat
from tests.train.test_flat_optim import flat_params, groups, model

pytestmark = pytest.mark.gpu
TOL = 1e-6


def cuda_model(seed=0) -> nn.Module:
    return model(seed).cuda()


def _backward_cuda(m: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 11, (6, 5), generator=g).cuda()
    out = m(ids)
    ((out - torch.randn(out.shape, generator=g).cuda()) ** 2).mean().backward()


def _train(m, opt, steps):
    for s in range(steps):
        opt.zero_grad()
        _backward_cuda(m, s)
        opt.step()


def _fused_ok():
    ok, why = fused_optim.availability("cuda")
    if not ok:
        pytest.fail(f"the CUDA flat optimizer kernels are not usable on this GPU machine: {why}")


def test_flat_lamb_cuda_matches_lamb():
    _fused_ok()
    a, b = cuda_model(), cuda_model()
    opt = FlatLamb(groups(a), lr=0.01, max_grad_norm=0.0, kernels="fused")
    assert opt.kernel_source == "fused"
    _train(a, opt, 5)
    _train(b, Lamb(groups(b), lr=0.01), 5)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params after 5 steps")


def test_flat_lamb_cuda_matches_deepspeed_fused_lamb():
    _fused_ok()
    pytest.importorskip("deepspeed")
    from bertdist.train.optim import build_deepspeed_op

    ok, why = build_deepspeed_op("lamb")
    if not ok:
        pytest.skip(why)
    from deepspeed.ops.lamb import FusedLamb

    a, b = cuda_model(), cuda_model()
    _train(a, FlatLamb(groups(a), lr=0.01, kernels="fused"), 5)
    _train(b, FusedLamb(groups(b), lr=0.01, weight_decay=0.01, max_coeff=10.0, min_coeff=0.01), 5)
    assert_close_rel(flat_params(a), flat_params(b), 1e-5, "params against DeepSpeed's FusedLamb")


def test_flat_adamw_cuda_matches_torch_fused_adamw():
    _fused_ok()
    a, b = cuda_model(), cuda_model()
    _train(a, FlatAdamW(groups(a), lr=0.01, kernels="fused"), 5)
    _train(b, torch.optim.AdamW(groups(b), lr=0.01, fused=True), 5)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params against AdamW(fused=True)")


@pytest.mark.parametrize("kind", ["lamb", "adamw"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_the_cpu_twin(kind, grad_dtype):
    _fused_ok()
    params, grads = make_params(), make_grads(steps=3)
    wd = [0.01, 0.0, 0.01, 0.01, 0.0, 0.01]
    cpu = run_flat(fused_optim._OPS, kind, params, grads, wd, chunk_size=7, max_norm=1.0, grad_dtype=grad_dtype)
    on_gpu = run_flat(_CudaOps(), kind, params, grads, wd, chunk_size=7, max_norm=1.0, grad_dtype=grad_dtype)
    for name, x, y in zip(("params", "exp_avg", "exp_avg_sq"), on_gpu[:3], cpu[:3]):
        assert_close_rel(x.cpu(), y, TOL, name)
    for s, t in zip(on_gpu[3], cpu[3]):
        assert_close_rel(s.cpu(), t, TOL, "stats (norm, clip)")


class _CudaOps:
    """fused_optim's ops with the flat buffers moved to the GPU (run_flat builds them on the CPU)."""

    def grad_norm(self, g, table, *a):
        return tuple(t.cpu() for t in fused_optim.flat_grad_norm(g.cuda(), table.cuda(), *a))

    def _step(self, fn, p, g, m, v, table, nc, cs, wd, stats, **kw):
        bufs = [t.cuda() for t in (p, g, m, v)]
        fn(*bufs, table.cuda(), nc, cs, wd.cuda(), stats.cuda(), **kw)
        for dst, src in zip((p, m, v), (bufs[0], bufs[2], bufs[3])):
            dst.copy_(src.cpu())

    def lamb_step_(self, *a, **kw):
        self._step(fused_optim.flat_lamb_step_, *a, **kw)

    def adamw_step_(self, *a, **kw):
        self._step(fused_optim.flat_adamw_step_, *a, **kw)


@pytest.mark.parametrize("cls", [FlatLamb, FlatAdamW])
def test_the_bf16_copy_on_cuda(cls):
    _fused_ok()
    m = cuda_model()
    opt = cls(groups(m), lr=0.01, max_grad_norm=1.0, kernels="fused", bf16_copy=True)
    _train(m, opt, 2)
    assert torch.equal(opt.flat_params_bf16, opt.flat_params.to(torch.bfloat16))


def test_many_chunks_per_tensor_against_lamb():
    # 3 M elements: 46 chunks of the default size in one tensor, beside small ones.
    _fused_ok()
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(n, device="cuda")) for n in (3_000_000, 1024, 1)]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    a, b = FlatLamb(ps, lr=0.01, kernels="fused"), Lamb(qs, lr=0.01)
    for s in range(3):
        g = torch.Generator(device="cuda").manual_seed(s)
        for p, q in zip(ps, qs):
            p.grad.copy_(torch.randn(p.shape, device="cuda", generator=g))
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        assert_close_rel(p.detach(), q.detach(), TOL, f"tensor of {p.numel()}")


def test_a_step_is_deterministic_and_never_syncs():
    _fused_ok()
    results = []
    for _ in range(2):
        m = cuda_model()
        opt = FlatLamb(groups(m), lr=0.01, max_grad_norm=0.05, kernels="fused", chunk_size=16)
        _train(m, opt, 1)  # builds the cached weight-decay table (one copy to the device)
        opt.zero_grad()
        _backward_cuda(m, 1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
            norm = opt.grad_norm
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((flat_params(m), norm.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("cls,launches", [(FlatLamb, 4), (FlatAdamW, 3)])
def test_launches_per_step_do_not_grow_with_the_tensor_count(cls, launches):
    _fused_ok()
    from torch.profiler import ProfilerActivity, profile

    for layers in (2, 60):
        m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)]).cuda()
        opt = cls(m.parameters(), lr=0.01, max_grad_norm=1.0, kernels="fused")
        m(torch.randn(4, 16, device="cuda")).sum().backward()
        opt.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "flat_" in e.name]
        assert len(kernels) == launches, f"{2 * layers} tensors: {kernels}"


def test_flat_layout_table_and_ops_on_cuda_check_arguments():
    _fused_ok()
    layout = flat_layout([3, 4], 2)
    g = torch.zeros(7, device="cuda")
    with pytest.raises(RuntimeError, match=r"table must be on grads's device cuda:0, got cpu"):
        fused_optim.flat_grad_norm(g, layout.table, 4, 2, 0.0)
    seg, stats = fused_optim.flat_grad_norm(g + 1, layout.table.cuda(), 4, 2, 0.0)
    assert seg.tolist() == [3.0, 4.0] and abs(stats[0].item() - 7**0.5) < 1e-6

