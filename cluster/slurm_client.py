"""Talking to SLURM through its command-line tools: sbatch, squeue, scontrol, sacct, scancel.

Every failure becomes a SubmitError carrying the tool's own message, so a
scheduler rejection (bad partition, account, time limit, ...) reaches the user verbatim.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import SubmitError
from cluster.safe_values import slurm_job_id

# States after which a job will not run again (unless requeued by hand).
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SubmitError(
            f"{name} not found on PATH: this machine has no SLURM client. Run on a cluster login node, "
            "or use --dry-run to see the script, or --scheduler local to run here"
        )
    return path


def _run(argv: list[str], what: str, timeout: float = 60) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"{what}: `{' '.join(argv)}` did not answer within {timeout:.0f} s (is slurmctld up?)") from None
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}")
        raise SubmitError(f"{what}: {msg}")
    return proc.stdout


def sbatch(script: Path, extra_args: list[str] | None = None) -> str:
    """Submit ``script``; returns the job id. A rejection raises with sbatch's message."""
    out = _run([_tool("sbatch"), "--parsable", *(extra_args or []), str(script)], "sbatch rejected the job")
    # --parsable prints "jobid" or "jobid;cluster"
    return slurm_job_id(out.strip().split(";")[0], "sbatch printed a job id")


def scancel(job_id: str, signal: str | None = None) -> None:
    slurm_job_id(job_id)
    argv = [_tool("scancel")]
    if signal:
        # --batch: only the batch shell, as with SLURM's --signal=B:TERM before the time limit; its
        # trap signals the training tasks and requeues. (--full would also hit srun, and srun
        # answers SIGTERM by killing its tasks before they can checkpoint.)
        argv += [f"--signal={signal}", "--batch"]
    _run([*argv, job_id], f"scancel {job_id}")


def requeue(job_id: str) -> None:
    slurm_job_id(job_id)
    _run([_tool("scontrol"), "requeue", job_id], f"scontrol requeue {job_id}")


def _parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o`` prints one line of Key=Value pairs; values never contain ' Key='."""
    fields: dict[str, str] = {}
    import re

    for m in re.finditer(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)", text.strip()):
        fields[m.group(1)] = m.group(2)
    return fields


@dataclass
class JobInfo:
    job_id: str
    name: str
    state: str
    reason: str
    exit_code: str
    elapsed: str
    nodes: str
    restarts: int
    stdout: str | None
    source: str  # which tool answered

    @property
    def finished(self) -> bool:
        return self.state.split()[0] in FINAL_STATES


def job_info(job_id: str) -> JobInfo:
    """State of a job: scontrol (live and recently finished jobs), else sacct (accounting), else an error."""
    slurm_job_id(job_id)
    scontrol = _tool("scontrol")
    proc = subprocess.run([scontrol, "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 and proc.stdout.strip():
        f = _parse_scontrol(proc.stdout.splitlines()[0])
        return JobInfo(
            job_id=f.get("JobId", job_id),
            name=f.get("JobName", ""),
            state=f.get("JobState", "UNKNOWN"),
            reason=f.get("Reason", ""),
            exit_code=f.get("ExitCode", ""),
            elapsed=f.get("RunTime", ""),
            nodes=f.get("NodeList", ""),
            restarts=int(f.get("Restarts", "0") or 0),
            stdout=f.get("StdOut"),
            source="scontrol",
        )
    sacct = shutil.which("sacct")
    if sacct:
        acct = subprocess.run(
            [sacct, "-j", job_id, "-X", "-n", "-P", "-o", "JobID,JobName,State,ExitCode,Elapsed,NodeList"],
            capture_output=True, text=True, timeout=60,
        )
        if acct.returncode == 0 and acct.stdout.strip():
            jid, name, state, exit_code, elapsed, nodes = acct.stdout.splitlines()[0].split("|")[:6]
            return JobInfo(jid, name, state, "", exit_code, elapsed, nodes, 0, None, "sacct")
    why = (proc.stderr.strip() or "no such job")
    raise SubmitError(f"job {job_id}: {why} (finished jobs leave scontrol after MinJobAge; sacct needs slurmdbd)")


def queue(user: str | None = None) -> str:
    """squeue's table for ``user`` (all users when None)."""
    argv = [_tool("squeue"), "-o", "%.10i %.24j %.9T %.10M %.10l %.5D %R"]
    if user:
        argv += ["-u", user]
    return _run(argv, "squeue")
