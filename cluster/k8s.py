"""Kubernetes: a Kubeflow PyTorchJob manifest (Master + Workers) for a training config.

Pods see the same paths as the submitting machine, as on a SLURM cluster with a
shared filesystem: the work directory (code + configs), the data and the run
directory are PersistentVolumeClaims mounted at those paths. The config must lie
on one of them, so the pods read the very file that was submitted.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bertdist.redaction import is_secret_name
from cluster.errors import SubmitError
from cluster.launch import job_environment
from cluster.safe_values import one_line
from cluster.spec import Resources
from cluster.training import TrainingJob

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "pytorchjob.v1.json"
_NAME_RE = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True)
class K8sOptions:
    image: str
    namespace: str | None = None
    workdir_pvc: str = "bertdist-workdir"
    data_pvc: str = "bertdist-data"
    run_pvc: str = "bertdist-runs"
    shm_size: str = "16Gi"
    backoff_limit: int = 3
    python: str = "python"  # the interpreter inside the image
    env_secrets: tuple[tuple[str, str, str], ...] = ()  # (variable, Secret name, key): spec.parse_env_secrets


def dns_name(name: str) -> str:
    """A DNS-1123 label from a job name (PyTorchJob names become pod and service names)."""
    out = _NAME_RE.sub("-", name.lower()).strip("-")[:50].strip("-")
    if not out:
        raise SubmitError(f"job name {name!r} has no letters or digits to build a Kubernetes name from")
    return out


def _common_parent(paths: Sequence[Path]) -> Path:
    import os

    return Path(os.path.commonpath([str(p if p.is_dir() else p.parent) for p in paths]))


def _under(p: Path, root: Path) -> bool:
    try:
        p.relative_to(root)
        return True
    except ValueError:
        return False


def env_entries(env: dict[str, str], secrets: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """The container's env: plain values, then values read from Secrets (secretKeyRef). A plain value
    whose name looks like a secret's is refused: the manifest is a file, and kubectl shows it."""
    for k in env:
        if is_secret_name(k):
            raise SubmitError(
                f"--env {k}=...: a variable whose name contains key/secret/token/password/credential is not "
                f"written into the manifest in plain text; put the value in a Kubernetes Secret and pass "
                f"--env-secret {k}=SECRET_NAME/KEY instead")
    clash = sorted(set(env) & {k for k, _, _ in secrets})
    if clash:
        raise SubmitError(f"--env and --env-secret both set {clash}: give each variable once")
    return [*({"name": k, "value": v} for k, v in env.items()),
            *({"name": k, "valueFrom": {"secretKeyRef": {"name": s, "key": key}}} for k, s, key in secrets)]


def _check_options(opts: K8sOptions, paths: Sequence[Path]) -> None:
    for key, value in (("--image", opts.image), ("--namespace", opts.namespace or ""),
                       ("--workdir-pvc", opts.workdir_pvc), ("--data-pvc", opts.data_pvc),
                       ("--run-pvc", opts.run_pvc), ("--shm-size", opts.shm_size), ("--python", opts.python),
                       *(("path", str(p)) for p in paths)):
        one_line(key, value)


def render_pytorchjob(job: TrainingJob, res: Resources, opts: K8sOptions, *, workdir: Path | None = None) -> dict[str, Any]:
    res.validate()
    job.check_world_size(res.world_size)
    if not opts.image:
        raise SubmitError("--image is required for --scheduler k8s (the container image with bertdist installed)")
    wd = (workdir or Path.cwd()).resolve()
    _check_options(opts, [wd, job.config_path, job.run_dir, *job.data_paths])
    mounts = [("workdir", opts.workdir_pvc, wd, True)]
    if job.data_paths:
        mounts.append(("data", opts.data_pvc, _common_parent(job.data_paths), True))
    mounts.append(("runs", opts.run_pvc, job.run_dir, False))
    if not any(_under(job.config_path, m[2]) for m in mounts):
        raise SubmitError(
            f"config {job.config_path} is on none of the volumes the pods mount "
            f"({', '.join(str(m[2]) for m in mounts)}): put it under the work directory {wd}"
        )
    env = job_environment(res)
    command = [opts.python, "-m", "torch.distributed.run",
               # nnodes, node_rank, master addr/port come from the PET_* variables the operator sets.
               f"--nproc_per_node={res.procs}",
               *job.command(launcher_module=True)]
    resources: dict[str, Any] = {}
    if res.gpus_per_node:
        resources["limits"] = {"nvidia.com/gpu": res.gpus_per_node}
    if res.cpus_per_task:
        resources.setdefault("requests", {})["cpu"] = res.cpus_per_task * res.procs
    volume_mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        # DataLoader workers and NCCL pass tensors through /dev/shm; the container default is 64 MiB.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
    ]
    for name, claim, path, ro in mounts:
        volume_mounts.append({"name": name, "mountPath": str(path), **({"readOnly": True} if ro else {})})
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, **({"readOnly": True} if ro else {})}})
    container = {
        "name": "pytorch",  # the operator injects the rendezvous variables into this container only
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": str(wd),
        "command": command,
        "env": env_entries(env, opts.env_secrets),
        "volumeMounts": volume_mounts,
    }
    if resources:
        container["resources"] = resources
    pod_spec = {
        "containers": [container],
        "volumes": volumes,
        # SIGTERM on eviction/preemption: time for the trainer to write its checkpoint.
        "terminationGracePeriodSeconds": res.requeue_grace_s,
    }

    def replica(n: int) -> dict[str, Any]:
        # OnFailure: a crashed or preempted pod restarts in place and resumes (--resume auto).
        return {"replicas": n, "restartPolicy": "OnFailure", "template": {"spec": copy.deepcopy(pod_spec)}}

    specs = {"Master": replica(1)}
    if res.nodes > 1:
        specs["Worker"] = replica(res.nodes - 1)
    metadata: dict[str, Any] = {"name": dns_name(job.name), "labels": {"app.kubernetes.io/name": "bertdist"}}
    if opts.namespace:
        metadata["namespace"] = opts.namespace
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": opts.backoff_limit},
            "nprocPerNode": str(res.procs),
            "pytorchReplicaSpecs": specs,
        },
    }


def validate_pytorchjob(manifest: dict[str, Any]) -> None:
    """Check a manifest against schemas/pytorchjob.v1.json; raises SubmitError listing every violation."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        raise SubmitError("PyTorchJob manifest does not match the schema:\n" + "\n".join(lines))


def to_yaml(manifest: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(manifest, sort_keys=False, width=1000)
