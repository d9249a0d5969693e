"""What each ``deepspeed.precision`` stores, computes, accumulates and communicates, and the
DeepSpeed config sections that make it so. Imports neither torch nor DeepSpeed (the config
layer and ``bertdist pretrain --plan`` use it).

- ``fp32``: fp32 weights, gradients and all-reduce; matmuls in TF32 on CUDA (``engine.py``
  turns it on), exact fp32 on CPU.
- ``bf16``: fp32 weights (they are the optimizer's master weights), bf16 compute through
  ``torch.autocast`` (DeepSpeed's ``torch_autocast`` section; layer norms and softmax stay
  fp32 under torch's autocast policy), gradients accumulated over the micro-batches in the
  fp32 ``.grad`` and all-reduced in fp32. DeepSpeed's own ``bf16`` section is not used: at
  ZeRO 0 it keeps bf16 parameters, sums every micro-batch's gradient into a bf16 ``.grad``
  (an 8-bit significand, over up to 256 micro-batches) and all-reduces in bf16; its fp32
  accumulation (``data_types.grad_accum_dtype``) is refused at ZeRO 0 and at ZeRO 1 flattens
  the parameters, which LAMB's per-tensor trust ratio cannot use. Autocast keeps the
  optimizer's parameters whole tensors at every ZeRO stage.
- ``fp16``: DeepSpeed's ``fp16`` mode: fp16 weights with fp32 master weights in its optimizer
  wrapper, dynamic loss scaling (``deepspeed.initial_scale_power``, ``loss_scale_window``,
  ``hysteresis``, ``min_loss_scale``), gradients accumulated and all-reduced in fp16 (scaled
  by the loss scale). DeepSpeed's fp16 autocast at ZeRO 0 would use torch's GradScaler with
  its defaults, ignore these settings and not count skipped steps, so it is not used. For
  many accumulation steps prefer bf16.
"""
from __future__ import annotations

import dataclasses
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one precision setting on one device type."""

    precision: str
    weights: str  # the module's parameters
    master_weights: str  # what the optimizer updates
    compute: str  # matmuls
    grad_accumulation: str  # the sum over the micro-batches of one step
    communication: str  # the gradient all-reduce (or reduce-scatter under ZeRO)
    loss_scaling: str
    how: str  # the DeepSpeed mechanism, in words

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def precision_policy(precision: str, device_type: str = "cuda") -> PrecisionPolicy:
    if precision == "fp32":
        return PrecisionPolicy(
            "fp32", "fp32", "fp32 (the weights)", "tf32" if device_type == "cuda" else "fp32", "fp32", "fp32",
            "none", "no mixed precision" + ("; TF32 matmuls and convolutions" if device_type == "cuda" else ""))
    if precision == "bf16":
        return PrecisionPolicy(
            "bf16", "fp32", "fp32 (the weights)", "bf16", "fp32", "fp32", "none",
            "DeepSpeed torch_autocast (bf16) over fp32 weights; communication_data_type fp32")
    if precision == "fp16":
        return PrecisionPolicy(
            "fp16", "fp16", "fp32 (DeepSpeed's optimizer wrapper)", "fp16", "fp16 (loss-scaled)",
            "fp16 (loss-scaled)", "dynamic", "DeepSpeed fp16 mode with dynamic loss scaling")
    raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def ds_precision_sections(precision: str, *, initial_scale_power: int, loss_scale_window: int, hysteresis: int,
                          min_loss_scale: int) -> dict[str, Any]:
    """The DeepSpeed config keys of ``precision``."""
    out: dict[str, Any] = {"bf16": {"enabled": False}, "fp16": {"enabled": precision == "fp16"}}
    if precision == "bf16":
        # No module is "lower-precision safe": DeepSpeed would otherwise tag the nn.Linear
        # weights to be reduced in bf16 under ZeRO.
        out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
        out["communication_data_type"] = "fp32"
    elif precision == "fp32":
        out["communication_data_type"] = "fp32"
    elif precision == "fp16":
        out["fp16"].update(
            loss_scale=0,  # 0 = dynamic
            initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window,
            hysteresis=hysteresis,
            min_loss_scale=min_loss_scale,
        )
    else:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return out


def autocast_dtype(precision: str) -> str | None:
    """The torch dtype name the forward autocasts to, or None when it does not autocast."""
    return "bfloat16" if precision == "bf16" else None


def engine_reports_grad_norm(precision: str, zero_stage: int) -> bool:
    """Whether DeepSpeed computes the global gradient norm itself: its fp16 wrapper and ZeRO do;
    at ZeRO 0 with fp32 weights (fp32, bf16) the optimizer is ours and the trainer computes it."""
    return precision == "fp16" or zero_stage > 0


def trainer_clips(precision: str, zero_stage: int) -> bool:
    """Whether the trainer computes the gradient norm and clips (``step.clip_gradients``) instead
    of DeepSpeed: wherever DeepSpeed reports no norm of its own. Its clipping there loops over the
    parameters, all-reduces a norm that every rank already has, and leaves us to compute the norm a
    second time for the logs."""
    return not engine_reports_grad_norm(precision, zero_stage)
