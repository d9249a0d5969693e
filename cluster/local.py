"""The same launch on this machine: one process, or torchrun --standalone for several."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Sequence

from cluster.errors import SubmitError
from cluster.launch import job_environment
from cluster.spec import Resources


def local_command(program: Sequence[str], res: Resources, python: str = sys.executable) -> list[str]:
    """``program`` is ``["-m", module, *args]``."""
    res.validate()
    if res.nodes != 1:
        raise SubmitError(f"--scheduler local runs on this machine only: --nodes must be 1, got {res.nodes}")
    if res.procs == 1:
        return [python, *program]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={res.procs}", *program]


def run_local(argv: Sequence[str], res: Resources) -> int:
    """Run in the foreground; SIGTERM/SIGINT are passed on so the trainer can checkpoint."""
    env = {**os.environ, **job_environment(res)}
    proc = subprocess.Popen(list(argv), env=env)

    def forward(signum, _frame):
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
