"""How a program that started a process group ends: ``end_program`` skips the interpreter's
finalization, where a native thread re-entering Python aborts the process after its work is done.

A thread looping over a torch op stands in for the backend's worker threads: each op releases the
GIL and takes it back, as a gloo worker does when it drops a finished collective's tensors."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, child_env

PROGRAM = textwrap.dedent("""
    import atexit, sys, threading
    import torch
    from bertdist.cli.main import end_program
    from bertdist.train.distributed import start_process_group

    marker = sys.argv[2]
    atexit.register(lambda: open(marker, "w").write("atexit ran"))
    assert start_process_group()
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    a = torch.randn(200, 200)

    def native_work():
        while True:
            a @ a  # the GIL is released around the op and taken back after it

    threading.Thread(target=native_work, daemon=True).start()
    sys.stdout.write("unflushed tail")  # no newline: still in the buffer at exit
    if sys.argv[1] == "end_program":
        end_program(3)
    sys.exit(3)
""")


def _run(tmp_path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = child_env()
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, str(script), how, str(tmp_path / "marker")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_a_program_with_a_process_group_ends_with_its_code_its_output_and_its_atexit_handlers(tmp_path):
    res = _run(tmp_path, "end_program")
    assert res.returncode == 3, res.stderr[-3000:]
    assert "terminate called" not in res.stderr
    assert res.stdout.endswith("unflushed tail")
    assert (tmp_path / "marker").read_text() == "atexit ran"


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 hangs such threads at finalization instead of ending them")
def test_the_same_program_ended_by_sys_exit_aborts_in_finalization(tmp_path):
    """The control: without ``end_program`` the finished program dies of SIGABRT."""
    res = _run(tmp_path, "sys_exit")
    assert res.returncode == -signal.SIGABRT, (res.returncode, res.stderr[-3000:])
    assert "terminate called without an active exception" in res.stderr


def test_without_a_process_group_the_program_exits_normally(monkeypatch):
    from bertdist.cli.main import end_program
    from bertdist.train import distributed

    monkeypatch.setattr(distributed, "_group_started", False)
    with pytest.raises(SystemExit) as e:
        end_program(5)
    assert e.value.code == 5


def test_a_world_of_one_torn_down_is_still_noted(monkeypatch):
    """``single_process_group`` (world of one, torn down) also leaves the backend's threads."""
    from bertdist.train import distributed

    monkeypatch.setattr(distributed, "_group_started", False)
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this worker")
    with distributed.single_process_group() as made:
        assert made
    assert distributed.group_started()
