"""Multi-node launch on one machine: the DeepSpeed per-node commands (`--ds-launcher ssh`) for two
"nodes" at 127.0.0.1 and 127.0.0.2 (both loopback), each started here without the ssh hop.
Two independent `deepspeed --no_ssh --node_rank=i` agents rendezvous over loopback and their
processes all-reduce once (cluster.probe), so the multi-node code path runs for real."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import deepspeed_launch
from cluster.private_files import write_file
from cluster.spec import Resources
from tests.conftest import free_port


def _kill_group(proc: subprocess.Popen) -> None:
    """The agent and every process it started (a timed-out run must not outlive the test)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.slow
def test_two_deepspeed_agents_rendezvous_over_loopback(tmp_path):
    out = tmp_path / "probe"
    hosts = ["127.0.0.1", "127.0.0.2"]
    port = free_port()
    hostfile, envfile = tmp_path / "hostfile", tmp_path / "ds_env"
    # a variable the probe records (NCCL_*; gloo ignores it), with a value that needs quoting
    canary = ("NCCL_BERTDIST_CANARY", "s3cr3t canary 'q' $(false)")
    launch = deepspeed_launch.deepspeed_launch(
        ["-m", "cluster.probe", "--out", str(out), "--timeout", "120"],
        Resources(nodes=2, procs_per_node=1, extra_env=(canary,)),
        hosts, hostfile_path=hostfile, env_file_path=envfile, launcher="ssh", master_port=port,
        deepspeed_bin=str(Path(sys.executable).with_name("deepspeed")), workdir=tmp_path)
    hostfile.write_text(launch.hostfile)
    write_file(envfile, launch.env_file)  # as `bertdist submit` does: 0600, in the job folder
    agents = []
    for host, argv in launch.commands:
        assert argv[:4] == ["ssh", "-o", "BatchMode=yes", host]
        assert "s3cr3t" not in argv[4] and "OMP_NUM_THREADS" not in argv[4], argv[4]  # no value for `ps`
        # what ssh would run on `host`: run it here
        agents.append(subprocess.Popen(["bash", "-c", argv[4]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
    logs = []
    for a in agents:
        try:
            logs.append(a.communicate(timeout=240)[0])
        finally:
            _kill_group(a)
    assert all(a.returncode == 0 for a in agents), "\n".join(logs)[-3000:]
    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["all_reduce"] == 3.0 and r["local_rank"] == 0 for r in ranks)
    assert all(r["master"] == f"127.0.0.1:{port}" for r in ranks)
    assert "[probe] rank 1/2" in "\n".join(logs)
    # the per-node command exported the job environment (sourced from the env file) on each node
    assert all(r["env"].get("OMP_NUM_THREADS") == "1" for r in ranks)
    assert all(r["env"].get(canary[0]) == canary[1] for r in ranks)
    node1 = shlex.split(launch.commands[1][1][4])
    assert "--no_ssh" in node1 and "--node_rank=1" in node1
