"""Environment every training process gets, whatever the scheduler: NCCL knobs and threading."""
from __future__ import annotations

from cluster.spec import Resources

# NCCL defaults for multi-node jobs. WARN keeps logs quiet but shows why a
# communicator failed; async error handling turns a dead peer into an error
# instead of a hang that burns the whole allocation.
NCCL_DEFAULTS: dict[str, str] = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # Collective timeout diagnostics: dump the flight recorder on a hang. The dump needs the
    # recorder on (a ring buffer of the last collectives); without a buffer size it records nothing.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # the older name of the same knob, for older torch
}


def job_environment(res: Resources, *, nccl_ifname: str | None = None, ib: bool = True) -> dict[str, str]:
    """Variables exported to every process; ``--env`` entries override the defaults."""
    env = dict(NCCL_DEFAULTS) if res.gpus_per_node else {}
    if res.gpus_per_node:
        if nccl_ifname:
            # Which interface carries NCCL's socket traffic (e.g. ib0, eth0); '^lo' excludes loopback.
            env["NCCL_SOCKET_IFNAME"] = nccl_ifname
        if not ib:
            env["NCCL_IB_DISABLE"] = "1"
    # One OpenMP/MKL thread pool per process, sized to its CPUs, so processes on a
    # node do not oversubscribe the cores.
    env["OMP_NUM_THREADS"] = str(res.cpus_per_task or 1)
    env["PYTHONUNBUFFERED"] = "1"  # logs appear as they happen, not at exit
    env.update(dict(res.extra_env))
    return env
