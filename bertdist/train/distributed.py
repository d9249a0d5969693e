"""Process-group set-up for every launch mode.

- ``deepspeed`` launcher and ``torchrun``: both export RANK / WORLD_SIZE /
  LOCAL_RANK / MASTER_ADDR / MASTER_PORT (env rendezvous); we use them as is.
- SLURM ``srun`` without a launcher: derived from SLURM_PROCID / SLURM_NTASKS /
  SLURM_LOCALID (MASTER_ADDR must be exported by the batch script).
- A plain ``python -m bertdist ...``: a world of one on a free local port.

Without CUDA, DeepSpeed must pick its CPU accelerator (``DS_ACCELERATOR=cpu``)
and the backend is gloo; with CUDA it is NCCL.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
from typing import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


# Set once this process has started a process group. Its backend's worker threads outlive the
# group's destruction, so the program ends through ``bertdist.cli.main.end_program``.
_group_started = False


def group_started() -> bool:
    """Whether this process has started a process group (destroyed or not)."""
    return _group_started


def _group_is_up() -> None:
    """Called where a process group has just started: notes it, and unlinks DeepSpeed's workspace
    when its comm backend started with the group."""
    global _group_started
    _group_started = True
    release_shm_workspace()


# DeepSpeed's CPU accelerator maps a shared-memory all-reduce workspace per rank (about 69 MB in
# /dev/shm, when every rank is on one node) and never unlinks it. Its name, as DeepSpeed builds it:
_SHM_NAME = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"
_SHM_DIR = "/dev/shm"
_shm_released = False


def release_shm_workspace(*, wait_for_ranks: bool = True) -> bool:
    """Unlink this rank's DeepSpeed shared-memory workspace; returns whether one was unlinked.

    Left alone, every run on CPU would leave its ranks' segments in RAM-backed /dev/shm until the
    machine reboots. Unlinked, the mappings stay valid, so DeepSpeed's shared-memory all-reduce
    still works, and the memory is freed when the ranks exit, however they exit. Each rank maps
    the others' segments while its comm backend starts, so with ``wait_for_ranks`` every rank waits
    at a barrier first: call it on every rank. Without it (a world of one, or the end of a program
    whose ranks have since run collectives together) nothing waits."""
    global _shm_released
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    if _shm_released or getattr(backend, "shm_comm_op", None) is None:
        return False  # no DeepSpeed comm backend yet, or its workspace already unlinked
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    if wait_for_ranks and dist.get_world_size() > 1:
        dist.barrier()
    _shm_released = True
    name = _SHM_NAME.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR", ""),
                            port=os.environ.get("MASTER_PORT", ""), rank=dist.get_rank())
    try:
        os.unlink(os.path.join(_SHM_DIR, name))
    except FileNotFoundError:  # not every world maps one (ranks on several nodes)
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment() -> None:
    """Call before importing deepspeed: selects its accelerator and fills launcher variables."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if "RANK" not in env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")


def cuda_device_for(local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK``, or a ConfigError when this node starts more ranks than it has visible GPUs."""
    from bertdist.config import ConfigError

    visible = torch.cuda.device_count()
    if not 0 <= local_rank < visible:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"LOCAL_RANK {local_rank} but this node has {visible} visible CUDA device(s)"
            f"{f' (CUDA_VISIBLE_DEVICES={mask})' if mask is not None else ''}: start one process per GPU, "
            f"at most {visible} here (torchrun --nproc_per_node {visible}, deepspeed --num_gpus {visible}, "
            f"srun --ntasks-per-node {visible})")
    return torch.device("cuda", local_rank)


def init_distributed(backend: str | None = None) -> DistInfo:
    prepare_environment()
    import deepspeed
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = cuda_device_for(local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        _group_is_up()
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")


@contextlib.contextmanager
def single_process_group(backend: str = "gloo") -> Iterator[bool]:
    """A one-process group (gloo; nccl for a benchmark that times CUDA collectives as a run makes
    them) for DeepSpeed work inside a larger program (``import-hf``, tests, benchmarks), torn down
    afterwards with its rendezvous variables (children inherit the environment). Inside an existing
    group it does nothing; yields whether it made one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield False
        return
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    dist.init_process_group(backend, rank=0, world_size=1)
    _group_is_up()
    try:
        yield True
    finally:
        release_shm_workspace(wait_for_ranks=False)  # a DeepSpeed engine built inside made one
        from deepspeed.utils import groups

        # DeepSpeed caches a clone of the world group; once destroyed, a later engine in this process
        # would be handed the stale clone ("Group ... is not registered").
        groups._WORLD_GROUP = None
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---------------------------------------------------------------- rank and device outside pretraining
def process_group():
    """``torch.distributed`` when a process group is up (torchrun + DeepSpeed, or gloo), else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world(launcher_env: bool = False) -> tuple[int, int]:
    """This process's rank and the world size: the process group's. Without a group, ``(0, 1)``,
    or with ``launcher_env`` the launcher's RANK and WORLD_SIZE: ranks of a sharded job that work
    on their own shards without talking to each other."""
    group = process_group()
    if group:
        return group.get_rank(), group.get_world_size()
    if launcher_env:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return 0, 1


def start_process_group(deepspeed: bool = False) -> bool:
    """Start the process group of a launch (``prepare_environment``; NCCL on GPUs, gloo on CPU),
    through DeepSpeed when the run makes DeepSpeed engines; nothing inside an existing group.
    Returns whether this call started one."""
    if process_group():
        return False
    prepare_environment()  # a launcher's variables, or a world of one on a free port
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend=backend)
    else:
        torch.distributed.init_process_group(backend)
    _group_is_up()
    return True


def local_device(setting: str = "auto") -> torch.device:
    """``setting`` as a device; ``auto``: this rank's GPU (``cuda:LOCAL_RANK``) when there is one, else the CPU."""
    if setting != "auto":
        return torch.device(setting)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
