"""StableAdamW against its definition written out per element, its update clipping on a spiky
gradient, its lr-independent weight decay, its exact resume from a state dict, and its config."""
from __future__ import annotations

import math

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.train.config import OptimizerConfig
from bertdist.train.optim import STABLE_ADAMW, build_optimizer, optimizer_choice
from bertdist.train.stable_adamw import StableAdamW, debiased_beta


def by_hand(params, grads_per_step, lrs, *, betas, eps, wd, max_lr, lr_independent):
    """The definition, element by element in Python floats (float64), no tensors."""
    b1, b2 = betas
    p = [list(map(float, x.flatten().tolist())) for x in params]
    m = [[0.0] * len(x) for x in p]
    v = [[0.0] * len(x) for x in p]
    rms_seen = []
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs), start=1):
        bb1 = b1 * (1 - b1 ** (t - 1)) / (1 - b1**t)
        bb2 = b2 * (1 - b2 ** (t - 1)) / (1 - b2**t)
        for i, g in enumerate(grads):
            g = g.flatten().tolist()
            for j in range(len(g)):
                m[i][j] = bb1 * m[i][j] + (1 - bb1) * g[j]
                v[i][j] = bb2 * v[i][j] + (1 - bb2) * g[j] * g[j]
            rms = math.sqrt(sum(g[j] ** 2 / max(v[i][j], eps * eps) for j in range(len(g))) / len(g))
            rms_seen.append(rms)
            lr_p = lr / max(1.0, rms)
            decay = 1 - (lr_p / max_lr if lr_independent else lr_p) * wd
            for j in range(len(g)):
                p[i][j] = p[i][j] * decay - lr_p * m[i][j] / (math.sqrt(v[i][j]) + eps)
    return [torch.tensor(x, dtype=torch.float64).view_as(params[i]) for i, x in enumerate(p)], rms_seen


def run(params, grads_per_step, lrs, **kw):
    ps = [x.clone().requires_grad_(True) for x in params]
    opt = StableAdamW(ps, lr=lrs[0], **kw)
    for grads, lr in zip(grads_per_step, lrs):
        for group in opt.param_groups:
            group["lr"] = lr  # as a scheduler does
        for x, g in zip(ps, grads):
            x.grad = g.clone()
        opt.step()
    return [x.detach() for x in ps], opt


@pytest.mark.parametrize("lr_independent", [False, True])
def test_matches_the_definition_written_out_per_element(lr_independent):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(3, 4, generator=g) * s, torch.randn(5, generator=g) * 0.1] for s in (1.0, 0.5, 3.0, 1.0, 40.0)]
    lrs = [1e-2, 2e-2, 2e-2, 1e-2, 5e-3]  # warmup then decay: lr / max_lr changes
    kw = dict(betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1 if not lr_independent else 1e-3)
    got, _ = run(params, grads, lrs, lr_independent_decay=lr_independent, **kw)
    want, rms = by_hand(params, grads, lrs, wd=kw["weight_decay"], betas=kw["betas"], eps=kw["eps"], max_lr=lrs[0],
                        lr_independent=lr_independent)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert max(rms) > 1.5 and min(rms) < 1.0  # the steps covered both sides of the clipping


def test_first_step_moments_are_the_gradient_and_nothing_is_clipped():
    assert debiased_beta(0.9, 1) == 0.0 and debiased_beta(0.98, 2) == pytest.approx(0.98 * 0.02 / (1 - 0.98**2))
    p = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    opt = StableAdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    p.grad = torch.tensor([0.5, -0.25, 2.0])
    opt.step()
    st = opt.state[p]
    assert torch.equal(st["exp_avg"], p.grad) and torch.equal(st["exp_avg_sq"], p.grad * p.grad)
    # rms = 1 exactly: the update is lr x sign(g) (up to eps)
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, -1.9, 2.9]))


def test_a_spiky_gradient_is_clipped_per_tensor():
    """After steady small gradients, one 100x gradient on one tensor: its lr is divided by its
    RMS(g^2 / v) (~ 3.6), the other tensor's is not."""
    torch.manual_seed(0)
    a, b = torch.zeros(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    opt = StableAdamW([a, b], lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    steady = torch.randn(64) * 1e-3
    for _ in range(20):
        a.grad, b.grad = steady.clone(), steady.clone()
        opt.step()
    before_a, before_b = a.detach().clone(), b.detach().clone()
    m_a, v_a = opt.state[a]["exp_avg"].clone(), opt.state[a]["exp_avg_sq"].clone()
    spike = steady * 100
    a.grad, b.grad = spike.clone(), steady.clone()
    opt.step()
    b1, b2 = debiased_beta(0.9, 21), debiased_beta(0.99, 21)
    m = b1 * m_a + (1 - b1) * spike
    v = b2 * v_a + (1 - b2) * spike * spike
    rms = (spike * spike / v.clamp_min(1e-16)).mean().sqrt().item()
    assert rms > 3  # the clipping engages ...
    unclipped = 1e-2 * m / (v.sqrt() + 1e-8)
    step_a = before_a - a.detach()
    torch.testing.assert_close(step_a, unclipped / rms, rtol=1e-5, atol=1e-9)  # ... dividing this tensor's lr
    assert step_a.norm() < unclipped.norm() / 3
    b_rms = (steady * steady / opt.state[b]["exp_avg_sq"].clamp_min(1e-16)).mean().sqrt().item()
    assert b_rms <= 1 + 1e-6  # the steady tensor (v = g^2 exactly: rms 1): no clipping, its full step
    torch.testing.assert_close(before_b - b.detach(),
                               1e-2 * opt.state[b]["exp_avg"] / (opt.state[b]["exp_avg_sq"].sqrt() + 1e-8))


def test_lr_independent_decay_follows_the_schedule_not_the_peak():
    """With a zero gradient only the decay acts: the weights shrink by 1 - wd x lr / peak lr."""
    p = torch.ones(4, requires_grad=True)
    opt = StableAdamW([p], lr=8e-4, weight_decay=1e-5, lr_independent_decay=True)
    for lr in (8e-4, 4e-4):
        opt.param_groups[0]["lr"] = lr
        p.grad = torch.zeros(4)
        opt.step()
    want = (1 - 1e-5) * (1 - 1e-5 * 0.5)
    torch.testing.assert_close(p.detach(), torch.full((4,), want))


def test_resume_from_a_state_dict_is_bitwise():
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(8, 3, generator=g), torch.randn(3, generator=g)]
    grads = [[torch.randn(8, 3, generator=g) * (10 if s == 4 else 1), torch.randn(3, generator=g)] for s in range(8)]
    lrs = [1e-2 * (s + 1) / 8 for s in range(8)]
    kw = dict(betas=(0.9, 0.98), eps=1e-6, weight_decay=1e-5, lr_independent_decay=True)
    whole, _ = run(init, grads, lrs, **kw)
    first, opt = run(init, grads[:5], lrs[:5], **kw)
    saved = opt.state_dict()
    ps = [x.clone().requires_grad_(True) for x in first]
    opt2 = StableAdamW(ps, lr=lrs[0], **kw)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["max_lr"] == lrs[0]  # the peak comes back with the state
    for grads_s, lr in zip(grads[5:], lrs[5:]):
        opt2.param_groups[0]["lr"] = lr
        for x, gr in zip(ps, grads_s):
            x.grad = gr.clone()
        opt2.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(whole, ps))


def test_config_and_build():
    cfg = OptimizerConfig(name="stable_adamw", lr=8e-4, betas=[0.9, 0.98], weight_decay=1e-5,
                          lr_independent_weight_decay=True, no_decay=["bias"])
    model = torch.nn.Linear(4, 2)
    opt = build_optimizer(model, cfg, "cpu")
    assert isinstance(opt, StableAdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-5, 0.0]
    assert all(g["lr_independent_decay"] and g["max_lr"] == 8e-4 for g in opt.param_groups)
    from bertdist.device_profile import by_name

    for profile in ("cpu", "h100"):
        assert optimizer_choice(cfg, by_name(profile))[0] == STABLE_ADAMW
    for impl in ("flat", "fused"):
        with pytest.raises(ConfigError, match=f"stable_adamw has no {impl} implementation"):
            OptimizerConfig(name="stable_adamw", implementation=impl)
    with pytest.raises(ConfigError, match="lr_independent_weight_decay is StableAdamW's option; optimizer.name is "
                                          "'adamw'"):
        OptimizerConfig(name="adamw", lr_independent_weight_decay=True)


def test_the_modernbert_recipes_use_it_and_bf16_weights_resolve_to_fp32():
    """bf16 weights need the flat optimizer, which StableAdamW has not: auto resolves to fp32
    weights (DeepSpeed's bf16 with fp32 masters), an explicit bf16 is refused naming why."""
    from pathlib import Path

    from bertdist.train.config import load_train_config

    recipes = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
    for name in ("modernbert-base", "modernbert-large", "modernbert-base-ctx8192"):  # tiny: AdamW (parity)
        opt = load_train_config(recipes / f"{name}.yaml").optimizer
        assert (opt.name, opt.weight_decay, opt.lr_independent_weight_decay) == ("stable_adamw", 1e-5, True), name
    tiny = recipes / "modernbert-tiny.yaml"
    stable = ["optimizer.name=stable_adamw", "optimizer.lr_independent_weight_decay=true"]
    assert load_train_config(tiny, [*stable, "deepspeed.precision=bf16"]).weights == "fp32"
    with pytest.raises(ConfigError, match="bf16_weights=bf16: it needs optimizer.implementation flat"):
        load_train_config(tiny, [*stable, "deepspeed.precision=bf16", "deepspeed.bf16_weights=bf16"]).weights
    with pytest.raises(ConfigError, match="stable_adamw has no flat implementation"):
        load_train_config(tiny, [*stable, "optimizer.implementation=flat"])
    # ZeRO hands the optimizer flat partitions of many tensors: no per-tensor clipping there
    with pytest.raises(ConfigError, match=r"stable_adamw needs deepspeed.zero_stage=0 and precision fp32 or bf16 "
                                          r"\(got zero_stage 1, precision bf16\)"):
        load_train_config(tiny, [*stable, "deepspeed.zero_stage=1", "deepspeed.precision=bf16"])
    assert load_train_config(tiny, ["deepspeed.zero_stage=1"]).optimizer.name == "adamw"  # AdamW may
