"""Cases and drivers shared by the flat optimizer tests (the C++ CPU twin here, the emulated CUDA
kernels in tests/emu): the flat ops run step by step against per-tensor oracles."""
from __future__ import annotations

import torch

from bertdist.ops.flat_layout import flat_layout
from bertdist.train.lamb import Lamb

# Mixed sizes: a matrix, a size-1 tensor, an empty one, a tensor of zeros (LAMB's r = 1 rule
# for ||p|| = 0), and one long enough to span several chunks of the small chunk sizes below.
SHAPES = [(6, 5), (1,), (0,), (4, 4), (300,), (37,)]
ZERO_PARAM = 3  # index in SHAPES of the all-zero parameter
HYPER = dict(lr=0.02, beta1=0.9, beta2=0.999, eps=1e-6)


def make_params(shapes=SHAPES, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(*s, generator=g) for s in shapes]
    ps[ZERO_PARAM].zero_()
    return ps


def make_grads(shapes=SHAPES, steps=4, seed=1, zero_last=False) -> list[list[torch.Tensor]]:
    """Per step, one gradient per tensor; ``zero_last``: the last tensor's gradient stays 0 (with
    its weight decay off as well, LAMB's ||u|| = 0 rule)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        gs = [torch.randn(*s, generator=g) * 0.3 for s in shapes]
        if zero_last:
            gs[-1].zero_()
        out.append(gs)
    return out


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.zeros(0)


def run_flat(ops, kind: str, params, grads_per_step, weight_decay, *, chunk_size=64, max_norm=0.0,
             grad_dtype=torch.float32, **kw):
    """Runs the flat ops for every step; returns (p, m, v, [stats of each step]) as flat buffers."""
    layout = flat_layout([p.numel() for p in params], chunk_size)
    p, m, v = flat(params).clone(), torch.zeros(layout.numel), torch.zeros(layout.numel)
    wd = torch.tensor(weight_decay, dtype=torch.float32)
    stats_seen = []
    hyper = {**HYPER, **kw}
    for step, gs in enumerate(grads_per_step, start=1):
        g = flat(gs).to(grad_dtype)
        _, stats = ops.grad_norm(g, layout.table, layout.num_chunks, chunk_size, max_norm)
        stats_seen.append(stats.clone())
        step_fn = ops.lamb_step_ if kind == "lamb" else ops.adamw_step_
        step_fn(p, g, m, v, layout.table, layout.num_chunks, chunk_size, wd, stats, step=step, **hyper)
    return p, m, v, stats_seen


def clip_coefficient(gs: list[torch.Tensor], max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient for these gradients, in float64."""
    norm = torch.linalg.vector_norm(flat(gs).double()).item()
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def run_torch(kind: str, params, grads_per_step, weight_decay, *, max_norm=0.0, **kw):
    """The per-tensor oracle: bertdist.train.lamb.Lamb or torch.optim.AdamW, one param group per
    tensor (each with its weight decay), the gradients pre-scaled by the clip coefficient.
    Returns flat (p, m, v)."""
    ps = [t.clone().requires_grad_(True) for t in params]
    h = {**HYPER, **kw}
    groups = [{"params": [p], "weight_decay": w} for p, w in zip(ps, weight_decay)]
    if kind == "lamb":
        opt = Lamb(groups, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                   max_coeff=h.get("max_coeff", 10.0), min_coeff=h.get("min_coeff", 0.01),
                   bias_correction=h.get("bias_correction", True))
    else:
        opt = torch.optim.AdamW(groups, lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], foreach=False)
    for gs in grads_per_step:
        c = clip_coefficient(gs, max_norm)
        for p, g in zip(ps, gs):
            p.grad = g.clone() * c if c != 1.0 else g.clone()
        opt.step()
    st = [opt.state[p] for p in ps]
    return (flat([p.detach() for p in ps]), flat([s.get("exp_avg", torch.zeros_like(p)) for s, p in zip(st, ps)]),
            flat([s.get("exp_avg_sq", torch.zeros_like(p)) for s, p in zip(st, ps)]))


def step_with_bf16_copy(ops, kind: str, chunk_size=7) -> tuple[torch.Tensor, torch.Tensor]:
    """One step that also writes the bf16 copy of the params; returns (params, the copy). The copy
    starts as NaN, so an element the kernels skip shows."""
    params, grads = make_params(), make_grads(steps=1)[0]
    layout = flat_layout([t.numel() for t in params], chunk_size)
    p, g, m, v = flat(params), flat(grads), torch.zeros(layout.numel), torch.zeros(layout.numel)
    p_bf16 = torch.full((layout.numel,), float("nan"), dtype=torch.bfloat16)
    wd = torch.full((len(params),), 0.01)
    _, stats = ops.grad_norm(g, layout.table, layout.num_chunks, chunk_size, 1.0)
    step = ops.lamb_step_ if kind == "lamb" else ops.adamw_step_
    step(p, g, m, v, layout.table, layout.num_chunks, chunk_size, wd, stats, step=1, **HYPER, params_bf16=p_bf16)
    return p, p_bf16
