"""`bertdist bench`: the one-command GPU acceptance (benchmarks/acceptance.py), a quick CPU variant without CUDA.

It times `bertdist pretrain` itself for every shipped recipe, compares kernels: auto with
kernels: reference on whole training steps, and runs the side-by-side throughput benchmark; it
exits 1 when anything failed or a target is not met.

It runs from a source checkout: the acceptance uses the repository's tests/ and benchmarks/,
which an installed wheel does not carry."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The checkout this package runs from (bertdist.ops._build_config.REPO), found without importing
# bertdist.ops: registering this command must not load torch for every other command.
REPO = Path(__file__).resolve().parents[2]


def acceptance_module():
    path = REPO / "benchmarks" / "acceptance.py"
    if not path.is_file() or not (REPO / "tests").is_dir():
        raise SystemExit(f"bertdist bench runs from a source checkout (it needs benchmarks/ and tests/ beside the "
                         f"package, looked in {REPO}); clone the repository and run it there")
    spec = importlib.util.spec_from_file_location("bertdist_acceptance", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run(args) -> int:
    argv = ["--out", args.out, "--budget-s", str(args.budget_s)]
    for flag, value in (("--configs", args.configs), ("--variants", args.variants), ("--skip", args.skip),
                        ("--steps", args.steps), ("--recipes", args.recipes), ("--recipe-steps", args.recipe_steps),
                        ("--repeats", args.repeats)):
        if value:
            argv += [flag, str(value)]
    if args.quick:
        argv.append("--quick")
    if args.lengths_from:
        argv += ["--lengths-from", *args.lengths_from]
    # 1 on a failed GPU test (pytest's exit 5, nothing collected, included), a failed stage, recipe
    # run or variant, or a target NOT met; the report is written either way.
    return acceptance_module().main(argv)["exit_status"]


def register(sub) -> None:
    p = sub.add_parser("bench", help="GPU acceptance: tests, kernel and training benchmarks, one report "
                                     "(quick CPU variant without CUDA)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="report folder")
    p.add_argument("--quick", action="store_true", help="small sizes on any device (automatic without CUDA)")
    p.add_argument("--lengths-from", nargs="+", metavar="MANIFEST", help="records to sample row lengths from")
    p.add_argument("--configs", help="preset:seq:batch,... (default: base/large x 128/512 on CUDA)")
    p.add_argument("--variants", help="train_throughput variants")
    p.add_argument("--steps", type=int, help="timed steps per variant")
    p.add_argument("--recipes", help="recipe files under configs/pretrain to time with bertdist pretrain "
                                     "(default: all)")
    p.add_argument("--recipe-steps", type=int, help="steps of each bertdist pretrain run")
    p.add_argument("--repeats", type=int, help="interleaved runs per side of kernels auto vs reference")
    p.add_argument("--skip", help="stages to skip: tests,kernels,decisions,recipes,auto_vs_reference,throughput")
    p.add_argument("--budget-s", type=float, default=570.0, help="time budget in seconds (default 570)")
    p.set_defaults(func=run)
