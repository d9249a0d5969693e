"""Checkpoints: atomic saves with retention (in this process), a crash in the middle of a save, and a
ZeRO-2 checkpoint of 2 ranks resumed on 1 (universal checkpoint; real runs under torchrun)."""
from __future__ import annotations

import json
import signal

import pytest

from bertdist.train.checkpoint import COMPLETE, LATEST, STAGING, CheckpointManager, latest_tag, read_checkpoint_state
from bertdist.train.state import TrainerState
from tests.train.conftest import assert_ok, metrics, run_pretrain, run_steps, tiny_args, tiny_cfg


def test_saves_publish_atomically_and_keep_the_last_n(group, tmp_path, train_records, small_vocab):
    import dataclasses

    from bertdist.train.restore import new_state

    cfg = tiny_cfg(tmp_path, train_records, small_vocab)
    _, engine = run_steps(cfg, train_records, 1)
    ckpt_dir = tmp_path / "ckpt"
    (ckpt_dir / STAGING / "step_00000009").mkdir(parents=True)  # a save that crashed earlier
    mgr = CheckpointManager(ckpt_dir, keep_last_n=2, rank=0, world_size=1)
    assert not (ckpt_dir / STAGING / "step_00000009").exists() and latest_tag(ckpt_dir) is None
    state = new_state(cfg, 1, 1)
    for step in (1, 2, 3):
        tag = mgr.save(engine, dataclasses.replace(state, step=step), cfg)
        assert latest_tag(ckpt_dir) == tag == f"step_{step:08d}"
    assert sorted(p.name for p in ckpt_dir.glob("step_*")) == ["step_00000002", "step_00000003"]
    saved = TrainerState.from_dict(read_checkpoint_state(ckpt_dir, "step_00000003"))
    assert saved == dataclasses.replace(state, step=3)
    assert (ckpt_dir / "step_00000003" / COMPLETE).is_file() and (ckpt_dir / "step_00000003" / "rng_state_rank0.json").is_file()
    # saving the same step again replaces it whole
    mgr.save(engine, dataclasses.replace(state, step=3, skipped_steps=5), cfg)
    assert json.loads((ckpt_dir / "step_00000003" / "trainer_state.json").read_text())["skipped_steps"] == 5
    assert (ckpt_dir / LATEST).read_text().strip() == "step_00000003" and not list((ckpt_dir / STAGING).iterdir())


@pytest.mark.slow
def test_killed_save_leaves_last_good_checkpoint(tmp_path, train_records, small_vocab):
    args = tiny_args(tmp_path, train_records, small_vocab, "schedule.total_steps=10", "checkpoint.every_steps=5",
                     "eval.at_start=false", "eval.every_steps=0")
    res = run_pretrain(1, args, faults=["--kill-in-save", "step_00000010"])
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000005"
    assert not (ckpt / "step_00000010").exists()
    partial = list((ckpt / ".staging" / "step_00000010").iterdir())
    assert partial, "the crash should have happened mid-save"
    res = run_pretrain(1, [*args, "--resume", "auto"])
    assert_ok(res)
    resumed = [r for r in metrics(tmp_path)][-5:]
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    assert (ckpt / "latest").read_text().strip() == "step_00000010"
    assert (ckpt / "step_00000010" / "COMPLETE").is_file()
    assert not (ckpt / ".staging" / "step_00000010").exists()


@pytest.mark.slow
def test_zero2_checkpoint_from_two_ranks_resumes_on_one(tmp_path, train_records, small_vocab):
    common = ["optimizer.name=adamw", "optimizer.lr=1e-3", "deepspeed.zero_stage=2", "model.hidden_dropout_prob=0",
              "model.attention_probs_dropout_prob=0", "schedule.total_steps=12", "checkpoint.every_steps=10",
              "checkpoint.keep_last_n=0", "eval.at_start=false", "eval.every_steps=0", "eval.at_end=false"]
    two = tmp_path / "two"
    assert_ok(run_pretrain(2, tiny_args(two, train_records, small_vocab, *common)))
    assert (two / "checkpoints" / "step_00000010" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    one = tmp_path / "one"
    res = run_pretrain(1, [*tiny_args(one, train_records, small_vocab, *common),
                           "--resume", str(two / "checkpoints" / "step_00000010")])
    assert_ok(res)
    ref = {r["step"]: r for r in metrics(two)}
    got = metrics(one)
    assert [r["step"] for r in got] == [11, 12]
    # Same global batch, same data and masks (the order does not depend on the world size), no dropout:
    # only the summation order differs.
    for r in got:
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=1e-4), (r, ref[r["step"]])
        assert r["lr"] == ref[r["step"]]["lr"]
    assert (two / "checkpoints" / "universal" / "step_00000010" / "COMPLETE").is_file()
    assert metrics(one, "run")[0]["world_size"] == 1
