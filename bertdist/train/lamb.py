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

``step`` updates all tensors of a group (per device) with ``torch._foreach_*`` ops and picks the
trust ratio with ``torch.where``: no host read of a device value, so on CUDA a step never waits
for the GPU (an ``if`` on the norms would, once per tensor). The step count is a CPU tensor.
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
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                by_device.setdefault(p.device, []).append(p)
            for params in by_device.values():
                self._update(group, params)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        """One LAMB step of ``params`` (one device), each with its own bias correction and trust ratio."""
        b1, b2 = group["betas"]
        ms, vs, bc1, bc2 = [], [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = state["step"].item()  # a CPU tensor: no device sync
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
            bc1.append(1 - b1**t if group["bias_correction"] else 1.0)
            bc2.append(1 - b2**t if group["bias_correction"] else 1.0)
        grads = [p.grad.float() for p in params]
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, grads, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
        denom = torch._foreach_div(vs, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(ms, bc1)
        torch._foreach_div_(update, denom)
        ws = [p.float() for p in params]  # p itself when fp32
        if group["weight_decay"]:
            torch._foreach_add_(update, ws, alpha=group["weight_decay"])
        w_norm, u_norm = torch.stack(torch._foreach_norm(ws)), torch.stack(torch._foreach_norm(update))
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        trust = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        torch._foreach_mul_(update, list(trust.unbind()))
        torch._foreach_add_(ws, update, alpha=-group["lr"])
        low = [(p, w) for p, w in zip(params, ws) if w is not p]  # bf16/fp16 params: write back in their dtype
        if low:
            torch._foreach_copy_([p for p, _ in low], [w for _, w in low])
