"""The DeepSpeed config: generated from our TrainConfig, with a user JSON merged in.

Our YAML is the single source of truth for everything it covers (batch sizes,
precision, ZeRO stage, clipping, activation checkpointing). A user
``ds_config`` may add anything else (ZeRO bucket sizes, offload, comms
logging, ...); a key that both set to different values is rejected, naming the
YAML key to change instead. The optimizer and scheduler are ours (passed to
``deepspeed.initialize``), so a user JSON may not define them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bertdist.config import ConfigError
from bertdist.train.config import TrainConfig
from bertdist.train.precision import ds_precision_sections, trainer_clips

# Where each generated DeepSpeed key comes from in our config (for conflict messages).
_SOURCE = {
    "train_batch_size": "data.global_batch_size",
    "train_micro_batch_size_per_gpu": "data.micro_batch_size",
    "gradient_accumulation_steps": "data.global_batch_size / (micro x world)",
    "gradient_clipping": "deepspeed.gradient_clipping (0 where the trainer clips: precision.trainer_clips)",
    "zero_optimization.stage": "deepspeed.zero_stage",
    "bf16.enabled": "deepspeed.precision (bf16 runs under torch_autocast over fp32 weights)",
    "fp16.enabled": "deepspeed.precision",
    "torch_autocast.enabled": "deepspeed.precision",
    "torch_autocast.dtype": "deepspeed.precision",
    "torch_autocast.lower_precision_safe_modules": "deepspeed.precision (gradients reduced in fp32)",
    "communication_data_type": "deepspeed.precision (gradients reduced in fp32)",
    "fp16.initial_scale_power": "deepspeed.initial_scale_power",
    "fp16.loss_scale_window": "deepspeed.loss_scale_window",
    "fp16.hysteresis": "deepspeed.hysteresis",
    "fp16.min_loss_scale": "deepspeed.min_loss_scale",
    "fp16.loss_scale": "deepspeed.precision (dynamic scaling)",
    "timers.throughput.enabled": "off: it synchronizes the device every micro-batch (profiling.enabled profiles a step)",
    "timers.throughput.synchronized": "off: it synchronizes the device every micro-batch",
    "wall_clock_breakdown": "off: it synchronizes the device (profiling.enabled profiles a step)",
}
_FORBIDDEN = {
    "optimizer": "set optimizer.* in the YAML (bertdist builds the optimizer)",
    "scheduler": "set schedule.* in the YAML (bertdist builds the LR schedule)",
}


def generate_ds_config(cfg: TrainConfig, world_size: int, grad_accum: int) -> dict[str, Any]:
    d = cfg.deepspeed
    out: dict[str, Any] = {
        "train_batch_size": cfg.data.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        # Where the trainer computes the norm it clips too (step.clip_gradients), and a flat optimizer
        # clips inside its step: DeepSpeed's clipping is off then.
        "gradient_clipping": (0.0 if trainer_clips(d.precision, d.zero_stage) or cfg.optimizer.clips_itself
                              else d.gradient_clipping),
        "zero_optimization": {"stage": d.zero_stage},
        # Our optimizers are plain torch ones (AdamW) or DeepSpeed's; LAMB is refused with ZeRO (config.py).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # our own logging replaces DeepSpeed's
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronizes the device around every micro-batch. Our metrics
        # time the steps without it, and the profiler (``profiling``) sees the step as it runs.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        # What each precision stores, computes, accumulates and communicates: precision.py.
        **ds_precision_sections(d.precision, initial_scale_power=d.initial_scale_power,
                                loss_scale_window=d.loss_scale_window, hysteresis=d.hysteresis,
                                min_loss_scale=d.min_loss_scale, weights=cfg.weights),
    }
    # ZeRO-3 must gather the full weights into mp_rank_00_model_states.pt for export.
    if d.zero_stage == 3:
        out["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if d.activation_checkpointing == "deepspeed":
        out["activation_checkpointing"] = {
            "partition_activations": False,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
        }
    assert out["train_batch_size"] == cfg.data.micro_batch_size * grad_accum * world_size
    return out


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def merge_user_ds_config(generated: dict[str, Any], user: dict[str, Any], user_path: str = "ds_config") -> dict[str, Any]:
    """Deep-merge ``user`` into ``generated``; different values for the same key are a ConfigError."""
    bad = [f"'{k}' ({why})" for k, why in _FORBIDDEN.items() if k in user]
    if bad:
        raise ConfigError(f"{user_path}: must not define {', '.join(bad)}")
    gen_flat, user_flat = _flatten(generated), _flatten(user)
    conflicts = []
    for key, uval in user_flat.items():
        # "auto" is DeepSpeed's own placeholder for "take it from elsewhere": ours fills it.
        if key in gen_flat and gen_flat[key] != uval and uval != "auto":
            src = _SOURCE.get(key, "the generated config")
            conflicts.append(f"  {key}: {user_path} says {uval!r}, bertdist config says {gen_flat[key]!r} (from {src})")
        # A user scalar where we have a section (or the reverse) is also a conflict.
        for gkey in gen_flat:
            if gkey.startswith(key + ".") and not isinstance(uval, dict):
                conflicts.append(f"  {key}: {user_path} sets a value where bertdist has a section ({gkey})")
    if conflicts:
        raise ConfigError(
            "DeepSpeed config conflicts between the YAML and the user ds_config; change the YAML key "
            "named in parentheses, or drop the key from the JSON:\n" + "\n".join(sorted(set(conflicts)))
        )

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = merge(out[k], v)
            elif v == "auto" and k in out:
                continue
            else:
                out[k] = v
        return out

    return merge(generated, user)


def build_ds_config(cfg: TrainConfig, world_size: int, grad_accum: int) -> dict[str, Any]:
    generated = generate_ds_config(cfg, world_size, grad_accum)
    if not cfg.deepspeed.ds_config:
        return generated
    path = Path(cfg.deepspeed.ds_config)
    if not path.is_file():
        raise ConfigError(f"deepspeed.ds_config: file not found: {path}")
    try:
        user = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"deepspeed.ds_config: {path} is not valid JSON: {e}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"deepspeed.ds_config: {path} must hold a JSON object")
    return merge_user_ds_config(generated, user, str(path))
