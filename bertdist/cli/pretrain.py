"""`bertdist pretrain <config.yaml> [--resume auto|PATH] [key=value ...]`: one pretraining phase.

`bertdist pretrain <config.yaml> --plan [--world-size N] [--device-profile h100|a100|cpu] [--json]`
prints what the run would do (bertdist/train/launch_plan.py) and starts nothing.

Launch it once per process: directly for one process, or under `deepspeed`, `torchrun`
or `srun` for many (see bertdist/train/distributed.py), e.g.

    torchrun --nproc_per_node 2 -m bertdist.cli.main pretrain configs/pretrain/tiny.yaml
"""
from __future__ import annotations

import sys

from bertdist.cli.export import add_trust_flag


def run(args) -> int:
    from bertdist.train import load_train_config

    overrides = list(args.overrides)
    # The deepspeed launcher appends --local_rank=N; the environment already has LOCAL_RANK.
    overrides = [o for o in overrides if not o.startswith("--local_rank")]
    cfg = load_train_config(args.config, overrides)
    if args.plan:
        return print_plan(cfg, args)
    from bertdist.data import RecordsError
    from bertdist.export.safe_load import UnsafeCheckpointError, trust_checkpoints
    from bertdist.train.trainer import NonFiniteLossError, run_pretraining

    try:
        with trust_checkpoints(args.trust_checkpoint):
            result = run_pretraining(cfg, resume=args.resume, overwrite=args.overwrite)
    except UnsafeCheckpointError as e:
        print(f"bertdist pretrain: {e}", file=sys.stderr)
        return 2
    except RecordsError as e:
        print(f"bertdist: data error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"bertdist: training aborted: {e}", file=sys.stderr)
        return 3
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 0:
        print(f"bertdist pretrain: stopped ({result.stopped_by}) at step {result.step}; "
              f"last checkpoint: {result.last_checkpoint}; run dir: {result.run_dir}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def print_plan(cfg, args) -> int:
    import contextlib
    import json
    import os

    from bertdist.config import ConfigError
    from bertdist.device_profile import by_name, detect
    from bertdist.train.launch_plan import format_launch_plan, launch_plan

    try:
        profile = by_name(args.device_profile) if args.device_profile else detect()
    except ValueError as e:
        raise ConfigError(f"--device-profile: {e}") from None
    world = args.world_size if args.world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    # DeepSpeed logs to stdout when imported (its accelerator choice); stdout carries only the plan.
    with contextlib.redirect_stdout(sys.stderr):
        plan = launch_plan(cfg, world, profile)
    print(json.dumps(plan, indent=2) if args.json else format_launch_plan(plan))
    return 0


def register(sub) -> None:
    p = sub.add_parser("pretrain", help="BERT pretraining with DeepSpeed (one phase)")
    p.add_argument("config", help="recipe YAML, e.g. configs/pretrain/bert-base-phase1.yaml")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="'auto': continue from the run's latest checkpoint if there is one; or a checkpoint path")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a run_dir that holds an earlier run's checkpoints (they are replaced); "
                        "without it such a start is refused")
    p.add_argument("--local_rank", type=int, default=None, help=argparse_suppress())
    add_trust_flag(p)
    p.add_argument("--plan", action="store_true",
                   help="print the resolved config, batch arithmetic, DeepSpeed JSON, optimizer, precision, kernel "
                        "cases and a memory estimate per GPU, and exit without training")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="with --plan: the number of ranks to plan for (default: $WORLD_SIZE or 1)")
    p.add_argument("--device-profile", default=None, metavar="h100|a100|cpu",
                   help="with --plan: plan for this device (bertdist/device_profile.py) instead of this machine's")
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. data.micro_batch_size=16")
    p.set_defaults(func=run)


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m bertdist.cli.pretrain``), the form launchers run per rank."""
    import argparse

    from bertdist.config import ConfigError

    parser = argparse.ArgumentParser(prog="bertdist pretrain")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["pretrain", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except ConfigError as e:
        print(f"bertdist: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from bertdist.cli.main import end_program

    end_program(main())
