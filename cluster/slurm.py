"""Rendering SLURM batch scripts for pretraining and data jobs (submission: slurm_client.py)."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

from cluster.errors import SubmitError
from cluster.launch import job_environment
from cluster.safe_values import job_name, one_line
from cluster.spec import Resources
from cluster.templates import render_template
from cluster.training import TrainingJob

_SAFE_DIRECTIVE = re.compile(r"[^\s'\"\\]+")


def _directive_value(flag: str, value: str) -> str:
    one_line(flag, value)
    if not _SAFE_DIRECTIVE.fullmatch(value):
        raise SubmitError(f"{flag} {value!r}: whitespace and quotes are not allowed in a SLURM option")
    return value


def job_log_dir(run_dir: Path) -> Path:
    """Where a job's scheduler logs and rendered scripts go: beside the run's checkpoints."""
    return run_dir / "jobs"


def _common_directives(res: Resources, name: str, log_dir: Path, workdir: Path) -> list[str]:
    d = [f"--job-name={job_name(name)}", f"--nodes={res.nodes}"]
    if res.partition:
        d.append(f"--partition={_directive_value('--partition', res.partition)}")
    if res.account:
        d.append(f"--account={_directive_value('--account', res.account)}")
    if res.time:
        d.append(f"--time={res.time}")
    d += [
        f"--output={_directive_value('log dir', str(log_dir))}/%x-%j.out",
        # A requeued job keeps its id: append so the log of the first start survives.
        "--open-mode=append",
        f"--chdir={_directive_value('working dir', str(workdir))}",
    ]
    return d


def _check_lines(values: dict[str, str | Sequence[str]]) -> None:
    """Every value pasted into a script stays on its line (quoting covers the rest)."""
    for key, value in values.items():
        for v in [value] if isinstance(value, str) else value:
            one_line(key, v)


def _exports(env: dict[str, str]) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


# Per-task mapping from SLURM's variables to the ones torch.distributed reads.
_TASK_ENV = (
    'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS '
    'LOCAL_WORLD_SIZE=$PROCS_PER_NODE NODE_RANK=$SLURM_NODEID; exec "$@"'
)
# One torchrun agent per node; it spawns PROCS_PER_NODE workers and sets their ranks.
_AGENT = (
    'exec "$1" -m torch.distributed.run --nnodes="$NNODES" --node_rank="$SLURM_NODEID" '
    '--nproc_per_node="$PROCS_PER_NODE" --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d '
    '--rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" "${@:2}"'
)


def step_command(res: Resources, program: Sequence[str], python: str = sys.executable) -> str:
    """The srun line of the batch script. ``program`` is the per-process argv for the srun
    launcher, or the ``-m module args`` tail for the torchrun launcher."""
    if res.launcher == "srun":
        cpus = f" --cpus-per-task={res.cpus_per_task}" if res.cpus_per_task else ""
        return (
            f"srun --kill-on-bad-exit=1 --ntasks-per-node={res.procs}{cpus} \\\n"
            f"    bash -c {shlex.quote(_TASK_ENV)} bertdist-task \\\n"
            f"    {shlex.join(program)}"
        )
    cpus = f" --cpus-per-task={res.cpus_per_task * res.procs}" if res.cpus_per_task else ""
    return (
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1{cpus} \\\n"
        f"    bash -c {shlex.quote(_AGENT)} bertdist-agent \\\n"
        f"    {shlex.quote(python)} {shlex.join(program)}"
    )


def render_job_script(
    *,
    name: str,
    run_dir: Path,
    config_label: str,
    program: Sequence[str],
    res: Resources,
    python: str = sys.executable,
    workdir: Path | None = None,
    nccl_ifname: str | None = None,
) -> str:
    """A distributed batch script running ``program`` on ``res``, with requeue-on-SIGTERM.
    ``program``: per-process argv (srun launcher) or ``-m module args`` (torchrun launcher)."""
    res.validate()
    _check_lines({"job label": config_label, "run_dir": str(run_dir), "--python": python, "program": program,
                  "--nccl-ifname": nccl_ifname or ""})
    log_dir = job_log_dir(run_dir)
    directives = _common_directives(res, name, log_dir, workdir or Path.cwd())
    per_node = res.procs if res.launcher == "srun" else 1
    directives.insert(2, f"--ntasks-per-node={per_node}")
    if res.cpus_per_task:
        cpus = res.cpus_per_task * (1 if res.launcher == "srun" else res.procs)
        directives.insert(3, f"--cpus-per-task={cpus}")
    if res.gpus_per_node:
        directives.insert(3, f"--gpus-per-node={res.gpus_per_node}")
    directives += ["--requeue", f"--signal=B:TERM@{res.requeue_grace_s}"]
    env = job_environment(res, nccl_ifname=nccl_ifname)
    return render_template(
        "pretrain.sbatch",
        what=config_label,
        directives="\n".join(f"#SBATCH {d}" for d in directives),
        procs_per_node=str(res.procs),
        run_dir=shlex.quote(str(run_dir)),
        log_dir=shlex.quote(str(log_dir)),
        env_exports=_exports(env),
        grace_s=str(res.requeue_grace_s),
        step_command=step_command(res, program, python),
    )


def render_pretrain_script(
    job: TrainingJob,
    res: Resources,
    *,
    python: str = sys.executable,
    workdir: Path | None = None,
    nccl_ifname: str | None = None,
) -> str:
    """The sbatch script that runs ``bertdist pretrain --resume auto <job.config_path> <overrides>``."""
    res.validate()
    job.check_world_size(res.world_size)
    return render_job_script(
        name=job.name,
        run_dir=job.run_dir,
        config_label=f"training config {job.config_path}",
        program=job.command(python, launcher_module=res.launcher == "torchrun"),
        res=res,
        python=python,
        workdir=workdir,
        nccl_ifname=nccl_ifname,
    )


def render_data_script(
    config_path: Path,
    command: Sequence[str],
    *,
    name: str,
    log_dir: Path,
    cpus: int,
    partition: str | None = None,
    account: str | None = None,
    time: str | None = None,
    workdir: Path | None = None,
) -> str:
    """A one-node SLURM job that runs the Beam pipeline with the DirectRunner on ``cpus`` cores."""
    if cpus < 1:
        raise SubmitError(f"--cpus must be >= 1, got {cpus}")
    res = Resources(nodes=1, partition=partition, account=account, time=time).validate()
    _check_lines({"data config": str(config_path), "command": command})
    directives = _common_directives(res, name, log_dir, workdir or Path.cwd())
    directives[2:2] = ["--ntasks=1", f"--cpus-per-task={cpus}"]
    return render_template(
        "data.sbatch",
        config_path=str(config_path),
        directives="\n".join(f"#SBATCH {d}" for d in directives),
        env_exports=_exports({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}),
        command=shlex.join(command),
    )
