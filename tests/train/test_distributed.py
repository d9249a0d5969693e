"""Process-group set-up: DeepSpeed's shared-memory workspace on CPU is unlinked once every rank has
mapped it, so a run leaves nothing in /dev/shm, and DeepSpeed's shared-memory all-reduce still
works over the unlinked mappings."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, torchrun

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

# One rank of a two-rank world on one node (LOCAL_SIZE is what DeepSpeed's launcher exports, and
# what makes DeepSpeed map the workspace). "ours": bertdist's init_distributed; "deepspeed":
# DeepSpeed's own init alone, the control.
TWO_RANKS = textwrap.dedent("""
    import json, os, sys
    import torch
    how, out = sys.argv[1], sys.argv[2]
    os.environ["DS_ACCELERATOR"] = "cpu"
    if how == "ours":
        from bertdist.train.distributed import init_distributed
        init_distributed()
    else:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    import deepspeed.comm as ds_dist
    import torch.distributed as dist
    rank = dist.get_rank()
    name = "deepspeed_allreduce_buffer_{}_{}_{}_".format(os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    dist.barrier()
    left = sorted(f for f in os.listdir("/dev/shm") if f.startswith(name))
    t = torch.full((1000,), float(rank + 1))
    ds_dist.inference_all_reduce(t)  # DeepSpeed's shared-memory all-reduce
    dist.barrier()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"left": left, "sum": t.tolist()[:3], "prefix": name}, f)
    dist.destroy_process_group()
""")


def _two_ranks(tmp_path, how: str) -> list[dict]:
    script = tmp_path / "ranks.py"
    script.write_text(TWO_RANKS)
    env = child_env()
    env.update(OMP_NUM_THREADS="1", LOCAL_SIZE="2", DS_ACCELERATOR="cpu")
    out = tmp_path / "result"
    res = subprocess.run([*torchrun(2), str(script), how, str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def _remove(prefix: str) -> None:
    for f in os.listdir("/dev/shm"):
        if f.startswith(prefix):
            os.unlink(os.path.join("/dev/shm", f))


@pytest.mark.slow  # two torchrun launches
def test_two_ranks_leave_no_workspace_and_its_all_reduce_still_works(tmp_path):
    ours = _two_ranks(tmp_path, "ours")
    control = _two_ranks(tmp_path, "deepspeed")
    for run in (ours, control):
        _remove(run[0]["prefix"])
    # DeepSpeed alone leaves one segment per rank behind
    assert [len(r["left"]) for r in control] == [2, 2]
    assert [r["left"] for r in ours] == [[], []]
    for r in ours + control:
        assert r["sum"] == [3.0, 3.0, 3.0]


WORLD_OF_ONE = textwrap.dedent("""
    import json, os, sys
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    from bertdist.train.distributed import single_process_group
    with single_process_group():
        deepspeed.init_distributed(dist_backend="gloo")  # as deepspeed.initialize does inside a group
        name = "deepspeed_allreduce_buffer_{}_{}_{}_0".format(os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
        inside = os.path.exists(os.path.join("/dev/shm", name))
    after = os.path.exists(os.path.join("/dev/shm", name))
    print(json.dumps({"inside": inside, "after": after, "name": name}))
""")


def test_a_world_of_one_unlinks_the_workspace_a_deepspeed_engine_made_inside_it(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(WORLD_OF_ONE)
    env = child_env()
    env.update(OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    _remove(got["name"])
    assert got["inside"] and not got["after"], got
