"""The model, optimizer, LR schedule and DeepSpeed engine of a run, built from its config."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bertdist.train.config import TrainConfig
from bertdist.train.restore import RestorePlan


@dataclasses.dataclass
class Engine:
    engine: object  # deepspeed.DeepSpeedEngine
    scheduler: object  # torch.optim.lr_scheduler.LambdaLR
    ds_config: dict


def build_engine(cfg: TrainConfig, plan: RestorePlan, world_size: int, grad_accum: int, device_type: str,
                 kernels=None) -> Engine:
    """Identical initial weights on every rank (seeded before the model is built); activation
    checkpointing applied from outside the model; universal loading when ``plan`` needs it.
    ``kernels``: the KernelSet every rank agreed on (``bertdist.ops.kernels_for_run``); None
    resolves ``cfg.model.kernels`` here."""
    import deepspeed

    from bertdist.model.families import family_of
    from bertdist.train.activation_checkpointing import apply_activation_checkpointing
    from bertdist.train.checkpoint import seed_all
    from bertdist.train.ds_config import build_ds_config
    from bertdist.train.optim import build_optimizer, build_scheduler, finish_bf16_weights

    use_tf32(device_type)
    seed_all(cfg.seed)
    # the family's pretraining model (bertdist/model/families.py); the objective is applied from outside
    model = family_of(cfg.model_config).build(cfg.model_config, device_type, kernels)
    clips = cfg.optimizer.clips_itself
    if clips:  # it keeps the parameters as views of its own buffer: they must be where they will stay
        model.to(_local_device(device_type))
    optimizer = build_optimizer(model, cfg.optimizer, device_type,
                                max_grad_norm=cfg.deepspeed.gradient_clipping if clips else 0.0, weights=cfg.weights)
    scheduler = build_scheduler(optimizer, cfg.schedule)
    ds_config = build_ds_config(cfg, world_size, grad_accum)
    if plan.universal:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    apply_activation_checkpointing(model, cfg.deepspeed.activation_checkpointing, ds_config)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    reduces_itself = finish_bf16_weights(optimizer, model, world_size)  # bf16 weights: fp32 masters, fp32 all-reduce
    if world_size == 1 and cfg.deepspeed.zero_stage == 0 or reduces_itself:
        # Alone, there is nothing to reduce: DeepSpeed would still flatten every gradient into
        # buckets, all-reduce them with itself and copy them back, every step.
        engine.enable_backward_allreduce = False
    return Engine(engine, scheduler, ds_config)


def _local_device(device_type: str):
    """This rank's device (``distributed.init_distributed`` made it current)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


def use_tf32(device_type: str) -> None:
    """On CUDA, fp32 matmuls and convolutions run in TF32 (a 10-bit significand, fp32 range and
    accumulation; tensor cores, about 8x the fp32 rate on A100/H100); torch's default is exact
    fp32. bf16 runs its matmuls in bf16 under autocast; this covers what autocast leaves in fp32."""
    import torch

    if device_type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"


def save_ds_config(ds_config: dict, run_dir: Path) -> None:
    with open(run_dir / "ds_config.json", "w") as f:
        json.dump(ds_config, f, indent=2)
