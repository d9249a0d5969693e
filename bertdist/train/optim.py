"""Optimizer and LR schedule construction from their config sections.

LAMB: DeepSpeed's FusedLamb on CUDA, our PyTorch ``Lamb`` on CPU (or when
``implementation: torch``). AdamW: DeepSpeed's FusedAdam (adam_w_mode) on
CUDA, ``torch.optim.AdamW`` on CPU. Biases and LayerNorm weights get no weight
decay (``no_decay``), as in BERT.

Schedules (``warmup_then_decay``): linear warmup from 0 to the peak over
``warmup`` steps, then linear or polynomial decay to ``min_lr_ratio`` x peak
at ``total_steps``. BERT paper: lr 1e-4, 10k warmup, linear. NVIDIA's LAMB
recipe: 6e-3 (phase 1) / 4e-3 (phase 2), poly decay with power 0.5.
"""
from __future__ import annotations

import torch

from bertdist.config import ConfigError
from bertdist.train.config import OptimizerConfig, ScheduleConfig
from bertdist.train.lamb import Lamb


def param_groups(model: torch.nn.Module, cfg: OptimizerConfig) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (no_decay if any(tag in name for tag in cfg.no_decay) else decay).append(p)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device_type: str) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    fused = cfg.implementation == "fused" or (cfg.implementation == "auto" and device_type == "cuda")
    if fused and device_type != "cuda":
        raise ConfigError(f"optimizer.implementation=fused needs CUDA; this process runs on {device_type}. "
                          "Use implementation: torch (or auto).")
    betas = tuple(cfg.betas)
    if cfg.name == "lamb":
        if fused:
            from deepspeed.ops.lamb import FusedLamb

            return FusedLamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff)
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff)
    if cfg.name == "adamw":
        if fused:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             adam_w_mode=True)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    raise ConfigError(f"optimizer.name: {cfg.name!r} is not one of ['lamb', 'adamw']")


class WarmupDecay:
    """LR multiplier for step ``s`` (0-based count of completed optimizer steps).

    A class rather than a closure so that ``LambdaLR.state_dict`` saves it.
    """

    def __init__(self, warmup: int, total: int, decay: str, power: float, min_ratio: float):
        if warmup >= total and decay != "constant":
            raise ConfigError(f"schedule: warmup ({warmup} steps) must be shorter than total_steps ({total})")
        self.warmup, self.total, self.decay, self.power, self.min_ratio = warmup, total, decay, power, min_ratio

    def __call__(self, step: int) -> float:
        s = step + 1  # the lr used by the (step+1)-th update: warmup never uses lr 0
        if self.warmup and s <= self.warmup:
            return s / self.warmup
        if self.decay == "constant":
            return 1.0
        frac = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        if self.decay == "linear":
            mult = 1.0 - frac
        else:  # poly
            mult = (1.0 - frac) ** self.power
        return self.min_ratio + (1.0 - self.min_ratio) * mult


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    fn = WarmupDecay(cfg.resolved_warmup_steps, cfg.total_steps, cfg.decay, cfg.poly_power, cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
