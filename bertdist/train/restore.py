"""Where a run starts from: fresh, a resume of this run, or a new phase from another checkpoint.

``plan_restore`` decides, from the config, ``--resume`` and what is on disk, before the engine
exists (a different world size needs DeepSpeed's universal loading, which is an engine config
flag). ``restore`` then loads the plan into the engine and returns the position to continue from.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from bertdist.config import ConfigError, to_dict
from bertdist.model.families import arch_mismatches
from bertdist.train.checkpoint import LATEST, latest_tag, read_checkpoint_state, resolve_checkpoint, saved_tags
from bertdist.train.config import TrainConfig
from bertdist.train.precision import precision_policy
from bertdist.train.state import TrainerState



@dataclasses.dataclass(frozen=True)
class RestorePlan:
    mode: Literal["fresh", "resume", "init"]
    load_dir: Path | None = None  # the checkpoint directory holding ``tag``
    tag: str | None = None
    saved: TrainerState | None = None
    # The checkpoint was written by another world size and its optimizer state is partitioned
    # per rank (ZeRO 1-3): it must be loaded as a universal checkpoint.
    universal: bool = False


def check_compatible(saved: TrainerState, cfg: TrainConfig, what: str) -> None:
    """Refuse a checkpoint whose model (its family's architecture fields: bertdist/model/families.py;
    a new phase may change the family's ``phase_fields``) and, for a resume, optimizer, precision,
    schedule differ."""
    problems = arch_mismatches(saved.model, cfg.model, new_phase=what != "resume")
    if what == "resume":
        for key, theirs, ours in (("optimizer", saved.optimizer, cfg.optimizer.name),
                                  ("zero_stage", saved.zero_stage, cfg.deepspeed.zero_stage),
                                  ("precision", saved.precision, cfg.deepspeed.precision),
                                  ("phase", saved.phase, cfg.phase)):
            if theirs != ours:
                problems.append(f"{key}: checkpoint {theirs!r}, config {ours!r}")
        # The LR schedule and peak lr are restored from the checkpoint, so a changed one would be ignored.
        sched = {"lr": cfg.optimizer.lr, **to_dict(cfg.schedule)}
        for key, ours in sched.items():
            theirs = (saved.schedule or {}).get(key, ours)
            if theirs != ours:
                problems.append(f"{'optimizer' if key == 'lr' else 'schedule'}.{key}: checkpoint {theirs!r}, "
                                f"config {ours!r}")
    if _bf16_weights(saved) and (what == "resume" or cfg.checkpoint.init_load_optimizer):
        problems.append("precision: the checkpoint holds bf16 weights and DeepSpeed's bf16 optimizer wrapper state; "
                        "bertdist's bf16 keeps fp32 weights, or fp32 masters in its own optimizer "
                        "(bertdist/train/precision.py), which cannot load that optimizer state (checkpoint.init_from with init_load_optimizer=false "
                        "loads the weights)")
    if problems:
        raise ConfigError(
            f"cannot {what} from this checkpoint, the config is incompatible:\n  " + "\n  ".join(problems)
            + ("\n(to change these, start a new phase from the checkpoint with checkpoint.init_from instead of "
               "--resume)" if what == "resume" else "")
        )


def _bf16_weights(saved: TrainerState) -> bool:
    """A bf16 checkpoint from DeepSpeed's bf16 mode: bf16 weights, fp32 masters in the optimizer wrapper."""
    return saved.precision == "bf16" and saved.weights is None


def _read_state(load_dir: Path, tag: str) -> TrainerState:
    try:
        return TrainerState.from_dict(read_checkpoint_state(load_dir, tag))
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{load_dir / tag}: {e}") from None


def check_fresh_start(cfg: TrainConfig, resume: str | None, overwrite: bool) -> None:
    """A run started without ``--resume`` in a run directory that holds checkpoints would replace
    its config.yaml and ``latest``, overwrite checkpoints at the same steps and let retention
    delete the rest: refused unless ``--overwrite`` says so."""
    if resume or overwrite:
        return
    # Whatever the directory holds counts, not only what ``latest`` names: a deleted ``latest``
    # must not let a fresh start write over complete checkpoints.
    tags = saved_tags(Path(cfg.checkpoint_dir), complete_only=False)
    if tags:
        latest = latest_tag(Path(cfg.checkpoint_dir))
        held = (f"latest: {latest}" if latest else
                f"{len(tags)} checkpoint director{'y' if len(tags) == 1 else 'ies'}, newest {tags[-1]}, and no "
                f"'{LATEST}' file")
        raise ConfigError(f"{cfg.run_dir} holds checkpoints of an earlier run ({held} in {cfg.checkpoint_dir}); "
                          "continue it with --resume auto, start over in it with --overwrite (its checkpoints are "
                          "then replaced and deleted by retention), or choose another run_dir")


def plan_restore(cfg: TrainConfig, resume: str | None, world_size: int) -> RestorePlan:
    """``resume``: None (fresh, or ``checkpoint.init_from``), "auto" (this run's latest checkpoint
    if any) or a checkpoint path. Reads only ``latest`` and ``trainer_state.json``."""
    plan = RestorePlan("fresh")
    if resume:
        if resume == "auto":
            ckpt_dir = Path(cfg.checkpoint_dir)
            tag = latest_tag(ckpt_dir)
            if tag is None and saved_tags(ckpt_dir):  # ``latest`` lost: the newest complete checkpoint
                tag = saved_tags(ckpt_dir)[-1]
            load_dir = ckpt_dir if tag is not None else None
        else:
            load_dir, tag = resolve_checkpoint(resume)
        if tag is not None:
            saved = _read_state(load_dir, tag)
            check_compatible(saved, cfg, "resume")
            plan = RestorePlan("resume", load_dir, tag, saved)
    if plan.mode == "fresh" and cfg.checkpoint.init_from:
        load_dir, tag = resolve_checkpoint(cfg.checkpoint.init_from)
        saved = _read_state(load_dir, tag)
        check_compatible(saved, cfg, "start a new phase")
        plan = RestorePlan("init", load_dir, tag, saved)
    loads_optimizer = plan.mode == "resume" or (plan.mode == "init" and cfg.checkpoint.init_load_optimizer)
    if plan.saved is not None and plan.saved.world_size != world_size and loads_optimizer:
        universal = plan.saved.zero_stage > 0
        plan = dataclasses.replace(plan, universal=universal)
    return plan


def new_state(cfg: TrainConfig, world_size: int, grad_accum: int) -> TrainerState:
    """The state of a run at step 0 of its phase."""
    return TrainerState(
        step=0, phase=cfg.phase, phases=[{"phase": cfg.phase, "init_from": None, "init_step": None}],
        loader={"epoch": 0, "position": 0}, world_size=world_size, model=to_dict(cfg.model),
        optimizer=cfg.optimizer.name, zero_stage=cfg.deepspeed.zero_stage, precision=cfg.deepspeed.precision,
        weights=precision_policy(cfg.deepspeed.precision, weights=cfg.weights).weights,
        seed=cfg.seed, micro_batch_size=cfg.data.micro_batch_size, global_batch_size=cfg.data.global_batch_size,
        grad_accum=grad_accum, schedule={"lr": cfg.optimizer.lr, **to_dict(cfg.schedule)})


def restore(engine, scheduler, plan: RestorePlan, cfg: TrainConfig, rank: int, state: TrainerState,
            generators=None) -> TrainerState:
    """Load ``plan`` into ``engine`` and seed this rank's RNGs; returns ``state`` moved to where the
    run continues (step, loader position, phase history). ``generators``: the objective's named
    ``torch.Generator``s (ELECTRA's sampling), restored from the checkpoint with the global RNGs, or
    seeded where it has none for them (a fresh start, a new phase, a new world size)."""
    from bertdist.export.safe_load import safe_deepspeed_loads
    from bertdist.train.checkpoint import read_rng_state, seed_all, seed_generators, set_rng_state

    if plan.mode == "resume":
        with safe_deepspeed_loads(engine):
            path, _ = engine.load_checkpoint(str(plan.load_dir), plan.tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load checkpoint {plan.load_dir}/{plan.tag}")
        saved = plan.saved
        state = dataclasses.replace(state, step=saved.step, loader=saved.loader, phases=saved.phases)
        rng = read_rng_state(Path(plan.load_dir) / plan.tag, rank) if saved.world_size == state.world_size else None
        if rng is not None:
            missing = set_rng_state(rng, generators)
            seed_generators({k: generators[k] for k in missing}, cfg.seed, rank, state.step)
        else:
            seed_all(cfg.seed + 7919 * (rank + 1) + state.step)
            seed_generators(generators, cfg.seed, rank, state.step)
        return state
    seed_all(cfg.seed + 7919 * (rank + 1))  # per-rank dropout streams
    seed_generators(generators, cfg.seed, rank, 0)
    if plan.mode == "init":
        load_optimizer = cfg.checkpoint.init_load_optimizer
        with safe_deepspeed_loads(engine):
            engine.load_checkpoint(str(plan.load_dir), plan.tag, load_optimizer_states=load_optimizer,
                                   load_lr_scheduler_states=False, load_module_only=not load_optimizer)
        # A fresh phase: fresh step count and warmup; the lr the first step uses is the new schedule's.
        engine.global_steps, engine.global_samples, engine.skipped_steps = 0, 0, 0
        lam = scheduler.lr_lambdas[0]
        for g, base in zip(engine.optimizer.param_groups, scheduler.base_lrs):
            g["lr"] = base * lam(0)
            if "max_lr" in g:  # StableAdamW's lr-independent decay is relative to this phase's peak
                g["max_lr"] = base
        state = dataclasses.replace(state, phases=plan.saved.phases + [
            {"phase": cfg.phase, "init_from": f"{plan.load_dir}/{plan.tag}", "init_step": plan.saved.step}])
    return state
