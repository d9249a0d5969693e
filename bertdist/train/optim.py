"""Optimizer and LR schedule construction from their config sections.

``implementation``:
- ``auto`` on CUDA: AdamW is ``torch.optim.AdamW(fused=True)``, torch's own fused CUDA kernel
  (nothing to compile); LAMB is DeepSpeed's FusedLamb once its CUDA op has loaded (prebuilt,
  or JIT-built before the optimizer is made), else our PyTorch ``Lamb`` with a warning naming
  the cause (no ninja or nvcc, a toolkit DeepSpeed refuses for torch's CUDA, a failed build).
- ``fused``: DeepSpeed's FusedLamb / FusedAdam (adam_w_mode), an error naming the cause when
  their op can neither be loaded nor built. DeepSpeed compiles these ops at first use unless
  it was installed with them prebuilt (``DS_BUILD_FUSED_LAMB=1 DS_BUILD_FUSED_ADAM=1``).
- ``torch`` (and ``auto`` on CPU): our ``Lamb`` / ``torch.optim.AdamW``.
- StableAdamW (``name: stable_adamw``, ``stable_adamw.py``): ours, PyTorch foreach ops, under
  ``auto`` and ``torch`` alike; it has no fused or flat version (a ConfigError).
- ``flat``: ``bertdist.train.flat_optim``'s FlatLamb / FlatAdamW: every parameter a view of one
  flat fp32 buffer, a fixed handful of kernel launches per step whatever the number of tensors,
  and the global-norm clipping fused in (``deepspeed.gradient_clipping`` goes to the optimizer,
  DeepSpeed's own is 0). Our CUDA kernels where the extension is built, else its CPU twin or the
  reference ops. ZeRO 0, fp32 or bf16.
``optimizer_choice`` says which, and why, for a ``DeviceProfile`` (``pretrain --plan`` prints it).
Biases and LayerNorm weights get no weight decay (``no_decay``), as in BERT.

Schedules (``warmup_then_decay``): linear warmup from 0 to the peak over
``warmup`` steps, then linear or polynomial decay to ``min_lr_ratio`` x peak
at ``total_steps``. BERT paper: lr 1e-4, 10k warmup, linear. NVIDIA's LAMB
recipe: 6e-3 (phase 1) / 4e-3 (phase 2), poly decay with power 0.5.
"""
from __future__ import annotations

import math

import os
import warnings

import torch

from bertdist.config import ConfigError
from bertdist.device_profile import DeviceProfile, for_device_type
from bertdist.train.config import OptimizerConfig, ScheduleConfig
from bertdist.train.lamb import Lamb

_DS_OPS = {"lamb": "fused_lamb", "adamw": "fused_adam"}
FUSED_LAMB = "deepspeed.ops.lamb.FusedLamb"
FUSED_ADAM = "deepspeed.ops.adam.FusedAdam"
TORCH_LAMB = "bertdist.train.lamb.Lamb"
TORCH_ADAMW = "torch.optim.AdamW"
TORCH_FUSED_ADAMW = "torch.optim.AdamW(fused=True)"
FLAT_LAMB = "bertdist.train.flat_optim.FlatLamb"
FLAT_ADAMW = "bertdist.train.flat_optim.FlatAdamW"
STABLE_ADAMW = "bertdist.train.stable_adamw.StableAdamW"


def toolkit_refused(profile: DeviceProfile) -> str | None:
    """Why DeepSpeed's JIT build refuses ``profile``'s CUDA toolkit for its torch (its
    ``assert_no_cuda_mismatch``: same major.minor, or both in its table of compatible minor
    versions, or DS_SKIP_CUDA_CHECK=1), or None."""
    if profile.toolkit is None or profile.torch_cuda is None:
        return None
    have, want = (".".join(v.split(".")[:2]) for v in (profile.toolkit, profile.torch_cuda))
    if have == want or os.environ.get("DS_SKIP_CUDA_CHECK", "0") == "1":
        return None
    from deepspeed.ops.op_builder.builder import cuda_minor_mismatch_ok

    major = int(have.split(".")[0])
    if have in cuda_minor_mismatch_ok.get(major, ()) and want in cuda_minor_mismatch_ok.get(major, ()):
        return None
    return (f"the CUDA toolkit {have} differs from torch's CUDA {want}, a pair DeepSpeed's JIT build refuses "
            f"(its compatible minor versions cover CUDA {', '.join(map(str, sorted(cuda_minor_mismatch_ok)))}; "
            "DS_SKIP_CUDA_CHECK=1 overrides)")


def deepspeed_fused_status(name: str, profile: DeviceProfile | None = None) -> tuple[bool, str]:
    """(ready, why) for DeepSpeed's fused optimizer op of ``name`` ("lamb" | "adamw") on
    ``profile`` (default: this machine's CUDA device), without building it: prebuilt, or
    what its first-use JIT build needs (ninja, a toolkit DeepSpeed accepts for torch's CUDA)."""
    op = _DS_OPS[name]
    profile = profile or for_device_type("cuda")
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception as e:  # noqa: BLE001 - deepspeed missing or broken
        return False, f"deepspeed not importable ({type(e).__name__}: {e})"
    if installed_ops.get(op):
        return True, f"DeepSpeed {op} prebuilt"
    from torch.utils.cpp_extension import is_ninja_available

    missing = []
    if not is_ninja_available():
        missing.append("ninja")
    if profile.toolkit is None:
        missing.append("nvcc (no CUDA toolkit found: PATH, CUDA_HOME)")
    if missing:
        return False, (f"DeepSpeed's {op} op is not prebuilt and its first-use JIT build needs "
                       f"{' and '.join(missing)} on this node; install DeepSpeed with DS_BUILD_{op.upper()}=1 "
                       "or put a CUDA toolkit matching torch.version.cuda on PATH / CUDA_HOME")
    refused = toolkit_refused(profile)
    if refused:
        return False, (f"DeepSpeed's {op} op is not prebuilt and cannot be JIT-built: {refused}; install DeepSpeed "
                       f"with DS_BUILD_{op.upper()}=1 where the toolkit matches, or use a toolkit {profile.torch_cuda}")
    return True, f"DeepSpeed {op} JIT-built (ninja, CUDA toolkit {profile.toolkit} for torch's CUDA {profile.torch_cuda})"


def _ds_op_builder(name: str):
    from deepspeed.ops.op_builder import FusedAdamBuilder, FusedLambBuilder

    return {"lamb": FusedLambBuilder, "adamw": FusedAdamBuilder}[name]()


def build_deepspeed_op(name: str) -> tuple[bool, str]:
    """Load (prebuilt) or JIT-build DeepSpeed's op for ``name`` now; (False, the cause) when it fails.
    The optimizer's constructor then reuses the loaded op."""
    op = _DS_OPS[name]
    try:
        _ds_op_builder(name).load(verbose=False)
    except Exception as e:  # noqa: BLE001 - any build or load failure means: not usable here
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        return False, f"DeepSpeed's {op} op failed to build or load: {type(e).__name__}: {lines[-1] if lines else ''}"
    return True, f"DeepSpeed {op} loaded"


def optimizer_choice(cfg: OptimizerConfig, profile: DeviceProfile, *, build: bool = False) -> tuple[str, str]:
    """(implementation, why) of the optimizer ``build_optimizer`` constructs on ``profile``.
    ``build``: try DeepSpeed's op now (a run does); without it (``--plan``) the choice is what
    the profile predicts, and a build failing at the start of the run still falls back."""
    if cfg.name == "stable_adamw":
        if cfg.implementation not in ("auto", "torch"):  # OptimizerConfig refuses these too
            raise ConfigError(f"optimizer.name=stable_adamw has no {cfg.implementation} implementation; use auto "
                              "or torch")
        return STABLE_ADAMW, (f"implementation {cfg.implementation}: bertdist's StableAdamW (PyTorch foreach ops; "
                              "no fused or flat version)")
    if cfg.name not in _DS_OPS:
        raise ConfigError(f"optimizer.name: {cfg.name!r} is not one of {sorted(_DS_OPS) + ['stable_adamw']}")
    impl, lamb = cfg.implementation, cfg.name == "lamb"
    plain = TORCH_LAMB if lamb else TORCH_ADAMW
    if impl == "fused" and not profile.is_cuda:
        raise ConfigError(f"optimizer.implementation=fused needs CUDA; this process runs on {profile.type}. "
                          "Use implementation: torch (or auto).")
    if impl == "torch":
        return plain, "optimizer.implementation=torch"
    if impl == "flat":
        return (FLAT_LAMB if lamb else FLAT_ADAMW), ("optimizer.implementation=flat: bertdist's flat-buffer "
                                                     "kernels, clipping fused in")
    if not profile.is_cuda:
        return plain, f"implementation {impl} on {profile.type}: DeepSpeed's fused optimizers are CUDA-only"
    if impl == "auto" and not lamb:
        return TORCH_FUSED_ADAMW, "auto on CUDA: torch's own fused AdamW kernel (nothing to build)"
    fused = FUSED_LAMB if lamb else FUSED_ADAM
    ok, why = deepspeed_fused_status(cfg.name, profile)
    if ok and build:
        if profile.visible_count == 0:
            ok, why = False, f"no CUDA device is visible to build DeepSpeed's {_DS_OPS[cfg.name]} op for"
        else:
            ok, why = build_deepspeed_op(cfg.name)
    if ok:
        later = "" if build else ("; a run builds it first and falls back to bertdist's Lamb if that fails"
                                  if impl == "auto" else "; a run fails up front if the build fails")
        return fused, f"{impl} on CUDA: {why}{later}"
    if impl == "fused":
        raise ConfigError(f"optimizer.implementation=fused: {why} (or use implementation: auto)")
    return TORCH_LAMB, f"auto on CUDA: {why}; bertdist's PyTorch Lamb instead (same math, slower)"


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


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, device_type: str,
                    profile: DeviceProfile | None = None, max_grad_norm: float = 0.0,
                    weights: str = "fp32") -> torch.optim.Optimizer:
    """The optimizer ``optimizer_choice`` picks on ``profile`` (default: this machine's
    ``device_type`` device), DeepSpeed's op built first; a fallback is warned about, naming why.
    ``max_grad_norm``: the clipping of an optimizer that clips by itself (``clips_itself``);
    such an optimizer holds the parameters where they are now, so the model must be on its device.
    ``weights`` "bf16" (``TrainConfig.weights``): the flat optimizer makes the parameters bf16 and
    keeps fp32 masters (``flat_optim``); ``finish_bf16_weights`` completes it once the engine exists."""
    profile = profile or for_device_type(device_type)
    choice, why = optimizer_choice(cfg, profile, build=True)
    if cfg.implementation == "auto" and profile.is_cuda and choice == TORCH_LAMB:
        warnings.warn(f"optimizer lamb on CUDA: {why}", RuntimeWarning, stacklevel=2)
    groups = param_groups(model, cfg)
    betas = tuple(cfg.betas)
    if choice in (FLAT_LAMB, FLAT_ADAMW):
        from bertdist.train.flat_optim import FlatAdamW, FlatLamb

        dtype = torch.bfloat16 if weights == "bf16" else torch.float32
        if choice == FLAT_LAMB:
            return FlatLamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff, max_grad_norm=max_grad_norm,
                            param_dtype=dtype)
        return FlatAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         max_grad_norm=max_grad_norm, param_dtype=dtype)
    if weights != "fp32":
        raise ValueError(f"weights {weights!r} needs the flat optimizer (got {choice})")
    if choice == STABLE_ADAMW:
        from bertdist.train.stable_adamw import StableAdamW

        return StableAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                           lr_independent_decay=cfg.lr_independent_weight_decay)
    if choice == FUSED_LAMB:
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff)
    if choice == TORCH_LAMB:
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    max_coeff=cfg.lamb_max_coeff, min_coeff=cfg.lamb_min_coeff)
    if choice == FUSED_ADAM:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         adam_w_mode=True)
    # torch's fused AdamW on CUDA: one kernel for all tensors, no build step (params may still be
    # on the CPU here; DeepSpeed moves them, and the step dispatches on their device).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=choice == TORCH_FUSED_ADAMW)


def finish_bf16_weights(optimizer, model: torch.nn.Module, world_size: int) -> bool:
    """For bf16 weights, once DeepSpeed's engine is built: the module's state dict holds the fp32
    masters, and the optimizer all-reduces the fp32 gradient sums itself. Returns whether it does
    (then DeepSpeed's all-reduce, of the bf16 ``.grad`` of the last micro-batch only, must be off)."""
    if not getattr(optimizer, "low_precision", False):
        return False
    optimizer.bind_module(model)
    optimizer.reduce_gradients(world_size)
    return True


class WarmupDecay:
    """LR multiplier for step ``s`` (0-based count of completed optimizer steps).

    A class rather than a closure so that ``LambdaLR.state_dict`` saves it.
    """

    def __init__(self, warmup: int, total: int, decay: str, power: float, min_ratio: float,
                 decay_steps: int = 0, shape: str = "1-sqrt"):
        if warmup >= total and decay != "constant":
            raise ConfigError(f"schedule: warmup ({warmup} steps) must be shorter than total_steps ({total})")
        self.warmup, self.total, self.decay, self.power, self.min_ratio = warmup, total, decay, power, min_ratio
        # wsd (warmup-stable-decay): the peak until total - decay_steps, then ``shape`` down to min_ratio
        self.decay_steps, self.shape = decay_steps, shape

    def __call__(self, step: int) -> float:
        s = step + 1  # the lr used by the (step+1)-th update: warmup never uses lr 0
        if self.warmup and s <= self.warmup:
            return s / self.warmup
        if self.decay == "constant":
            return 1.0
        if self.decay == "wsd":
            return self._wsd(s)
        frac = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        if self.decay == "linear":
            mult = 1.0 - frac
        else:  # poly
            mult = (1.0 - frac) ** self.power
        return self.min_ratio + (1.0 - self.min_ratio) * mult

    def _wsd(self, s: int) -> float:
        """The stable peak, then the decay over the last ``decay_steps`` updates: the update at
        total - decay_steps is the last at the peak, the one at total reaches min_ratio."""
        if not self.decay_steps:  # no decay in this phase: the trapezoid's plateau
            return 1.0
        frac = min(1.0, max(0.0, (s - (self.total - self.decay_steps)) / self.decay_steps))
        mult = 1.0 - (math.sqrt(frac) if self.shape == "1-sqrt" else frac)
        return self.min_ratio + (1.0 - self.min_ratio) * mult


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    fn = WarmupDecay(cfg.resolved_warmup_steps, cfg.total_steps, cfg.decay, cfg.poly_power, cfg.min_lr_ratio,
                     cfg.decay_steps, cfg.decay_shape)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
