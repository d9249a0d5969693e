"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning") in plain PyTorch.

The CPU twin of DeepSpeed's FusedLamb, with the same hyper-parameters and the
same state names (``exp_avg``, ``exp_avg_sq``, ``step``) so checkpoints look
alike. Per parameter tensor ``p`` with gradient ``g``, at step ``t``:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)           v_hat = v / (1 - b2^t)      (bias correction)
    u = m_hat / (sqrt(v_hat) + eps) + wd * p
    r = ||p|| / ||u||  clamped to [min_coeff, max_coeff]; r = 1 if either norm is 0
    p = p - lr * r * u

Gradient clipping is not done here: DeepSpeed clips the global norm before
``step`` (``gradient_clipping``), as for FusedLamb.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer


class Lamb(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True,
                 max_coeff: float = 10.0, min_coeff: float = 0.01):
        if lr <= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"invalid betas {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                if g.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
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
                if w is not p:  # p was bf16/fp16: write the update back in its own dtype
                    p.copy_(w)
        return loss
