"""The resources a job asks for, independent of the scheduler, and their consistency checks."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from cluster.errors import SubmitError
from cluster.safe_values import env_name, one_line

LAUNCHERS = ("srun", "torchrun")
_TIME_RE = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}|\d+-\d+")


@dataclass(frozen=True)
class Resources:
    """What to ask the scheduler for.

    ``procs_per_node`` is the number of training processes per node: one per GPU
    on GPU nodes, any number on CPU nodes (CPU tests use 2). ``launcher``:
    ``srun`` starts every process itself (one SLURM task per process);
    ``torchrun`` starts one torchrun agent per node that spawns the processes
    and does a c10d rendezvous (needed where the site forbids many tasks per node).
    """

    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int = 0  # 0: derive (= gpus_per_node, or 1 without GPUs)
    cpus_per_task: int = 0  # 0: let the scheduler decide
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    launcher: str = "srun"
    requeue_grace_s: int = 120  # SIGTERM this long before the time limit, to checkpoint
    extra_env: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def procs(self) -> int:
        if self.procs_per_node:
            return self.procs_per_node
        return self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs

    def validate(self) -> "Resources":
        if self.nodes < 1:
            raise SubmitError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise SubmitError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.procs_per_node < 0:
            raise SubmitError(f"--procs-per-node must be >= 0, got {self.procs_per_node}")
        if self.gpus_per_node and self.procs_per_node and self.procs_per_node != self.gpus_per_node:
            raise SubmitError(
                f"--procs-per-node {self.procs_per_node} != --gpus-per-node {self.gpus_per_node}: "
                "training runs one process per GPU; drop --procs-per-node on GPU nodes"
            )
        if self.launcher not in LAUNCHERS:
            raise SubmitError(f"--launcher must be one of {list(LAUNCHERS)}, got {self.launcher!r}")
        if self.time is not None and not _TIME_RE.fullmatch(self.time):
            raise SubmitError(
                f"--time {self.time!r} is not a SLURM time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS])"
            )
        if self.requeue_grace_s < 0:
            raise SubmitError(f"--grace must be >= 0 seconds, got {self.requeue_grace_s}")
        for k, _ in self.extra_env:
            env_name(k)
        for key, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None:
                one_line(key, value)
        return self


def gpus_per_node_from_total(total_gpus: int, nodes: int) -> int:
    """``--gpus TOTAL`` spread over ``--nodes``: must divide evenly (no ragged nodes)."""
    if total_gpus < 1:
        raise SubmitError(f"--gpus must be >= 1, got {total_gpus}")
    if nodes < 1:
        raise SubmitError(f"--nodes must be >= 1, got {nodes}")
    if total_gpus % nodes:
        raise SubmitError(
            f"--gpus {total_gpus} does not divide over --nodes {nodes} "
            f"({total_gpus}/{nodes} = {total_gpus / nodes:g} GPUs per node); every node must run the "
            f"same number of processes: use a multiple of {nodes}, or --gpus-per-node"
        )
    return total_gpus // nodes


def parse_env(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items or ():
        if "=" not in item:
            raise SubmitError(f"--env {item!r} is not of the form NAME=value")
        k, v = item.split("=", 1)
        out.append((env_name(k), v))
    return tuple(out)


# A Kubernetes Secret's name (DNS-1123 subdomain) and a key in it.
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def parse_env_secrets(items: list[str] | None) -> tuple[tuple[str, str, str], ...]:
    """``NAME=SECRET/KEY`` items: (variable, Secret name, key in the Secret)."""
    out = []
    for item in items or ():
        k, _, ref = item.partition("=")
        secret, _, key = ref.partition("/")
        if not (_SECRET_NAME.fullmatch(secret) and _SECRET_KEY.fullmatch(key)):
            raise SubmitError(f"--env-secret {item!r} is not of the form NAME=SECRET/KEY "
                              "(a Kubernetes Secret's name and a key in it, e.g. HF_TOKEN=hf-token/token)")
        out.append((env_name(k, "--env-secret"), secret, key))
    return tuple(out)
