"""Put a rendered job on its scheduler: SLURM (sbatch), a DeepSpeed hostfile launch (pdsh or ssh),
Kubernetes (kubectl) or this machine. ``LaunchRequest`` is everything a launch needs, whoever
builds it (``bertdist submit`` parses it from the command line); ``launch`` renders the job and,
unless ``dry_run``, starts it. What is printed goes through ``say``.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bertdist.redaction import hide_secret_values
from cluster import deepspeed_launch, k8s, local, slurm
from cluster.errors import SubmitError
from cluster.private_files import SCRIPT_MODE, write_file
from cluster.safe_values import job_name
from cluster.spec import Resources
from cluster.training import TrainingJob

SCHEDULERS = ("slurm", "deepspeed", "k8s", "local")


def print_text(text: str) -> None:
    """Write ``text`` to stdout as is, ending it with a newline if it has none."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class DeepSpeedHosts:
    hosts: str  # comma-separated node names, the first is the master
    launcher: str = "pdsh"  # or "ssh": one command per node
    master_port: int = 29500


@dataclass(frozen=True)
class LaunchRequest:
    scheduler: str
    name: str
    run_dir: Path  # job logs go to slurm.job_log_dir(run_dir)
    label: str  # what runs, for the job record and script header
    program_argv: list[str]  # [python, -m, module, *args]: srun starts it per rank
    program_module: list[str]  # [-m, module, *args]: what torchrun / deepspeed / local start
    resources: Resources
    python: str
    nccl_ifname: str | None = None
    job: TrainingJob | None = None  # a training run (checked against the world size; k8s needs it)
    deepspeed: DeepSpeedHosts | None = None
    k8s: k8s.K8sOptions | None = None
    dry_run: bool = False
    say: Callable[[str], None] = field(default=print_text, compare=False)


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def submit_slurm_script(script: str, *, name: str, log_dir: Path, record: dict,
                        say: Callable[[str], None] = print_text) -> str:
    """Write the script beside the logs, sbatch it, and record the submission; returns the job id."""
    from cluster import slurm_client

    path = write_file(log_dir / f"{job_name(name)}-{_stamp()}.sbatch", script, SCRIPT_MODE)
    job_id = slurm_client.sbatch(path)
    info = {**record, "job_id": job_id, "script": str(path),
            "log": str(log_dir / f"{name}-{job_id}.out"), "submitted": _stamp()}
    write_file(log_dir / f"{job_id}.json", json.dumps(info, indent=1) + "\n")
    say(f"submitted SLURM job {job_id}\n  script: {path}\n  log:    {info['log']}\n"
        f"  follow: bertdist jobs logs {job_id} --follow")
    return job_id


def _launch_slurm(req: LaunchRequest, log_dir: Path) -> int:
    res = req.resources
    program = req.program_module if res.launcher == "torchrun" else req.program_argv
    script = slurm.render_job_script(name=req.name, run_dir=req.run_dir, config_label=req.label, program=program,
                                     res=res, python=req.python, nccl_ifname=req.nccl_ifname)
    if req.dry_run:
        req.say(hide_secret_values(script))
        return 0
    submit_slurm_script(script, name=req.name, log_dir=log_dir, say=req.say,
                        record={"scheduler": "slurm", "run_dir": str(req.run_dir), "what": req.label})
    return 0


def _launch_deepspeed(req: LaunchRequest, log_dir: Path) -> int:
    if req.deepspeed is None or not req.deepspeed.hosts:
        raise SubmitError("--scheduler deepspeed needs --hosts node1,node2,... (the first is the master)")
    hosts = deepspeed_launch.parse_hosts(req.deepspeed.hosts)
    hostfile, envfile = log_dir / f"{req.name}.hostfile", log_dir / f"{req.name}.deepspeed_env"
    launch = deepspeed_launch.deepspeed_launch(
        req.program_module, req.resources, hosts, hostfile_path=hostfile, env_file_path=envfile,
        launcher=req.deepspeed.launcher, master_port=req.deepspeed.master_port,
        deepspeed_bin=str(Path(req.python).with_name("deepspeed")), nccl_ifname=req.nccl_ifname)
    if req.dry_run:
        req.say(f"# {hostfile}\n{launch.hostfile}# {envfile}\n{hide_secret_values(launch.env_file)}# commands")
        req.say("\n".join(launch.shell_lines()))
        return 0
    write_file(hostfile, launch.hostfile)
    write_file(envfile, launch.env_file)
    procs = [subprocess.Popen(argv) for _, argv in launch.commands]
    return max(p.wait() for p in procs)


def _launch_k8s(req: LaunchRequest, log_dir: Path) -> int:
    if req.job is None:
        raise SubmitError("--scheduler k8s renders training jobs only")
    manifest = k8s.render_pytorchjob(req.job, req.resources, req.k8s or k8s.K8sOptions(image=""))
    k8s.validate_pytorchjob(manifest)
    text = k8s.to_yaml(manifest)
    if req.dry_run:
        req.say(text)
        return 0
    path = write_file(log_dir / f"{req.name}.pytorchjob.yaml", text)
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise SubmitError(f"kubectl not found on PATH; the manifest is at {path} (kubectl create -f {path})")
    proc = subprocess.run([kubectl, "create", "-f", str(path)], capture_output=True, text=True)
    if proc.returncode:
        raise SubmitError(f"kubectl rejected the PyTorchJob: {proc.stderr.strip() or proc.stdout.strip()}")
    req.say(proc.stdout.strip())
    return 0


def _launch_local(req: LaunchRequest, log_dir: Path) -> int:
    argv = local.local_command(req.program_module, req.resources, python=req.python)
    if req.dry_run:
        req.say(shlex.join(argv))
        return 0
    return local.run_local(argv, req.resources)


_BACKENDS = {"slurm": _launch_slurm, "deepspeed": _launch_deepspeed, "k8s": _launch_k8s, "local": _launch_local}


def launch(req: LaunchRequest) -> int:
    """Render ``req`` for its scheduler and, unless ``dry_run``, submit or run it; returns an exit code."""
    if req.scheduler not in _BACKENDS:
        raise SubmitError(f"unknown scheduler {req.scheduler!r}; choose one of {list(SCHEDULERS)}")
    job_name(req.name)
    if req.scheduler != "k8s" and req.k8s is not None and req.k8s.env_secrets:
        raise SubmitError("--env-secret reads a Kubernetes Secret: it works with --scheduler k8s only")
    if req.job is not None:
        req.job.check_world_size(req.resources.world_size)
    return _BACKENDS[req.scheduler](req, slurm.job_log_dir(req.run_dir))
