"""The `slurm_cluster` fixture: a real one-node SLURM started by the Makefile's script."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_UP = REPO / "cluster" / "testbed" / "slurm_up.sh"


@contextlib.contextmanager
def _testbed_lock():
    """The one-node test-bed to this pytest process alone (`make test` runs two workers)."""
    with open(Path(tempfile.gettempdir()) / "bertdist-slurm-testbed.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """Starts (or checks) the local SLURM via cluster/testbed/slurm_up.sh; returns the node name."""
    if os.geteuid() != 0:
        pytest.skip("SLURM test-bed needs root (it installs slurm/munge and starts the daemons); run `make slurm` as root")
    with _testbed_lock():
        proc = subprocess.run(["bash", str(SLURM_UP)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        # As root the test-bed must come up: a broken one fails here instead of hiding behind a skip.
        pytest.fail(f"could not start SLURM with {SLURM_UP}: {(proc.stderr or proc.stdout).strip()[-1500:]}")
    return subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()


def _job_processes() -> list[psutil.Process]:
    """Processes started by a SLURM job of the test-bed (they carry its SLURM_JOB_ID), whatever their
    parent now is; not those of a job this pytest itself runs in."""
    own = os.environ.get("SLURM_JOB_ID")
    found = []
    for p in psutil.process_iter():
        try:
            job = p.environ().get("SLURM_JOB_ID")
            if job is not None and job != own:
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(autouse=True)
def one_slurm_test_at_a_time(request):
    """The test-bed is one node and `no_job_left_behind` cancels every job in its queue, so SLURM tests
    in other pytest processes (`make test` runs two workers) wait for each other on a lock file."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    with _testbed_lock():  # released after the cleanup below
        yield


@pytest.fixture(autouse=True)
def no_job_left_behind(request):
    """A SLURM test must end with its jobs finished and their processes gone: a requeued or stray job
    still running would load the machine and hold ports during the tests that follow. Leftovers are
    cancelled and killed, and the test fails naming them."""
    yield
    if "slurm_cluster" not in request.fixturenames or shutil.which("squeue") is None:
        return
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True).stdout.split("\n")
    jobs = [j for j in jobs if j.strip()]
    for j in jobs:
        subprocess.run(["scancel", j.split()[0]])
    procs = _job_processes()
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    if jobs or procs:
        pytest.fail(f"the test left SLURM jobs {jobs} and job processes "
                    f"{[(p.pid, p.name()) for p in procs if p.is_running()] or len(procs)} behind (cancelled and killed now)")


def wait_for_job(job_id: str, timeout: float = 180, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
    """Poll scontrol until the job reaches one of ``states``; returns scontrol's fields."""
    from cluster.slurm_client import _parse_scontrol

    deadline = time.monotonic() + timeout
    fields: dict = {}
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        fields = _parse_scontrol(out) if out.strip() else {}
        if fields.get("JobState") in states:
            return fields
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not reach {states} in {timeout}s: {fields.get('JobState')} {fields.get('Reason')}")


def bertdist(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    exe = shutil.which("bertdist") or str(Path(os.sys.executable).with_name("bertdist"))
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
