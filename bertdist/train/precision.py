"""What each ``deepspeed.precision`` stores, computes, accumulates and communicates, and the
DeepSpeed config sections that make it so. Imports neither torch nor DeepSpeed (the config
layer and ``bertdist pretrain --plan`` use it).

- ``fp32``: fp32 weights, gradients and all-reduce; matmuls in TF32 on CUDA (``engine.py``
  turns it on), exact fp32 on CPU.
- ``bf16`` with ``deepspeed.bf16_weights`` bf16 (the default where it applies: bertdist's flat
  optimizer, ZeRO 0, plain MLM pretraining): bf16 weights and activations end to end, with no
  cast of the weights per forward nor of their gradients per backward; the optimizer (``flat_optim``, ``param_dtype=bfloat16``) keeps
  the fp32 master weights, adds each micro-batch's bf16 gradient into an fp32 sum (one add over
  the flat buffer per micro-batch), all-reduces that sum in fp32 (DeepSpeed's all-reduce is off),
  takes the norm, clips and updates in fp32 and writes the bf16 weights in the update's own pass.
  Layer norms take and give bf16 with fp32 statistics. The module's state dict holds the fp32
  masters, so checkpoints and exports carry fp32 weights, as Megatron-LM's and torchtitan's do.
- ``bf16`` with ``bf16_weights`` fp32: fp32 weights (they are the optimizer's master weights),
  bf16 compute through ``torch.autocast`` (DeepSpeed's ``torch_autocast`` section; layer norms and softmax stay
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
BF16_WEIGHTS = ("auto", "fp32", "bf16")


def bf16_weights_refusal(precision: str, bf16_weights: str, implementation: str, zero_stage: int,
                         objective: str | None) -> str | None:
    """Why ``deepspeed.bf16_weights=bf16`` cannot run with these settings, or None when it can."""
    if precision != "bf16":
        return f"it needs deepspeed.precision bf16 (got {precision}; fp16 keeps DeepSpeed's own fp16 weights)"
    if implementation != "flat" or zero_stage != 0:
        return (f"it needs optimizer.implementation flat and deepspeed.zero_stage 0, whose optimizer keeps the "
                f"fp32 masters (got implementation {implementation}, zero_stage {zero_stage}); DeepSpeed's ZeRO "
                f"would partition bf16 weights and reduce bf16 gradients")
    if objective is not None:
        return f"the {objective} objective is not tested with bf16 weights yet"
    return None


def resolve_bf16_weights(precision: str, bf16_weights: str, implementation: str, zero_stage: int,
                         objective: str | None = None) -> str:
    """The dtype of the module's weights: "bf16" for ``bf16_weights`` bf16, and for auto where
    ``bf16_weights_refusal`` has nothing to say; "fp16" under fp16; else "fp32"."""
    if bf16_weights not in BF16_WEIGHTS:
        raise ValueError(f"bf16_weights must be one of {BF16_WEIGHTS}, got {bf16_weights!r}")
    if precision == "fp16":
        return "fp16"
    why = bf16_weights_refusal(precision, bf16_weights, implementation, zero_stage, objective)
    if bf16_weights == "bf16" and why is not None:
        raise ValueError(f"deepspeed.bf16_weights=bf16: {why}; use bf16_weights fp32 (autocast) or auto")
    return "bf16" if bf16_weights != "fp32" and why is None else "fp32"


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


def precision_policy(precision: str, device_type: str = "cuda", weights: str = "fp32") -> PrecisionPolicy:
    """``weights``: the resolved dtype of bf16's weights (``resolve_bf16_weights``)."""
    if precision == "fp32":
        return PrecisionPolicy(
            "fp32", "fp32", "fp32 (the weights)", "tf32" if device_type == "cuda" else "fp32", "fp32", "fp32",
            "none", "no mixed precision" + ("; TF32 matmuls and convolutions" if device_type == "cuda" else ""))
    if precision == "bf16" and weights == "bf16":
        return PrecisionPolicy(
            "bf16", "bf16", "fp32 (the flat optimizer's)", "bf16", "fp32", "fp32", "none",
            "bf16 weights and activations; fp32 master weights, gradient sums and all-reduce in bertdist's flat "
            "optimizer (no autocast)")
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
                          min_loss_scale: int, weights: str = "fp32") -> dict[str, Any]:
    """The DeepSpeed config keys of ``precision`` (``weights``: the resolved dtype of the weights)."""
    out: dict[str, Any] = {"bf16": {"enabled": False}, "fp16": {"enabled": precision == "fp16"}}
    if precision == "bf16" and weights == "bf16":
        # DeepSpeed sees an fp32-mode engine: the weights are bf16 already and the flat optimizer
        # does the fp32 accumulation and all-reduce (engine.py turns DeepSpeed's all-reduce off).
        out["communication_data_type"] = "fp32"
    elif precision == "bf16":
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


def autocast_dtype(precision: str, weights: str = "fp32") -> str | None:
    """The torch dtype name the forward autocasts to, or None when it does not autocast (fp32;
    bf16 weights, which compute in bf16 by themselves)."""
    return "bfloat16" if precision == "bf16" and weights != "bf16" else None


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
