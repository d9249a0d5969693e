"""LAMB against a from-the-paper scalar loop, AdamW wiring, the LR schedules."""
from __future__ import annotations

import math

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.device_profile import by_name
from bertdist.train.config import OptimizerConfig, ScheduleConfig
from bertdist.train.lamb import Lamb
from bertdist.train.optim import WarmupDecay, build_optimizer, build_scheduler, param_groups


def lamb_reference(w, grads, lr, b1, b2, eps, wd, max_c, min_c):
    """LAMB written out element by element in float64, independently of the implementation."""
    w = [float(x) for x in w]
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        u = []
        for i, gi in enumerate(g):
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            mh, vh = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            u.append(mh / (math.sqrt(vh) + eps) + wd * w[i])
        wn = math.sqrt(sum(x * x for x in w))
        un = math.sqrt(sum(x * x for x in u))
        r = min(max(wn / un, min_c), max_c) if wn > 0 and un > 0 else 1.0
        w = [wi - lr * r * ui for wi, ui in zip(w, u)]
    return w


@pytest.mark.parametrize("wd,scale", [(0.0, 1.0), (0.01, 1.0), (0.1, 1e-4), (0.0, 1e3)])
def test_lamb_matches_the_paper_formula(wd, scale):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, generator=gen) * scale  # scale exercises the trust-ratio clamp
    grads = [torch.randn(7, generator=gen) for _ in range(4)]
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([p], lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd, max_coeff=10.0, min_coeff=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = lamb_reference(w0.tolist(), [g.tolist() for g in grads], 0.05, 0.9, 0.99, 1e-6, wd, 10.0, 0.01)
    assert p.detach().double().tolist() == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_lamb_trust_ratio_is_per_tensor():
    # Two tensors of very different norms move by lr * ||w|| in relative terms, each its own.
    big = torch.nn.Parameter(torch.full((4,), 100.0))
    small = torch.nn.Parameter(torch.full((4,), 0.01))
    opt = Lamb([big, small], lr=0.1, weight_decay=0.0, max_coeff=1e9, min_coeff=0.0)
    big.grad, small.grad = torch.ones(4), torch.ones(4)
    opt.step()
    assert (100.0 - big.detach()).tolist() == pytest.approx([10.0] * 4, rel=1e-4)
    assert (0.01 - small.detach()).tolist() == pytest.approx([0.001] * 4, rel=1e-3)


def test_lamb_minimises_a_quadratic():
    torch.manual_seed(0)
    target = torch.randn(32)
    w = torch.nn.Parameter(torch.randn(32))
    opt = Lamb([w], lr=0.05, weight_decay=0.0)
    for _ in range(300):
        opt.zero_grad()
        ((w - target) ** 2).sum().backward()
        opt.step()
    assert torch.allclose(w.detach(), target, atol=0.05)


def test_param_groups_exclude_bias_and_layernorm_from_decay():
    from bertdist.model import BertConfig, BertForPreTraining

    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100, kernels="reference"), device_type="cpu")
    decay, no_decay = param_groups(model, OptimizerConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert not any("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in decay["params"])
    unique = {id(p) for p in model.parameters()}
    assert len(decay["params"]) + len(no_decay["params"]) == len(unique)  # tied decoder counted once
    assert isinstance(build_optimizer(model, OptimizerConfig(name="lamb"), "cpu"), Lamb)
    assert isinstance(build_optimizer(model, OptimizerConfig(name="adamw"), "cpu"), torch.optim.AdamW)
    with pytest.raises(ConfigError, match="needs CUDA"):
        build_optimizer(model, OptimizerConfig(implementation="fused"), "cpu")


def test_bert_paper_linear_schedule():
    f = WarmupDecay(warmup=10_000, total=1_000_000, decay="linear", power=1.0, min_ratio=0.0)
    assert f(0) == pytest.approx(1e-4)  # first update: 1/10k of the peak, never 0
    assert f(4_999) == pytest.approx(0.5)
    assert f(9_999) == pytest.approx(1.0)
    assert f(505_000 - 1) == pytest.approx(0.5)
    assert f(999_999) == pytest.approx(0.0)


def test_nvidia_lamb_poly_schedule():
    cfg = ScheduleConfig(total_steps=7038, warmup_fraction=0.2843, decay="poly", poly_power=0.5)
    assert cfg.resolved_warmup_steps == 2001
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=6e-3)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(7038):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert max(lrs) == pytest.approx(6e-3) and lrs.index(max(lrs)) == 2000
    mid = 2001 + (7038 - 2001) // 2
    assert lrs[mid - 1] == pytest.approx(6e-3 * math.sqrt(1 - (mid - 2001) / (7038 - 2001)), rel=1e-6)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ConfigError, match="not both"):
        ScheduleConfig(warmup_steps=10, warmup_fraction=0.1)


def test_gpu_optimizer_selection_never_depends_on_a_silent_jit_build(monkeypatch):
    """What a CUDA run gets, decided on CPU: torch's fused AdamW (nothing to build); FusedLamb only
    where DeepSpeed's op can load, else our Lamb with a warning; implementation=fused fails up
    front, naming what is missing."""
    from bertdist.model import BertConfig, BertForPreTraining
    from bertdist.train import optim

    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100, kernels="reference"), device_type="cpu")
    adamw = build_optimizer(model, OptimizerConfig(name="adamw"), "cuda")
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["fused"] is True
    assert not build_optimizer(model, OptimizerConfig(name="adamw"), "cpu").defaults["fused"]

    missing = (False, "DeepSpeed's fused_lamb op is not prebuilt and its first-use JIT build needs nvcc")
    monkeypatch.setattr(optim, "deepspeed_fused_status", lambda name, profile=None: missing)
    with pytest.warns(RuntimeWarning, match="needs nvcc.*PyTorch Lamb"):
        assert isinstance(build_optimizer(model, OptimizerConfig(name="lamb"), "cuda"), Lamb)
    with pytest.raises(ConfigError, match="implementation=fused: DeepSpeed's fused_lamb .* needs nvcc"):
        build_optimizer(model, OptimizerConfig(name="lamb", implementation="fused"), "cuda")


def test_deepspeed_fused_status_names_ninja_and_nvcc(monkeypatch):
    import deepspeed.git_version_info as info
    import torch.utils.cpp_extension as ce

    from bertdist.train.optim import deepspeed_fused_status

    monkeypatch.setitem(info.installed_ops, "fused_lamb", False)
    monkeypatch.setattr(ce, "is_ninja_available", lambda: False)
    no_toolkit = by_name("h100").with_(toolkit=None)
    ok, why = deepspeed_fused_status("lamb", no_toolkit)
    assert not ok and "ninja and nvcc (no CUDA toolkit found" in why and "DS_BUILD_FUSED_LAMB=1" in why
    monkeypatch.setitem(info.installed_ops, "fused_lamb", True)
    assert deepspeed_fused_status("lamb", no_toolkit) == (True, "DeepSpeed fused_lamb prebuilt")


# ---------------------------------------------------------------- FusedLamb only once it has been built


def _tiny_model():
    from bertdist.model import BertConfig, BertForPreTraining

    return BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=100, kernels="reference"), device_type="cpu")


def _jit_buildable(monkeypatch, profile):
    """A node where DeepSpeed's ops are not prebuilt but ninja and a toolkit are there, so FusedLamb
    would be JIT-built; the machine detected as ``profile``."""
    import deepspeed.git_version_info as info
    import torch.utils.cpp_extension as ce

    from bertdist import device_profile

    monkeypatch.setitem(info.installed_ops, "fused_lamb", False)
    monkeypatch.setitem(info.installed_ops, "fused_adam", False)
    monkeypatch.setattr(ce, "is_ninja_available", lambda: True)
    monkeypatch.setattr(device_profile, "detect", lambda: profile)


def _failing_build(monkeypatch, builder_name):
    """DeepSpeed's op builder raising its CUDA mismatch error when FusedLamb/FusedAdam load the op."""
    import deepspeed.ops.op_builder as ob
    from deepspeed.ops.op_builder.builder import CUDAMismatchException

    calls = []

    def load(self, verbose=False):
        calls.append(type(self).__name__)
        raise CUDAMismatchException(">- DeepSpeed Op Builder: Installed CUDA version 13.1 does not match the version "
                                    "torch was compiled with 13.0, unable to compile cuda/cpp extensions without a "
                                    "matching cuda version.")
    monkeypatch.setattr(getattr(ob, builder_name), "load", load)
    return calls


def test_lamb_falls_back_to_pytorch_lamb_when_the_fusedlamb_build_fails(monkeypatch):
    _jit_buildable(monkeypatch, by_name("h100"))
    calls = _failing_build(monkeypatch, "FusedLambBuilder")
    model = _tiny_model()
    with pytest.warns(RuntimeWarning) as record:
        opt = build_optimizer(model, OptimizerConfig(name="lamb"), "cuda")
    assert type(opt) is Lamb and calls  # the build was tried, and its failure caught
    (w,) = record.list
    msg = str(w.message)
    assert "fused_lamb op failed to build or load: CUDAMismatchException" in msg
    assert "13.1 does not match the version torch was compiled with 13.0" in msg and "PyTorch Lamb" in msg
    with pytest.raises(ConfigError, match="implementation=fused: DeepSpeed's fused_adam op failed .*13.1"):
        _failing_build(monkeypatch, "FusedAdamBuilder")
        build_optimizer(model, OptimizerConfig(name="adamw", implementation="fused"), "cuda")


def test_optimizer_choice_per_profile_without_building(monkeypatch):
    import deepspeed.ops.op_builder as ob

    from bertdist.train.optim import optimizer_choice

    h100 = by_name("h100")
    _jit_buildable(monkeypatch, h100)
    monkeypatch.setattr(ob.FusedLambBuilder, "load", lambda self, verbose=False: pytest.fail("built"))
    lamb, adamw = OptimizerConfig(name="lamb"), OptimizerConfig(name="adamw")
    impl, why = optimizer_choice(lamb, h100)
    assert impl == "deepspeed.ops.lamb.FusedLamb" and "toolkit 13.0 for torch's CUDA 13.0" in why
    assert "falls back to bertdist's Lamb" in why
    assert optimizer_choice(adamw, h100)[0] == "torch.optim.AdamW(fused=True)"
    assert optimizer_choice(OptimizerConfig(name="adamw", implementation="fused"), h100)[0] == \
        "deepspeed.ops.adam.FusedAdam"
    assert optimizer_choice(lamb, by_name("cpu")) == (
        "bertdist.train.lamb.Lamb", "implementation auto on cpu: DeepSpeed's fused optimizers are CUDA-only")
    assert optimizer_choice(OptimizerConfig(name="lamb", implementation="torch"), h100)[0] == "bertdist.train.lamb.Lamb"
    # A node whose toolkit DeepSpeed refuses for torch's CUDA 13.0 (its table stops at CUDA 12).
    impl, why = optimizer_choice(lamb, h100.with_(toolkit="13.1"))
    assert impl == "bertdist.train.lamb.Lamb"
    assert "toolkit 13.1 differs from torch's CUDA 13.0" in why and "DS_SKIP_CUDA_CHECK=1" in why
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")
    assert optimizer_choice(lamb, h100.with_(toolkit="13.1"))[0] == "deepspeed.ops.lamb.FusedLamb"
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK")
    # CUDA 12 minor versions DeepSpeed accepts as compatible.
    assert optimizer_choice(lamb, h100.with_(toolkit="12.4", torch_cuda="12.8"))[0] == "deepspeed.ops.lamb.FusedLamb"
    with pytest.raises(ConfigError, match="fused needs CUDA; this process runs on cpu"):
        optimizer_choice(OptimizerConfig(name="lamb", implementation="fused"), by_name("cpu"))
    with pytest.raises(ConfigError, match="implementation=fused: .*toolkit 13.1 differs"):
        optimizer_choice(OptimizerConfig(name="lamb", implementation="fused"), h100.with_(toolkit="13.1"))


# ---------------------------------------------------------------- Lamb.step: foreach, no host sync, same numbers


class _PerTensorLamb(Lamb):
    """The per-tensor LAMB loop (an ``if`` on the norms per tensor), kept as the oracle of the foreach step."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if group["bias_correction"]:
                    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
                else:
                    m_hat, v_hat = m, v
                w = p.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(w, alpha=group["weight_decay"])
                w_norm, u_norm = w.norm(), update.norm()
                if w_norm > 0 and u_norm > 0:
                    trust = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
                else:
                    trust = torch.ones((), dtype=torch.float32)
                w.add_(update * trust, alpha=-group["lr"])
                if w is not p:
                    p.copy_(w)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_foreach_lamb_step_equals_the_per_tensor_loop_bit_for_bit(bias_correction):
    gen = torch.Generator().manual_seed(3)
    shapes = [(17, 5), (5,), (3, 4, 2), (8,), (6,), (1,)]

    def params():
        g = torch.Generator().manual_seed(7)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g)))
              for s in shapes]
        ps[3].data.zero_()  # ||w|| = 0: trust ratio 1
        ps[5].data = ps[5].data.to(torch.bfloat16)  # low-precision parameter, written back in its dtype
        return ps

    a, b = params(), params()
    groups = lambda ps: [{"params": ps[:3], "weight_decay": 0.01}, {"params": ps[3:], "weight_decay": 0.0}]  # noqa: E731
    kw = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, bias_correction=bias_correction, max_coeff=10.0, min_coeff=0.01)
    new, old = Lamb(groups(a), **kw), _PerTensorLamb(groups(b), **kw)
    for step in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        grads[4].zero_()  # ||u|| = 0 without weight decay: trust ratio 1
        for i, (pa, pb, g) in enumerate(zip(a, b, grads)):
            skip = i == 2 and step == 1  # a tensor without a gradient this step keeps its own step count
            pa.grad = None if skip else g.to(pa.dtype).clone()
            pb.grad = None if skip else g.to(pb.dtype).clone()
        new.step()
        old.step()
        for pa, pb in zip(a, b):
            assert pa.dtype == pb.dtype and torch.equal(pa, pb)
            sa, sb = new.state[pa], old.state[pb]
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
            assert torch.equal(sa["step"], sb["step"])
    assert new.state[a[2]]["step"].item() == 4 and new.state[a[0]]["step"].item() == 5


def test_lamb_step_reads_no_device_value(monkeypatch):
    """The step reads no tensor on the host except the CPU step counts (a CUDA step never waits)."""
    reads = []
    real_item, real_bool = torch.Tensor.item, torch.Tensor.__bool__

    def item(t):
        reads.append(("item", t.device.type, t.dim()))
        return real_item(t)

    def as_bool(t):
        reads.append(("bool", t.device.type, t.dim()))
        return real_bool(t)

    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = Lamb(ps, lr=0.1)
    for p in ps:
        p.grad = torch.randn_like(p)
    monkeypatch.setattr(torch.Tensor, "item", item)
    monkeypatch.setattr(torch.Tensor, "__bool__", as_bool)
    opt.step()
    monkeypatch.undo()
    assert reads == [("item", "cpu", 0)] * len(ps)  # only each tensor's step count
    assert all(opt.state[p]["step"].device.type == "cpu" for p in ps)


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_warmup_stable_decay_at_its_boundaries(shape):
    """WSD over 1,000 updates: 100 of warmup, the peak until update 800, then 200 of decay to 10%."""
    cfg = ScheduleConfig(total_steps=1000, warmup_steps=100, warmup_fraction=None, decay="wsd",
                         decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.1)
    assert cfg.decay_steps == 200
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    f = build_scheduler(opt, cfg).lr_lambdas[0]
    lr = lambda update: f(update - 1)  # noqa: E731 - the multiplier of the n-th update (1-based)
    assert lr(1) == pytest.approx(0.01) and lr(50) == pytest.approx(0.5)
    assert lr(100) == 1.0 and lr(101) == 1.0 and lr(800) == 1.0  # warmup ends at the peak; stable until 800
    done = 1 / 200
    first = 1 - (math.sqrt(done) if shape == "1-sqrt" else done)
    assert lr(801) == pytest.approx(0.1 + 0.9 * first)
    half = 1 - (math.sqrt(0.5) if shape == "1-sqrt" else 0.5)
    assert lr(900) == pytest.approx(0.1 + 0.9 * half)
    assert lr(1000) == pytest.approx(0.1) and lr(1200) == pytest.approx(0.1)  # the floor, and it stays
    lrs = [lr(n) for n in range(800, 1001)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # strictly down through the decay


def test_wsd_config_errors():
    with pytest.raises(ConfigError, match=r"warmup 600 steps \+ decay 500 steps .* > total_steps 1000"):
        ScheduleConfig(total_steps=1000, warmup_steps=600, warmup_fraction=None, decay="wsd", decay_fraction=0.5)
    with pytest.raises(ConfigError, match=r"decay_fraction must be in \[0, 1\], got 1.5"):
        ScheduleConfig(total_steps=1000, decay="wsd", decay_fraction=1.5)


def test_wsd_without_its_decay_is_the_plateau_a_later_phase_decays_from():
    cfg = ScheduleConfig(total_steps=100, warmup_steps=10, warmup_fraction=None, decay="wsd", decay_fraction=0.0)
    f = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), cfg).lr_lambdas[0]
    assert cfg.decay_steps == 0 and f(4) == pytest.approx(0.5) and f(9) == f(50) == f(99) == f(150) == 1.0
