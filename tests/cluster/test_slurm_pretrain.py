"""`bertdist submit pretrain --scheduler slurm` through a real SLURM: a tiny two-task CPU run, and its preemption.

Records come from the real pipeline (`data_pipeline.build_records`, in-process) over the bundled
Gutenberg samples, with a WordPiece vocab trained on the same text, so no ../shared is needed.
"""
from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import bertdist, wait_for_job

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data_pipeline" / "samples"
pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def records(tmp_path_factory, small_vocab) -> tuple[Path, Path]:
    """(manifest.json, vocab.txt): seq 64, two shards, NSP."""
    from data_pipeline import build_records

    out = tmp_path_factory.mktemp("slurm_records")
    manifest = build_records([f"books:{SAMPLES / 'books'}"], out / "shards", small_vocab, max_seq_length=64,
                             dupe_factor=1, num_shards=2)
    return manifest, small_vocab


def _submit(run: Path, records, steps: int, every: int) -> str:
    manifest, vocab = records
    r = bertdist("submit", "pretrain", str(REPO / "configs/pretrain/tiny.yaml"),
                 f"data.train_manifest={manifest}", f"data.vocab_file={vocab}", f"run_dir={run}",
                 f"schedule.total_steps={steps}", f"checkpoint.every_steps={every}", "checkpoint.keep_last_n=0",
                 "data.eval_split=null", "logging.progress=none", "logging.tensorboard=false",
                 "--scheduler", "slurm", "--procs-per-node", "2", "--grace", "30", cwd=run.parent)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("submitted SLURM job ")[1].split()[0]


def _records(run: Path, kind: str) -> list[dict]:
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [r for r in rows if r["kind"] == kind]


def _job_log(run: Path, job_id: str) -> str:
    return (run / "jobs" / f"bertdist-tiny-{job_id}.out").read_text()


def test_tiny_two_task_pretraining_through_sbatch(slurm_cluster, tmp_path, records):
    import torch

    from bertdist.model import BertForPreTraining
    from bertdist.train import load_train_config

    steps, every = 12, 4
    run = tmp_path / "run"
    job_id = _submit(run, records, steps, every)
    fields = wait_for_job(job_id, timeout=600)
    log = _job_log(run, job_id)
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    # the trainer itself saw two gloo ranks (rank 0 reports it), and stopped at the end
    assert f"fresh at step 0/{steps}, world 2 (gloo, cpu)" in log, log[-3000:]
    assert f"stopped (end) at step {steps}" in log
    assert (run / "jobs" / f"{job_id}.json").is_file() and list((run / "jobs").glob("bertdist-tiny-*.sbatch"))

    # metrics.jsonl: every step once, finite losses; checkpoints every `every` steps
    train = _records(run, "train")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in train)
    assert [r["step"] for r in _records(run, "checkpoint")] == list(range(every, steps + 1, every))

    # the latest checkpoint is complete and its weights load into the model (strict: every key, every shape)
    ckpt = run / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    assert tag == f"step_{steps:08d}" and (ckpt / tag / "COMPLETE").is_file()
    state = json.loads((ckpt / tag / "trainer_state.json").read_text())
    assert state["step"] == steps and state["world_size"] == 2
    cfg = load_train_config(ckpt / tag / "bertdist_config.yaml")
    model = BertForPreTraining(cfg.model)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    sd = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    model.load_state_dict(sd, strict=True)
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert not torch.equal(init["bert.encoder.layer.0.attention.self.query.weight"],
                           model.state_dict()["bert.encoder.layer.0.attention.self.query.weight"])


PREEMPT = {
    # what SLURM does --grace seconds before the time limit (--signal=B:TERM): only the batch script
    # gets SIGTERM; it asks the ranks to checkpoint, and requeues the job itself
    "sigterm": ["bertdist", "jobs", "cancel", "{job}", "--signal", "TERM"],
    # what a preempting scheduler does: requeue a running job; every process gets SIGTERM, SIGKILL later
    "requeue": ["scontrol", "requeue", "{job}"],
}


@pytest.mark.parametrize("how", list(PREEMPT))
def test_preempted_pretraining_resumes_from_checkpoint(slurm_cluster, tmp_path, records, how):
    """Preempted mid-run, the job comes back (same id, restart 1), resumes from the last checkpoint
    and finishes every step, losing at most one checkpoint interval; on the SIGTERM path, none."""
    # 0.07 s a step on CI: 115 steps after the first checkpoint leave ~8 s for the preemption to land mid-run
    steps, every = 120, 5
    run = tmp_path / "run"
    job_id = _submit(run, records, steps, every)
    deadline = time.monotonic() + 300
    while not _records(run, "checkpoint"):  # mid-run: after the first periodic checkpoint
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    argv = [a.format(job=job_id) for a in PREEMPT[how]]
    r = bertdist(*argv[1:]) if argv[0] == "bertdist" else subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    wait_for_job(job_id, timeout=120, states=("PENDING",))
    # slurmctld holds a requeued job back until its old credential expires (cred_expire, ~2 min).
    # Forcing StartTime=now races that: slurmd then kills the restart ("Job credential revoked").
    fields = wait_for_job(job_id, timeout=600)
    log = _job_log(run, job_id)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) == 1, log[-3000:]
    assert "restart 0" in log and "restart 1" in log, log[-3000:]

    starts = _records(run, "run")
    assert [s["mode"] for s in starts] == ["fresh", "resume"], starts
    resumed_at = starts[1]["step"]
    assert f"resume at step {resumed_at}/{steps}, world 2" in log
    train = _records(run, "train")
    before = [r["step"] for r in train if r["time"] < starts[1]["time"]]
    after = [r["step"] for r in train if r["time"] >= starts[1]["time"]]
    saved_before = [c["step"] for c in _records(run, "checkpoint") if c["time"] < starts[1]["time"]]
    # preempted mid-run; resumed from the last checkpoint written before the restart
    assert before == list(range(1, max(before) + 1)) and max(before) < steps, before
    assert resumed_at == max(saved_before) >= every
    assert max(before) - resumed_at <= every
    if how == "sigterm":
        # the ranks finished their step and checkpointed it: nothing is lost
        assert f"SIGTERM: stopping after step {max(before)}" in log and "requeueing job" in log, log[-3000:]
        assert resumed_at == max(before)
    # the second start ran exactly the remaining steps and saved the final checkpoint
    assert after == list(range(resumed_at + 1, steps + 1))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
