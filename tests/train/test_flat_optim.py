"""FlatLamb and FlatAdamW (bertdist.train.flat_optim) on a small model, against Lamb and
torch.optim.AdamW; gradients through the flat buffer; clipping; checkpoints.

Tolerance 1e-6 of the scale, as tests/ops/test_flat_optim.py explains (same fp32 formulas, norm
sums in another order). The CPU-side implementations are the C++ twin ("fused") and the
reference ops; the emulated CUDA kernels run in tests/emu, the real ones in the GPU tests."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from bertdist.train.flat_optim import FlatAdamW, FlatLamb
from bertdist.train.lamb import Lamb
from tests.ops._util import assert_close_rel

TOL = 1e-6
IMPLS = ["fused", "reference"]


def model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))
    with torch.no_grad():
        m[1].bias.zero_()  # a zero tensor: LAMB's r = 1 rule in a real model
    return m


def groups(m: nn.Module, **extra) -> list[dict]:
    decay = [p for n, p in m.named_parameters() if "weight" in n and "3." not in n]
    no_decay = [p for n, p in m.named_parameters() if not ("weight" in n and "3." not in n)]
    return [{"params": decay, "weight_decay": 0.01, **extra}, {"params": no_decay, "weight_decay": 0.0}]


def backward(m: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 11, (6, 5), generator=g)
    out = m(ids)
    ((out - torch.randn(out.shape, generator=g)) ** 2).mean().backward()


def train(m: nn.Module, opt, steps: int, first: int = 0, clip: float = 0.0) -> list[float]:
    norms = []
    for s in range(first, first + steps):
        opt.zero_grad()
        backward(m, s)
        norms.append(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in m.parameters()])).item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
    return norms


def flat_params(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("kernels", IMPLS)
def test_flat_lamb_matches_lamb(kernels):
    a, b = model(), model()
    train(a, FlatLamb(groups(a), lr=0.01, kernels=kernels, chunk_size=32), 5)
    train(b, Lamb(groups(b), lr=0.01), 5)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params after 5 steps")


@pytest.mark.parametrize("kernels", IMPLS)
def test_flat_adamw_matches_torch_adamw(kernels):
    a, b = model(), model()
    train(a, FlatAdamW(groups(a), lr=0.01, kernels=kernels, chunk_size=32), 5)
    train(b, torch.optim.AdamW(groups(b), lr=0.01, foreach=False), 5)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params after 5 steps")


@pytest.mark.parametrize("cls,other", [(FlatLamb, Lamb), (FlatAdamW, torch.optim.AdamW)])
def test_groups_with_their_own_lr_each_get_it(cls, other):
    # Differing lr: the groups go to the kernels as separate runs of the flat buffers.
    a, b = model(), model()
    opt = cls(groups(a, lr=0.003), lr=0.01, kernels="fused", chunk_size=32)
    assert len(opt._runs()) == 2
    train(a, opt, 4)
    train(b, other(groups(b, lr=0.003), lr=0.01), 4)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params")


@pytest.mark.parametrize("cls,other", [(FlatLamb, Lamb), (FlatAdamW, torch.optim.AdamW)])
def test_clipping_and_the_reported_norm(cls, other):
    a, b = model(), model()
    opt = cls(groups(a), lr=0.01, max_grad_norm=0.05, kernels="fused", chunk_size=32)
    assert opt.grad_norm is None
    norms = []
    for s in range(4):
        opt.zero_grad()
        backward(a, s)
        norms.append(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in a.parameters()])).item())
        opt.step()
        assert abs(opt.grad_norm.item() - norms[-1]) <= 1e-6 * norms[-1], (opt.grad_norm.item(), norms[-1])
        assert opt.grad_norm.dim() == 0 and opt.grad_norm.device == opt.device
    assert min(norms) > 0.05, f"the gradients must be clipped for this test to mean anything: norms {norms}"
    train(b, other(groups(b), lr=0.01), 4, clip=0.05)
    assert_close_rel(flat_params(a), flat_params(b), TOL, "params against clip_grad_norm_ + the per-tensor optimizer")


@pytest.mark.parametrize("cls", [FlatLamb, FlatAdamW])
def test_the_bf16_copy_follows_every_step(cls):
    m = model()
    opt = cls(groups(m), lr=0.01, kernels="fused", bf16_copy=True)
    assert torch.equal(opt.flat_params_bf16, opt.flat_params.to(torch.bfloat16))
    train(m, opt, 2)
    assert torch.equal(opt.flat_params_bf16, opt.flat_params.to(torch.bfloat16))
    for p, b in zip(opt._params, opt.bf16_params()):
        assert b.shape == p.shape and torch.equal(b, p.detach().to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16_copy=True"):
        cls(groups(model()), kernels="fused").bf16_params()


def test_parameters_and_gradients_live_in_the_flat_buffers():
    m = model()
    opt = FlatLamb(groups(m), lr=0.01, kernels="fused")
    flat = opt.flat_params
    base, end = flat.data_ptr(), flat.data_ptr() + 4 * flat.numel()
    for p in m.parameters():
        assert base <= p.data_ptr() < end or p.numel() == 0
    backward(m, 0)
    assert torch.equal(opt._flat_grads, torch.cat([p.grad.reshape(-1) for p in opt._params]))
    # Module.zero_grad() drops the views; backward then makes fresh tensors, copied in at step.
    m.zero_grad()
    backward(m, 1)
    fresh = torch.cat([p.grad.reshape(-1) for p in opt._params]).clone()
    opt.step()
    assert torch.equal(opt._flat_grads, fresh)
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(opt._params, opt._grad_views))


@pytest.mark.parametrize("cls", [FlatLamb, FlatAdamW])
@pytest.mark.parametrize("kernels", IMPLS)
def test_state_dict_round_trip_resumes_exactly(cls, kernels):
    straight = model()
    opt = cls(groups(straight), lr=0.01, max_grad_norm=1.0, kernels=kernels, chunk_size=32)
    train(straight, opt, 5)

    first = model()
    opt1 = cls(groups(first), lr=0.01, max_grad_norm=1.0, kernels=kernels, chunk_size=32)
    train(first, opt1, 3)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optim": opt1.state_dict()}, buf)
    sd = opt1.state_dict()
    for p, st in zip(opt1._params, (sd["state"][i] for i in range(len(opt1._params)))):
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["exp_avg"].shape == p.shape
        assert st["step"].item() == 3.0 and st["step"].device.type == "cpu"

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = model(seed=1)  # other initial values: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = cls(groups(resumed), lr=0.01, max_grad_norm=1.0, kernels=kernels, chunk_size=32)
    opt2.load_state_dict(ckpt["optim"])
    train(resumed, opt2, 2, first=3)
    assert torch.equal(flat_params(resumed), flat_params(straight)), "resume differs from the uninterrupted run"
    assert torch.equal(opt2._exp_avg, opt._exp_avg) and torch.equal(opt2._exp_avg_sq, opt._exp_avg_sq)


def test_a_lamb_checkpoint_loads_into_flat_lamb():
    # Same state names and shapes as Lamb: a checkpoint of today's optimizer resumes here.
    a, b = model(), model()
    lamb = Lamb(groups(a), lr=0.01)
    train(a, lamb, 3)
    b.load_state_dict(a.state_dict())
    flat = FlatLamb(groups(b), lr=0.01, kernels="fused", chunk_size=32)
    flat.load_state_dict(lamb.state_dict())
    train(a, lamb, 2, first=3)
    train(b, flat, 2, first=3)
    assert_close_rel(flat_params(b), flat_params(a), TOL, "params after resuming Lamb's checkpoint")


def test_mismatched_step_counts_in_a_group_are_refused():
    m = model()
    lamb = Lamb(groups(m), lr=0.01)
    train(m, lamb, 2)
    sd = lamb.state_dict()
    sd["state"][0]["step"] = torch.tensor(7.0)
    flat = FlatLamb(groups(model()), lr=0.01, kernels="fused")
    with pytest.raises(ValueError, match=r"param group 0: .* per-parameter step counts \[2, 7\]"):
        flat.load_state_dict(sd)


def test_constructor_checks():
    m = model()
    with pytest.raises(ValueError, match=r"fp32 parameters; got torch.float16"):
        FlatLamb([nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    with pytest.raises(ValueError, match=r"need 0 <= min_coeff <= max_coeff, got min_coeff 2.0, max_coeff 1.0"):
        FlatLamb(m.parameters(), max_coeff=1.0, min_coeff=2.0)
    with pytest.raises(ValueError, match=r"kernels must be one of auto, fused, reference, emulated, got 'fast'"):
        FlatAdamW(m.parameters(), kernels="fast")
    opt = FlatAdamW(groups(m), kernels="fused")
    assert opt.kernel_source == "fused"
    with pytest.raises(RuntimeError, match="fixed at construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    # A wrapper that swaps the group's tensors (as DeepSpeed's bf16 optimizer does) is refused at step.
    opt.param_groups[0]["params"] = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    with pytest.raises(RuntimeError, match=r"the param groups hold other tensors than the 7 the flat buffers"):
        opt.step()


# ---------------------------------------------------------------- bf16 parameters, fp32 masters

BF16 = torch.bfloat16


def _masters_are_rounded_into_params(opt) -> None:
    for p, master in zip(opt._params, opt.master_params()):
        assert p.dtype == BF16 and master.dtype == torch.float32
        assert torch.equal(p.detach(), master.to(BF16)), "a bf16 parameter is not its master's rounding"


@pytest.mark.parametrize("cls", [FlatLamb, FlatAdamW])
@pytest.mark.parametrize("kernels", IMPLS)
def test_bf16_parameters_are_the_rounding_of_fp32_masters(cls, kernels):
    m = model()
    gs = groups(m)
    before = [p.detach().clone() for g in gs for p in g["params"]]
    opt = cls(gs, lr=0.01, kernels=kernels, chunk_size=32, param_dtype=BF16)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_params(), before)), "masters are not the fp32 weights"
    _masters_are_rounded_into_params(opt)
    for p in m.parameters():
        assert p.grad.dtype == BF16 and p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
    train(m, opt, 3)
    _masters_are_rounded_into_params(opt)
    assert not torch.equal(opt.flat_params, opt.flat_params.to(BF16).float()), "masters hold only bf16 values"


@pytest.mark.parametrize("cls", [FlatLamb, FlatAdamW])
@pytest.mark.parametrize("kernels", IMPLS)
def test_bf16_parameters_update_the_masters_exactly_as_fp32_parameters(cls, kernels):
    """Given the same (bf16-exact) gradients, the masters take the very steps the fp32 optimizer's
    parameters take: the update runs on fp32, never on the bf16 copy."""
    a, b = model(), model()
    fp32 = cls(groups(a), lr=0.01, max_grad_norm=0.5, kernels=kernels, chunk_size=32)
    bf16 = cls(groups(b), lr=0.01, max_grad_norm=0.5, kernels=kernels, chunk_size=32, param_dtype=BF16)
    for s in range(4):
        fp32.zero_grad()
        bf16.zero_grad()
        backward(a, s)
        for pa, pb in zip(fp32._params, bf16._params):
            g = pa.grad.to(BF16)
            pa.grad.copy_(g)
            pb.grad.copy_(g)
        fp32.step()
        bf16.step()
        assert torch.equal(bf16.flat_grads, fp32.flat_grads) and torch.equal(bf16.grad_norm, fp32.grad_norm)
        assert torch.equal(bf16.flat_params, fp32.flat_params), f"step {s}: masters differ from fp32 parameters"
    _masters_are_rounded_into_params(bf16)


def test_micro_batch_gradients_accumulate_in_fp32():
    """1 + 8 x 2^-9: bf16 (8 significant bits) rounds every 2^-9 away, fp32 keeps the sum."""
    w = nn.Parameter(torch.ones(4))
    opt = FlatAdamW([w], lr=0.0, kernels="fused", param_dtype=BF16)
    coeffs = [1.0] + [2.0 ** -9] * 8
    for c in coeffs:
        (w * c).sum().backward()
        opt.accumulate_grads()
    assert torch.equal(w.main_grad, torch.full((4,), sum(coeffs))), w.main_grad
    assert torch.equal(w.grad, torch.zeros(4, dtype=BF16)), "the bf16 buffer is not zeroed after folding"
    opt.zero_grad()
    for c in coeffs:  # without folding between the micro-batches the sum is bf16's
        (w * c).sum().backward()
    opt.step()
    assert torch.equal(w.main_grad, torch.ones(4)), w.main_grad


def test_bf16_masters_through_the_module_state_dict():
    m = model()
    opt = FlatLamb(groups(m), lr=0.01, kernels="fused", param_dtype=BF16)
    opt.bind_module(m)
    train(m, opt, 3)
    sd = m.state_dict()
    masters = {id(p): mp for p, mp in zip(opt._params, opt.master_params())}
    for name, p in m.named_parameters():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], masters[id(p)]), name
    buf = io.BytesIO()
    torch.save({"model": sd, "optim": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    other = model(seed=1)
    opt2 = FlatLamb(groups(other), lr=0.01, kernels="fused", param_dtype=BF16)
    opt2.bind_module(other)
    other.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    assert torch.equal(opt2.flat_params, opt.flat_params), "load_state_dict did not write the fp32 masters"
    _masters_are_rounded_into_params(opt2)
    train(m, opt, 2, first=3)
    train(other, opt2, 2, first=3)
    assert torch.equal(opt2.flat_params, opt.flat_params), "resume from the state dicts is not exact"
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict({**ckpt["model"], "1.weight": torch.zeros(3, 3)})


def test_param_dtype_is_checked():
    with pytest.raises(ValueError, match=r"param_dtype must be torch.float32 or torch.bfloat16, got torch.float16"):
        FlatLamb(groups(model()), param_dtype=torch.float16)


def _grads_of_rank(opt, rank: int) -> list[torch.Tensor]:
    """bf16-exact gradients that differ per rank: rank r's are (r + 1) x one base."""
    g = torch.Generator().manual_seed(5)
    return [((rank + 1) * torch.randn(p.shape, generator=g)).to(BF16) for p in opt._params]


def _reducing_rank(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        m = model()
        opt = FlatLamb(groups(m), lr=0.01, kernels="fused", param_dtype=BF16)
        opt.reduce_gradients(world)
        for p, g in zip(opt._params, _grads_of_rank(opt, rank)):
            p.grad.copy_(g)
        opt.step()
        torch.save(opt.flat_params.clone(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~20 s on a busy 2-core machine
def test_bf16_gradients_are_averaged_over_ranks_in_fp32(tmp_path):
    """Two gloo ranks with different gradients end with the masters of one fp32 optimizer given
    their fp32 mean (both sums are exact, so the comparison is bitwise)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "masters")
    mp.start_processes(_reducing_rank, args=(2, str(tmp_path / "rendezvous"), out), nprocs=2, start_method="spawn")
    a = model()
    fp32 = FlatLamb(groups(a), lr=0.01, kernels="fused")
    for p, g0, g1 in zip(fp32._params, _grads_of_rank(fp32, 0), _grads_of_rank(fp32, 1)):
        p.grad.copy_((g0.float() + g1.float()) / 2)
    fp32.step()
    for rank in range(2):
        assert torch.equal(torch.load(f"{out}.{rank}", weights_only=True), fp32.flat_params), f"rank {rank}"


def test_state_dicts_load_across_fp32_and_bf16_parameters():
    """A checkpoint of fp32 parameters (autocast's) resumes with bf16 parameters and the reverse:
    both carry fp32 weights and fp32 moments, which load exactly."""
    a = model()
    fp32 = FlatLamb(groups(a), lr=0.01, kernels="fused")
    train(a, fp32, 2)
    b = model(seed=1)
    bf16 = FlatLamb(groups(b), lr=0.01, kernels="fused", param_dtype=BF16)
    bf16.bind_module(b)
    b.load_state_dict(a.state_dict())
    bf16.load_state_dict(fp32.state_dict())
    assert torch.equal(bf16.flat_params, fp32.flat_params) and torch.equal(bf16._exp_avg_sq, fp32._exp_avg_sq)
    _masters_are_rounded_into_params(bf16)
    train(b, bf16, 2, first=2)
    c = model(seed=2)
    back = FlatLamb(groups(c), lr=0.01, kernels="fused")
    c.load_state_dict(b.state_dict())
    back.load_state_dict(bf16.state_dict())
    assert torch.equal(back.flat_params, bf16.flat_params) and torch.equal(back._exp_avg, bf16._exp_avg)
    assert back._steps == bf16._steps == [4, 4]
