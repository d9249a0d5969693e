"""The Beam worker pool runs whatever a job stages and has no authentication: it listens on
127.0.0.1 unless asked otherwise, and a worker id cannot point its folder's deletion elsewhere."""
from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from cluster import beam_portable

BOOT = Path(beam_portable.__file__).with_name("beam_worker_boot.py")


def _fake_worker_env(root: Path) -> Path:
    """A worker environment that is this interpreter (which has apache_beam) plus the installed scripts."""
    env = root / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o700)
    beam_portable.install_scripts(env, sys.executable)
    return env


def _listening(pid: int, port: int) -> set[str]:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    return {c.laddr.ip for p in procs for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def test_worker_pool_listens_on_loopback_only_by_default(tmp_path):
    env = _fake_worker_env(tmp_path)
    with beam_portable.LocalPortableRunner(tmp_path / "services", env) as runner:
        ips = _listening(runner.pool_pid, runner.pool_port)
        assert ips and all(_loopback(ip) for ip in ips), f"worker pool listens on {ips}"
        assert f"--environment_config=localhost:{runner.pool_port}" in runner.pipeline_args(Path("w.whl"))


def test_up_help_says_what_the_pool_exposes(capsys):
    with pytest.raises(SystemExit):
        beam_portable.main(["up", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--host ADDR" in out and "--bind-all" in out and "default 127.0.0.1" in out
    assert "no authentication" in out


@pytest.mark.parametrize("worker_id", ["x/../../victim", "../victim", "a b", "a\n", ""])
def test_boot_refuses_a_worker_id_that_is_not_a_plain_name(tmp_path, worker_id):
    pool = tmp_path / "pool"
    (pool / "worker-x").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    proc = subprocess.run(
        [sys.executable, str(BOOT), f"--id={worker_id}", *(f"--{e}=127.0.0.1:1" for e in (
            "logging_endpoint", "artifact_endpoint", "provision_endpoint", "control_endpoint"))],
        env={**os.environ, "BERTDIST_BEAM_WORKER_DIR": str(pool)}, capture_output=True, text=True, timeout=120)
    assert (victim / "keep.txt").exists(), "the boot deleted a folder outside the pool's"
    assert proc.returncode != 0 and f"--id {worker_id!r} refused" in proc.stderr, proc.stderr[-2000:]


def test_pool_refuses_a_bad_worker_id():
    from apache_beam.portability.api import beam_fn_api_pb2

    from cluster.beam_worker_pool import _servicer_class

    pool = _servicer_class()(use_process=True, container_executable="/bin/false")
    reply = pool.StartWorker(beam_fn_api_pb2.StartWorkerRequest(worker_id="../x"), None)
    assert "worker id '../x' refused" in reply.error and not pool._worker_processes
