"""Real DeepSpeed runs on CPU (gloo): two ranks under torchrun, the tiny config, seq 64.

- the reference run: loss falls, held-out MLM accuracy rises, logs / TensorBoard / checkpoints exist;
- SIGKILL after step 23, `--resume auto` from step 20: losses of steps 21..40 equal the
  reference run's bitwise (deterministic mode);
- SIGTERM: both ranks stop at the same step, write a checkpoint and exit 0;
- a non-finite loss on one rank stops every rank before the update;
- phase 2 starts from a phase-1 checkpoint with a fresh schedule, and --resume refuses a mismatch.
Checkpoint crashes and world-size changes: test_checkpoint.py.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.train.conftest import (
    assert_ok,
    last_train_step,
    metrics,
    run_pretrain,
    start_pretrain,
    tiny_args,
    wait_for,
)

pytestmark = pytest.mark.slow  # two-rank torchrun / DeepSpeed launcher runs


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, train_records, small_vocab):
    run_dir = tmp_path_factory.mktemp("reference")
    res = run_pretrain(2, tiny_args(run_dir, train_records, small_vocab))
    assert_ok(res)
    return run_dir


def test_two_process_run_learns(reference_run):
    train = metrics(reference_run)
    assert [r["step"] for r in train] == list(range(1, 41))
    losses = [r["loss"] for r in train]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses
    evals = metrics(reference_run, "eval")
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[-1]["mlm_acc"] > evals[0]["mlm_acc"] + 0.02, evals
    assert evals[-1]["mlm_loss"] < evals[0]["mlm_loss"], evals
    run = metrics(reference_run, "run")[0]
    assert run["world_size"] == 2 and run["grad_accum"] == 1
    for key in ("lr", "grad_norm", "loss_scale", "skipped_steps", "seq_per_s", "tokens_per_s", "tflops", "mfu",
                "mlm_acc", "nsp_acc", "nsp_loss", "mlm_loss"):
        assert key in train[-1], key
    assert all(r["grad_norm"] == r["grad_norm"] and r["grad_norm"] > 0 for r in train)  # finite, not NaN
    ckpt = reference_run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_00000040"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000020", "step_00000040"]  # keep_last_n=2
    tag = ckpt / "step_00000040"
    for name in ("COMPLETE", "bertdist_config.yaml", "trainer_state.json", "mp_rank_00_model_states.pt",
                 "rng_state_rank0.json", "rng_state_rank1.json"):
        assert (tag / name).is_file(), name
    state = json.loads((tag / "trainer_state.json").read_text())
    assert state["step"] == 40 and state["world_size"] == 2 and state["loader"] == {"epoch": 0, "position": 40 * 32}
    assert (reference_run / "config.yaml").is_file() and list((reference_run / "tensorboard").glob("events.*"))


def test_kill_and_resume_is_bitwise_exact(reference_run, tmp_path, train_records, small_vocab):
    args = tiny_args(tmp_path, train_records, small_vocab)
    res = run_pretrain(2, args, faults=["--kill-after-step", "23"])
    assert res.returncode != 0  # rank 0 was SIGKILLed
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    assert last_train_step(tmp_path) >= 23
    res = run_pretrain(2, [*args, "--resume", "auto"])
    assert_ok(res)
    ref = {r["step"]: r["loss"] for r in metrics(reference_run)}
    rows = metrics(tmp_path)
    resumed = [r for r in rows[rows.index(next(r for r in rows if r["step"] == 23)) + 1:]]
    assert [r["step"] for r in resumed] == list(range(21, 41))  # no replayed or skipped step
    mismatch = [(r["step"], r["loss"], ref[r["step"]]) for r in resumed if r["loss"] != ref[r["step"]]]
    assert not mismatch, mismatch
    first_run = {r["step"]: r["loss"] for r in rows[: rows.index(resumed[0])]}
    assert all(first_run[s] == ref[s] for s in range(1, 24))


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_sigterm_checkpoints_and_exits_cleanly(launcher, tmp_path, train_records, small_vocab):
    args = tiny_args(tmp_path, train_records, small_vocab, "schedule.total_steps=400", "checkpoint.every_steps=0",
                     "eval.every_steps=0", "data.prefetch_steps=0")
    log = tmp_path / "log.txt"
    proc = start_pretrain(2, args, log, launcher=launcher)
    wait_for(lambda: last_train_step(tmp_path) >= 3, proc, 240, "step 3", log)
    if launcher == "torchrun":
        os.killpg(proc.pid, signal.SIGTERM)  # like SLURM: every process of the job gets it
    else:
        # Only the launcher: it passes SIGTERM to rank 0 and waits for it before rank 1; rank 1 learns
        # of the stop through the per-step all-reduce, so both checkpoint the same step.
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    text = log.read_text()
    step = last_train_step(tmp_path)
    assert 3 <= step < 400
    tag = f"step_{step:08d}"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == tag, text[-3000:]
    assert (tmp_path / "checkpoints" / tag / "COMPLETE").is_file()
    assert f"SIGTERM: stopping after step {step}" in text
    assert "stopped (sigterm)" in text, text[-3000:]
    # The workers exit 0; the launcher reports the signal it received (torchrun with a traceback).
    assert rc in (0, 1, -signal.SIGTERM, 128 + signal.SIGTERM), text[-3000:]
    assert "ChildFailedError" not in text and "exits with return code" not in text, text[-5000:]
    for chunk in text.split("Traceback (most recent call last):")[1:]:
        assert "SignalException" in chunk[:4000], chunk[:4000]


def test_nonfinite_loss_on_one_rank_aborts_all_before_the_update_is_saved(tmp_path, train_records, small_vocab):
    args = tiny_args(tmp_path, train_records, small_vocab, "checkpoint.every_steps=2", "eval.at_start=false",
                     "eval.every_steps=0")
    res = run_pretrain(2, args, faults=["--nan-loss-on-rank", "1", "--nan-loss-from-call", "3"])
    out = res.stdout + res.stderr
    assert "training aborted: non-finite loss at step 3" in out, out[-4000:]
    assert "the update was not saved" in out and "--resume auto" in out
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]  # both ranks stopped at the same step
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_phase2_starts_from_phase1_with_fresh_schedule(reference_run, tmp_path, train_records, small_vocab):
    args = tiny_args(tmp_path, train_records, small_vocab, "phase=2", "optimizer.lr=4e-3",
                     "schedule.total_steps=4", "schedule.warmup_steps=2", "checkpoint.every_steps=0",
                     f"checkpoint.init_from={reference_run / 'checkpoints'}", "eval.at_start=false",
                     "eval.every_steps=0")
    assert_ok(run_pretrain(1, args))
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["lr"] == pytest.approx(2e-3) and rows[1]["lr"] == pytest.approx(4e-3)  # fresh warmup
    ref = metrics(reference_run)
    assert rows[0]["loss"] < ref[0]["loss"] - 0.2  # starts from the trained weights
    state = json.loads((tmp_path / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["phase"] == 2 and state["step"] == 4
    assert [p["phase"] for p in state["phases"]] == [1, 2]
    assert state["phases"][1]["init_step"] == 40 and "step_00000040" in state["phases"][1]["init_from"]
    # --resume refuses a checkpoint of another phase or another architecture, saying why.
    res = run_pretrain(1, [*tiny_args(tmp_path, train_records, small_vocab, "phase=1"), "--resume", "auto"])
    assert res.returncode == 2 and "phase: checkpoint 2, config 1" in res.stderr, res.stderr[-2000:]
    res = run_pretrain(1, [*tiny_args(tmp_path, train_records, small_vocab, "phase=2", "model.hidden_size=64"),
                           "--resume", "auto"])
    assert res.returncode == 2 and "model.hidden_size: checkpoint 128, config 64" in res.stderr, res.stderr[-2000:]
    res = run_pretrain(1, [*tiny_args(tmp_path, train_records, small_vocab, "phase=2", "schedule.total_steps=8",
                                      "optimizer.lr=4e-3", "schedule.warmup_steps=2"), "--resume", "auto"])
    assert res.returncode == 2 and "schedule.total_steps: checkpoint 4, config 8" in res.stderr, res.stderr[-2000:]


def killed_after_13_and_resumed(run_dir, train_records, small_vocab, extra, ref: dict) -> None:
    """Two ranks SIGKILLed after step 13 (the last checkpoint at 10), then ``--resume auto``: steps
    11-24 must repeat ``ref``'s losses (the uninterrupted run's) bitwise."""
    res = run_pretrain(2, tiny_args(run_dir, train_records, small_vocab, *extra), faults=["--kill-after-step", "13"])
    assert res.returncode != 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000010"
    assert_ok(run_pretrain(2, [*tiny_args(run_dir, train_records, small_vocab, *extra), "--resume", "auto"]))
    resumed = metrics(run_dir)[-14:]
    assert [(r["step"], r["loss"]) for r in resumed] == [(s, ref[s]) for s in range(11, 25)]


def test_flat_optimizer_kill_and_resume_is_bitwise_exact(tmp_path, train_records, small_vocab):
    """The flat optimizer (parameters as views of its fp32 buffer, clipping fused in) through two
    ranks, a SIGKILL and --resume: the resumed steps repeat the uninterrupted run's losses bitwise."""
    extra = ("optimizer.implementation=flat", "schedule.total_steps=24", "checkpoint.every_steps=10",
             "eval.every_steps=0")
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    assert_ok(run_pretrain(2, tiny_args(ref_dir, train_records, small_vocab, *extra)))
    ref = {r["step"]: r["loss"] for r in metrics(ref_dir)}
    assert sorted(ref) == list(range(1, 25)) and all(r["grad_norm"] > 0 for r in metrics(ref_dir))
    assert json.loads((ref_dir / "ds_config.json").read_text())["gradient_clipping"] == 0.0  # the optimizer clips
    killed_after_13_and_resumed(run_dir, train_records, small_vocab, extra, ref)


def test_bf16_weights_kill_and_resume_is_bitwise_exact_and_exports_the_fp32_masters(tmp_path, train_records,
                                                                                    small_vocab):
    """bf16 weights with fp32 masters (precision bf16, the flat optimizer: bf16_weights auto) on two
    ranks with 2 micro-batches each: a SIGKILL and --resume repeat the uninterrupted run's losses
    bitwise, the checkpoints hold the fp32 masters (not their bf16 rounding), and the export
    writes them."""
    import torch

    from bertdist.export.deepspeed_ckpt import consolidate

    extra = ("optimizer.implementation=flat", "deepspeed.precision=bf16", "data.micro_batch_size=8",
             "schedule.total_steps=24", "checkpoint.every_steps=10", "eval.every_steps=0")
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    assert_ok(run_pretrain(2, tiny_args(ref_dir, train_records, small_vocab, *extra)))
    ref = {r["step"]: r["loss"] for r in metrics(ref_dir)}
    assert sorted(ref) == list(range(1, 25)) and ref[24] < ref[1]
    assert metrics(ref_dir, "run")[0]["grad_accum"] == 2
    assert "torch_autocast" not in json.loads((ref_dir / "ds_config.json").read_text())
    state = json.loads((ref_dir / "checkpoints" / "step_00000024" / "trainer_state.json").read_text())
    assert (state["precision"], state["weights"]) == ("bf16", "bf16")
    killed_after_13_and_resumed(run_dir, train_records, small_vocab, extra, ref)

    a, b = (consolidate(d / "checkpoints" / "step_00000024") for d in (ref_dir, run_dir))
    assert a.state_dict.keys() == b.state_dict.keys()
    assert [k for k in a.state_dict if not torch.equal(a.state_dict[k], b.state_dict[k])] == []
    word = a.state_dict["bert.embeddings.word_embeddings.weight"]
    assert word.dtype == torch.float32 and not torch.equal(word, word.bfloat16().float()), "bf16-rounded weights"
    from safetensors.torch import load_file

    from bertdist.cli.main import main

    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    hf_word = next(v for k, v in exported.items() if k.endswith("embeddings.word_embeddings.weight"))
    assert hf_word.dtype == torch.float32
    assert torch.equal(hf_word, b.state_dict["bert.embeddings.word_embeddings.weight"]), "the export is not the masters"
