"""Against a real SLURM (slurmctld + slurmd + munge on localhost, started by `make slurm`)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import slurm
from cluster.spec import Resources
from tests.cluster.conftest import bertdist, wait_for_job

pytestmark = pytest.mark.slurm
HERE = Path(__file__).resolve().parent


def test_sbatch_runs_a_two_task_srun_job(slurm_cluster, tmp_path):
    script = tmp_path / "two.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output={tmp_path}/out-%j.txt\n"
                      "srun bash -c 'echo task=$SLURM_PROCID ntasks=$SLURM_NTASKS node=$SLURMD_NODENAME'\n")
    proc = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    lines = sorted((tmp_path / f"out-{job_id}.txt").read_text().split())
    assert lines == sorted([f"task={i}" for i in (0, 1)] + ["ntasks=2"] * 2 + [f"node={slurm_cluster}"] * 2)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_submit_probe_through_sbatch(slurm_cluster, tmp_path, launcher):
    """`bertdist submit probe`: the rendered script's rendezvous and rank mapping, for real."""
    out = tmp_path / "probe"
    r = bertdist("submit", "probe", "--out", str(out), "--scheduler", "slurm", "--procs-per-node", "2",
                 "--launcher", launcher, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split("submitted SLURM job ")[1].split()[0]
    fields = wait_for_job(job_id, timeout=120)
    log = (out / "jobs" / f"bertdist-probe-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED", log
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [x["rank"] for x in ranks] == [0, 1] and {x["local_rank"] for x in ranks} == {0, 1}
    assert all(x["world_size"] == 2 and x["all_reduce"] == 3.0 for x in ranks)
    assert all(x["slurm_job_id"] == job_id for x in ranks)
    assert f"master {slurm_cluster}:{20000 + int(job_id) % 20000} world 2" in log
    # jobs status / logs read the same job back
    st = bertdist("jobs", "status", job_id)
    assert st.returncode == 0 and "COMPLETED" in st.stdout and f"bertdist-probe-{job_id}.out" in st.stdout
    lg = bertdist("jobs", "logs", job_id)
    assert lg.returncode == 0 and "[probe] rank 1/2" in lg.stdout


def test_jobs_cancel_and_status(slurm_cluster, tmp_path):
    script = tmp_path / "sleep.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH --output={tmp_path}/%j.out\nsleep 300\n")
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                            check=True).stdout.strip()
    wait_for_job(job_id, timeout=60, states=("RUNNING",))
    st = bertdist("jobs", "status", job_id)
    assert "RUNNING" in st.stdout, st.stdout + st.stderr
    q = bertdist("jobs", "status", "--all")
    assert job_id in q.stdout
    c = bertdist("jobs", "cancel", job_id)
    assert c.returncode == 0, c.stderr
    assert wait_for_job(job_id, timeout=60)["JobState"] == "CANCELLED"


def test_scheduler_rejection_is_passed_through(slurm_cluster, tmp_path):
    r = bertdist("submit", "probe", "--out", str(tmp_path / "p"), "--partition", "no-such-partition", cwd=tmp_path)
    assert r.returncode == 2
    assert "sbatch rejected the job" in r.stderr and "invalid partition" in r.stderr.lower(), r.stderr


def test_preempted_job_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """The batch script's SIGTERM path: `scontrol requeue` mid-run -> every rank checkpoints,
    the job comes back (same id, restart 1) and finishes from the checkpoint."""
    total, every = 60, 10
    program = [sys.executable, str(HERE / "ckpt_counter.py"), str(tmp_path), str(total), str(every)]
    script = slurm.render_job_script(name="requeue-test", run_dir=tmp_path, config_label="ckpt_counter",
                                     program=program, res=Resources(procs_per_node=2, requeue_grace_s=30),
                                     workdir=tmp_path)
    (tmp_path / "jobs").mkdir()  # sbatch needs the --output directory to exist (submit creates it)
    path = tmp_path / "requeue.sbatch"
    path.write_text(script)
    job_id = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True,
                            check=True).stdout.strip()
    events = [tmp_path / f"events-{r}.jsonl" for r in (0, 1)]

    def steps(r):
        if not events[r].exists():
            return []
        return [json.loads(x) for x in events[r].read_text().splitlines()]

    deadline = time.monotonic() + 90
    while not all(any(e["event"] == "step" and e["step"] >= 15 for e in steps(r)) for r in (0, 1)):
        assert time.monotonic() < deadline, "job did not start stepping"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    # slurmctld holds a requeued job back until its old credential expires (cred_expire, ~2 min).
    # Forcing StartTime=now races that: slurmd then kills the restart ("Job credential revoked").
    wait_for_job(job_id, timeout=90, states=("PENDING",))
    fields = wait_for_job(job_id, timeout=400, states=("COMPLETED", "FAILED", "CANCELLED"))
    log = (tmp_path / "jobs" / f"requeue-test-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED", log
    assert int(fields["Restarts"]) >= 1, fields
    assert "restart 0" in log and "restart 1" in log  # --open-mode=append kept the first start's log
    for r in (0, 1):
        ev = steps(r)
        saved = [e for e in ev if e["event"] == "sigterm_checkpoint"]
        assert saved and saved[0]["restart"] == 0, ev[-5:]
        starts = [e for e in ev if e["event"] == "start"]
        assert [s["restart"] for s in starts][:2] == [0, 1]
        resumed_at = starts[1]["step"]
        last_before = max(e["step"] for e in ev if e["event"] == "step" and e["restart"] == 0)
        assert last_before - resumed_at <= every  # lost at most one checkpoint interval
        assert ev[-1]["event"] == "done" and ev[-1]["step"] == total
