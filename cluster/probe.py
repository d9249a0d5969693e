"""A launch probe: every process joins the process group and checks one all-reduce.

``bertdist submit probe`` runs this through exactly the launch path a training job
uses (SLURM script, DeepSpeed launcher, torchrun), so a cluster's rendezvous,
ranks and network can be checked in seconds before a long run is queued.
Each rank writes ``rank-<RANK>.json`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.probe")
    p.add_argument("--out", required=True, help="directory for one rank-<RANK>.json per process")
    p.add_argument("--timeout", type=float, default=120.0, help="rendezvous timeout, seconds")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        from bertdist.train.distributed import cuda_device_for  # a clear error for more ranks than GPUs

        torch.cuda.set_device(cuda_device_for(int(os.environ.get("LOCAL_RANK", "0"))))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    record = {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "node_rank": int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "-1"))),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
        "backend": backend,
        "all_reduce": t.item(),
        "expected": expected,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("NCCL_", "TORCH_NCCL_", "OMP_NUM_THREADS"))},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(record, indent=1))
    print(f"[probe] rank {rank}/{world} local {record['local_rank']} on {record['hostname']}: "
          f"all_reduce {t.item():g} (expected {expected:g})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if t.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
