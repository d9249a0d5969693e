"""Where a run starts: TrainerState, the compatibility check and plan_restore, without any process group."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertdist.config import ConfigError, to_dict
from bertdist.train.checkpoint import COMPLETE, LATEST, STATE_FILE
from bertdist.train.config import load_train_config
from bertdist.train.restore import check_compatible, new_state, plan_restore
from bertdist.train.state import STATE_FORMAT, TrainerState, checkpoint_tag

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "pretrain" / "tiny.yaml"


def _cfg(tmp_path: Path, *overrides: str):
    return load_train_config(TINY, [f"run_dir={tmp_path / 'run'}", *overrides])


def _write_checkpoint(ckpt_dir: Path, state: TrainerState, *, latest: bool = True, complete: bool = True) -> Path:
    tag_dir = ckpt_dir / checkpoint_tag(state.step)
    tag_dir.mkdir(parents=True)
    (tag_dir / STATE_FILE).write_text(json.dumps(state.to_dict()))
    if complete:
        (tag_dir / COMPLETE).write_text("")
    if latest:
        (ckpt_dir / LATEST).write_text(checkpoint_tag(state.step) + "\n")
    return tag_dir


def _saved(cfg, **changes) -> TrainerState:
    import dataclasses

    return dataclasses.replace(new_state(cfg, world_size=2, grad_accum=1), **{"step": 20, **changes})


def test_trainer_state_round_trips_and_refuses_what_it_cannot_read(tmp_path):
    cfg = _cfg(tmp_path)
    state = new_state(cfg, world_size=2, grad_accum=1)
    assert TrainerState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert state.to_dict()["format"] == STATE_FORMAT and "imported_from" not in state.to_dict()
    with pytest.raises(ValueError, match="format 99 is not supported"):
        TrainerState.from_dict({**state.to_dict(), "format": 99})
    with pytest.raises(ValueError, match=r"lacks \['step'\]"):
        TrainerState.from_dict({k: v for k, v in state.to_dict().items() if k != "step"})
    with pytest.raises(ValueError, match=r"unknown keys \['stepz'\]"):
        TrainerState.from_dict({**state.to_dict(), "stepz": 1})
    # what `bertdist import-hf` writes: no loader, no schedule
    imported = TrainerState(step=0, phase=0, phases=[], loader=None, world_size=1, model=to_dict(cfg.model),
                            optimizer="none", zero_stage=0, precision="fp32", imported_from="hf-dir")
    assert TrainerState.from_dict(imported.to_dict()) == imported
    assert imported.to_dict()["loader"] is None and "schedule" not in imported.to_dict()


def test_compatibility_check_names_every_difference(tmp_path):
    cfg = _cfg(tmp_path)
    saved = _saved(cfg)
    check_compatible(saved, cfg, "resume")  # the run's own checkpoint
    other = _cfg(tmp_path, "model.hidden_size=64", "optimizer.name=adamw", "schedule.total_steps=99", "phase=2")
    with pytest.raises(ConfigError) as e:
        check_compatible(saved, other, "resume")
    msg = str(e.value)
    for part in ("model.hidden_size: checkpoint 128, config 64", "optimizer: checkpoint 'lamb', config 'adamw'",
                 "schedule.total_steps: checkpoint 40, config 99", "phase: checkpoint 1, config 2",
                 "checkpoint.init_from instead of --resume"):
        assert part in msg, msg
    # a new phase may change optimizer, schedule and phase, never the shapes
    check_compatible(saved, _cfg(tmp_path, "optimizer.name=adamw", "schedule.total_steps=99", "phase=2"),
                     "start a new phase")
    with pytest.raises(ConfigError, match="model.num_hidden_layers: checkpoint 2, config 3"):
        check_compatible(saved, _cfg(tmp_path, "model.num_hidden_layers=3"), "start a new phase")


def test_plan_fresh_resume_and_new_phase(tmp_path):
    cfg = _cfg(tmp_path)
    assert plan_restore(cfg, None, 2).mode == "fresh"
    assert plan_restore(cfg, "auto", 2).mode == "fresh"  # nothing saved yet
    ckpt = Path(cfg.checkpoint_dir)
    _write_checkpoint(ckpt, _saved(cfg))
    plan = plan_restore(cfg, "auto", 2)
    assert (plan.mode, plan.load_dir, plan.tag, plan.saved.step, plan.universal) == ("resume", ckpt, "step_00000020",
                                                                                     20, False)
    assert plan_restore(cfg, None, 2).mode == "fresh"  # --resume not given: a fresh run
    # an explicit tag directory
    assert plan_restore(cfg, str(ckpt / "step_00000020"), 2).tag == "step_00000020"
    # a new phase from another run's checkpoint; a resume of this run would win over it
    phase1 = _cfg(tmp_path / "p1")
    _write_checkpoint(Path(phase1.checkpoint_dir), _saved(phase1, step=40))
    p2 = _cfg(tmp_path, "phase=2", f"checkpoint.init_from={phase1.checkpoint_dir}")
    fresh_p2 = _cfg(tmp_path / "p2", "phase=2", f"checkpoint.init_from={phase1.checkpoint_dir}")
    init = plan_restore(fresh_p2, "auto", 2)
    assert (init.mode, init.tag, init.saved.step) == ("init", "step_00000040", 40)
    with pytest.raises(ConfigError, match="phase: checkpoint 1, config 2"):
        plan_restore(p2, "auto", 2)  # this run's own phase-1 checkpoint is not resumable as phase 2


def test_plan_needs_universal_loading_only_for_partitioned_state(tmp_path):
    # saved by 2 ranks; resumed on 1: ZeRO shards must be re-partitioned; bf16 at ZeRO 0 keeps whole
    # fp32 weights and optimizer state on every rank, as fp32 does
    for overrides, universal in ((["optimizer.name=adamw", "deepspeed.zero_stage=2"], True),
                                 (["deepspeed.zero_stage=0", "deepspeed.precision=bf16"], False),
                                 (["deepspeed.zero_stage=0", "deepspeed.precision=fp32"], False)):
        cfg = _cfg(tmp_path / "_".join(overrides), *overrides)
        _write_checkpoint(Path(cfg.checkpoint_dir), _saved(cfg))
        assert plan_restore(cfg, "auto", 1).universal is universal, overrides
        assert plan_restore(cfg, "auto", 2).universal is False
    # a new phase that loads only the weights never needs it
    src = _cfg(tmp_path / "src", "optimizer.name=adamw", "deepspeed.zero_stage=2")
    _write_checkpoint(Path(src.checkpoint_dir), _saved(src))
    for load_opt, universal in (("true", True), ("false", False)):
        cfg = _cfg(tmp_path / f"dst{load_opt}", "optimizer.name=adamw", "deepspeed.zero_stage=2",
                   f"checkpoint.init_from={src.checkpoint_dir}", f"checkpoint.init_load_optimizer={load_opt}")
        assert plan_restore(cfg, None, 1).universal is universal


def test_bf16_checkpoint_with_bf16_weights_loads_only_its_weights(tmp_path):
    # A bf16 checkpoint without "weights" was written by DeepSpeed's bf16 mode: bf16 weights and an
    # optimizer wrapper's state, which the fp32-weight optimizer cannot load.
    cfg = _cfg(tmp_path / "a", "deepspeed.precision=bf16")
    assert new_state(cfg, 1, 1).weights == "fp32"
    _write_checkpoint(Path(cfg.checkpoint_dir), _saved(cfg, weights=None))
    with pytest.raises(ConfigError, match="bf16 weights and DeepSpeed's bf16 optimizer wrapper state"):
        plan_restore(cfg, "auto", 2)
    for load_opt, ok in (("true", False), ("false", True)):
        dst = _cfg(tmp_path / f"b{load_opt}", "deepspeed.precision=bf16", f"checkpoint.init_from={cfg.checkpoint_dir}",
                   f"checkpoint.init_load_optimizer={load_opt}")
        if ok:
            assert plan_restore(dst, None, 2).mode == "init"
        else:
            with pytest.raises(ConfigError, match="init_load_optimizer=false"):
                plan_restore(dst, None, 2)


def test_broken_checkpoints_are_refused_with_the_path(tmp_path):
    cfg = _cfg(tmp_path)
    ckpt = Path(cfg.checkpoint_dir)
    _write_checkpoint(ckpt, _saved(cfg), complete=False)
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        plan_restore(cfg, "auto", 2)
    (ckpt / checkpoint_tag(20) / COMPLETE).write_text("")
    (ckpt / checkpoint_tag(20) / STATE_FILE).write_text(json.dumps({**_saved(cfg).to_dict(), "format": 7}))
    with pytest.raises(ConfigError, match="step_00000020: trainer state format 7 is not supported"):
        plan_restore(cfg, "auto", 2)


def test_a_fresh_start_over_an_earlier_run_is_refused_unless_asked(tmp_path):
    from bertdist.train.restore import check_fresh_start

    cfg = _cfg(tmp_path)
    check_fresh_start(cfg, None, False)  # nothing saved yet
    _write_checkpoint(Path(cfg.checkpoint_dir), _saved(cfg))
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(latest: step_00000020.*--resume "
                                          r"auto.*--overwrite"):
        check_fresh_start(cfg, None, False)
    check_fresh_start(cfg, "auto", False)
    check_fresh_start(cfg, None, True)
    # Protected by what it holds, not by one file: without ``latest`` the checkpoints still count.
    (Path(cfg.checkpoint_dir) / LATEST).unlink()
    _write_checkpoint(Path(cfg.checkpoint_dir), _saved(cfg, step=10), complete=False, latest=False)
    with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(2 checkpoint directories, newest "
                                          r"step_00000020, and no 'latest' file"):
        check_fresh_start(cfg, None, False)
    # --resume auto continues from the newest complete one.
    plan = plan_restore(cfg, "auto", 2)
    assert (plan.mode, plan.tag) == ("resume", checkpoint_tag(20))
