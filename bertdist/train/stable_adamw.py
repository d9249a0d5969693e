"""StableAdamW (Wortsman et al., 2023, "Stable and low-precision training for large-scale
vision-language models"), as the ``optimi`` library implements it, in plain PyTorch: AdamW with
debiased betas, decoupled weight decay and per-tensor update clipping. ModernBERT's optimizer.

Per parameter tensor ``p`` with gradient ``g`` at step ``t`` (1-based):

    b1_t = b1 (1 - b1^(t-1)) / (1 - b1^t)      b2_t likewise    (debiased betas: no bias correction
    m = b1_t m + (1 - b1_t) g                                   after; at t = 1, m = g, v = g^2)
    v = b2_t v + (1 - b2_t) g^2
    rms = sqrt(mean(g^2 / max(v, eps^2)))                       (over the tensor's elements)
    lr_p = lr / max(1, rms)                                     (the update clipping)
    p = p (1 - lr_p wd)        or, lr-independent,  p (1 - lr_p / max_lr wd)
    p = p - lr_p m / (sqrt(v) + eps)

``lr_independent_decay`` is optimi's ``decouple_lr``: the decay per step is ``weight_decay`` times
the schedule's multiplier (``max_lr``: the group's lr when the optimizer was made, the peak;
a new phase sets its own, ``restore.py``), whatever the peak lr; ModernBERT's 1e-5 is meant this way. State names follow AdamW's
(``step``, ``exp_avg``, ``exp_avg_sq``); the step count is a CPU tensor, and the clipping stays on
the device (no host read per tensor), so checkpoints resume exactly.

Gradient clipping by the global norm is not done here (DeepSpeed's ``gradient_clipping``).
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer


def debiased_beta(beta: float, step: int) -> float:
    """``beta (1 - beta^(step-1)) / (1 - beta^step)``: a moving average with it needs no bias correction."""
    return beta * (1 - beta ** (step - 1)) / (1 - beta**step)


class StableAdamW(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.99), eps: float = 1e-6, weight_decay: float = 0.0,
                 lr_independent_decay: bool = False):
        if lr <= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid betas {betas}")
        if eps <= 0.0:
            raise ValueError(f"StableAdamW divides by max(v, eps^2): eps must be positive, got {eps}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        lr_independent_decay=lr_independent_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            group.setdefault("max_lr", group["lr"])  # the peak, before a scheduler scales lr

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_step: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("StableAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                by_step.setdefault((p.device, int(state["step"].item())), []).append(p)  # a CPU tensor: no sync
            for (_, t), params in by_step.items():
                self._update(group, params, t)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor], t: int) -> None:
        """One step of ``params`` (one device, all at step ``t``)."""
        b1, b2 = (debiased_beta(b, t) for b in group["betas"])
        eps, wd = group["eps"], group["weight_decay"]
        ms = [self.state[p]["exp_avg"] for p in params]
        vs = [self.state[p]["exp_avg_sq"] for p in params]
        grads = [p.grad.float() for p in params]
        torch._foreach_lerp_(ms, grads, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
        # rms = sqrt(mean(g^2 / max(v, eps^2))) per tensor, and each tensor's lr = lr / max(1, rms).
        # Two temporaries of the parameters' size, reused for the update below.
        tmp = torch._foreach_mul(grads, grads)
        den = torch._foreach_clamp_min(vs, eps * eps)
        torch._foreach_div_(tmp, den)
        # One multi-tensor reduction, not a launch per tensor: the entries are non-negative, so
        # each tensor's L1 norm over its size is its mean.
        means = torch._foreach_norm(tmp, 1)
        torch._foreach_div_(means, [float(x.numel()) for x in tmp])
        rms = torch.stack(means).sqrt()
        lrs = group["lr"] / rms.clamp(min=1.0)
        ws = [p.float() for p in params]  # p itself when fp32
        if wd:
            rate = lrs / group["max_lr"] if group["lr_independent_decay"] else lrs
            torch._foreach_mul_(ws, list((1 - rate * wd).unbind()))
        torch._foreach_copy_(den, vs)
        torch._foreach_sqrt_(den)
        torch._foreach_add_(den, eps)
        torch._foreach_copy_(tmp, ms)
        torch._foreach_div_(tmp, den)  # m / (sqrt(v) + eps)
        torch._foreach_mul_(tmp, list((-lrs).unbind()))
        torch._foreach_add_(ws, tmp)
        low = [(p, w) for p, w in zip(params, ws) if w is not p]  # bf16/fp16 params: write back in their dtype
        if low:
            torch._foreach_copy_([p for p, _ in low], [w for _, w in low])
