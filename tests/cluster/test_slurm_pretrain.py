"""`bertdist submit pretrain` through a real SLURM: a tiny two-task CPU run, and its preemption.

Written against the documented CLI: `bertdist pretrain <config> --resume auto [key=value ...]`
(bertdist/cli/pretrain.py) and `bertdist data build --input ... --output ... --vocab ... --set k=v`.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from bertdist.cli.main import SUBCOMMANDS
from tests.cluster.conftest import bertdist, wait_for_job

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.shared,
    pytest.mark.skipif("bertdist.cli.pretrain" not in SUBCOMMANDS,
                       reason="`bertdist pretrain` is not registered in bertdist/cli/main.py SUBCOMMANDS yet"),
]
STEPS, EVERY = 12, 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory, shared_data) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("shards")
    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    r = bertdist("data", "build", "--input", f"books:{REPO / 'data_pipeline/samples/books/austen-persuasion.txt'}",
                 "--output", str(out), "--vocab", str(vocab), "--set", "max_seq_length=64", "--set", "num_shards=2",
                 "--set", "dupe_factor=1", "--direct_num_workers=1", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "manifest.json", vocab


def _submit(tmp_path: Path, shards) -> tuple[str, Path]:
    manifest, vocab = shards
    run = tmp_path / "run"
    r = bertdist("submit", "pretrain", str(REPO / "configs/pretrain/tiny.yaml"),
                 f"data.train_manifest={manifest}", f"data.vocab_file={vocab}", f"run_dir={run}",
                 f"schedule.total_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "eval.every_steps=0",
                 "logging.progress=none", "--scheduler", "slurm", "--procs-per-node", "2", "--grace", "30",
                 cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("submitted SLURM job ")[1].split()[0], run


def _metric_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x).get("step", -1) for x in path.read_text().splitlines() if x.strip()]


def test_tiny_two_task_pretraining_through_sbatch(slurm_cluster, tmp_path, shards):
    job_id, run = _submit(tmp_path, shards)
    fields = wait_for_job(job_id, timeout=900)
    log = next((run / "jobs").glob(f"*-{job_id}.out")).read_text()
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    assert "world 2" in log
    assert (run / "checkpoints" / "latest").exists()
    assert max(_metric_steps(run)) == STEPS


def test_preempted_pretraining_resumes_from_checkpoint(slurm_cluster, tmp_path, shards):
    job_id, run = _submit(tmp_path, shards)
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.5)
    steps_before = max(_metric_steps(run) or [0])
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    wait_for_job(job_id, timeout=120, states=("PENDING",))
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    fields = wait_for_job(job_id, timeout=900)
    log = next((run / "jobs").glob(f"*-{job_id}.out")).read_text()
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, log[-3000:]
    steps = _metric_steps(run)
    assert max(steps) == STEPS
    assert steps_before >= EVERY and sorted(set(steps)) == list(range(1, STEPS + 1))
    # the second start resumed from a checkpoint: it repeats at most one checkpoint interval of steps
    assert len(steps) - len(set(steps)) <= EVERY
