"""Optimizer and LR schedule construction from their config sections.

``implementation``:
- ``auto`` on CUDA: AdamW is ``torch.optim.AdamW(fused=True)``, torch's own fused CUDA kernel
  (nothing to compile); LAMB is DeepSpeed's FusedLamb where its CUDA op can load (prebuilt, or
  JIT-buildable: ninja and nvcc on the node), else our PyTorch ``Lamb`` with a warning.
- ``fused``: DeepSpeed's FusedLamb / FusedAdam (adam_w_mode), an error naming what is missing
  when their op can neither be loaded nor built. DeepSpeed compiles these ops at first use
  unless it was installed with them prebuilt (``DS_BUILD_FUSED_LAMB=1 DS_BUILD_FUSED_ADAM=1``).
- ``torch`` (and ``auto`` on CPU): our ``Lamb`` / ``torch.optim.AdamW``.
Biases and LayerNorm weights get no weight decay (``no_decay``), as in BERT.

Schedules (``warmup_then_decay``): linear warmup from 0 to the peak over
``warmup`` steps, then linear or polynomial decay to ``min_lr_ratio`` x peak
at ``total_steps``. BERT paper: lr 1e-4, 10k warmup, linear. NVIDIA's LAMB
recipe: 6e-3 (phase 1) / 4e-3 (phase 2), poly decay with power 0.5.
"""
from __future__ import annotations

import warnings

import torch

from bertdist.config import ConfigError
from bertdist.train.config import OptimizerConfig, ScheduleConfig
from bertdist.train.lamb import Lamb

_DS_OPS = {"lamb": "fused_lamb", "adamw": "fused_adam"}


def deepspeed_fused_status(name: str) -> tuple[bool, str]:
    """(usable, why) for DeepSpeed's fused optimizer op of ``name`` ("lamb" | "adamw") on this node."""
    op = _DS_OPS[name]
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception as e:  # noqa: BLE001 - deepspeed missing or broken
        return False, f"deepspeed not importable ({type(e).__name__}: {e})"
    if installed_ops.get(op):
        return True, f"DeepSpeed {op} prebuilt"
    from torch.utils.cpp_extension import is_ninja_available

    from bertdist.ops._build_config import find_cuda_home

    missing = []
    if not is_ninja_available():
        missing.append("ninja")
    home, why = find_cuda_home()
    if home is None:
        missing.append(f"nvcc ({why})")
    if missing:
        return False, (f"DeepSpeed's {op} op is not prebuilt and its first-use JIT build needs "
                       f"{' and '.join(missing)} on this node; install DeepSpeed with DS_BUILD_{op.upper()}=1 "
                       "or put a CUDA toolkit matching torch.version.cuda on PATH / CUDA_HOME")
    return True, f"DeepSpeed {op} JIT-built at first use (ninja and nvcc found)"


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
    impl = cfg.implementation
    if impl == "fused" and device_type != "cuda":
        raise ConfigError(f"optimizer.implementation=fused needs CUDA; this process runs on {device_type}. "
                          "Use implementation: torch (or auto).")
    if cfg.name not in _DS_OPS:
        raise ConfigError(f"optimizer.name: {cfg.name!r} is not one of {sorted(_DS_OPS)}")
    betas = tuple(cfg.betas)
    use_ds = impl == "fused" or (impl == "auto" and device_type == "cuda" and cfg.name == "lamb")
    if use_ds:
        ok, why = deepspeed_fused_status(cfg.name)
        if not ok and impl == "fused":
            raise ConfigError(f"optimizer.implementation=fused: {why} (or use implementation: auto)")
        if not ok:
            warnings.warn(f"optimizer lamb on CUDA: {why}; using bertdist's PyTorch Lamb (slower, same math)",
                          RuntimeWarning, stacklevel=2)
            use_ds = False
    if cfg.name == "lamb":
        if use_ds:
            from deepspeed.ops.lamb import FusedLamb

            return FusedLamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff)
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff)
    if use_ds:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         adam_w_mode=True)
    # torch's fused AdamW on CUDA: one kernel for all tensors, no build step (params may still be
    # on the CPU here; DeepSpeed moves them, and the step dispatches on their device).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=impl == "auto" and device_type == "cuda")


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
