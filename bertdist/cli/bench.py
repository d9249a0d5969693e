"""`bertdist bench`: the one-command GPU acceptance (benchmarks/acceptance.py), a quick CPU variant without CUDA.

It runs the side-by-side throughput benchmark against HF, compares kernels: auto with kernels:
reference on whole training steps, and times `bertdist pretrain` itself for every shipped recipe,
most valuable first, against a deadline; the report is rewritten after every run. It exits 1
when anything failed or a target is not met.

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
    argv = ["--out", args.out, "--deadline-s", str(args.deadline_s)]
    for flag, value in (("--configs", args.configs), ("--variants", args.variants), ("--skip", args.skip),
                        ("--steps", args.steps), ("--rounds", args.rounds), ("--recipes", args.recipes),
                        ("--recipe-steps", args.recipe_steps),
                        ("--recipe-overrides", args.recipe_overrides), ("--repeats", args.repeats), ("--kit", args.kit),
                        ("--records", args.records), ("--setup-json", args.setup_json)):
        if value:
            argv += [flag, str(value)]
    if args.quick:
        argv.append("--quick")
    if args.profile:
        argv.append("--profile")
    if args.profile_steps:
        argv += ["--profile-steps", str(args.profile_steps)]
    if args.compile_cache_dir:
        argv += ["--compile-cache-dir", args.compile_cache_dir]
    if args.kernels_budget_s is not None:
        argv += ["--kernels-budget-s", args.kernels_budget_s]
    if args.lengths_from:
        argv += ["--lengths-from", *args.lengths_from]
    # 1 on a failed set-up step or GPU test (pytest's exit 5, nothing collected, included), a failed
    # stage, recipe run or variant, or a target NOT met; the report is written either way.
    return acceptance_module().main(argv)["exit_status"]


def register(sub) -> None:
    p = sub.add_parser("bench", help="GPU acceptance: training throughput against HF, kernels auto vs reference, "
                                     "recipes, tests; one report, rewritten after every run (quick CPU variant "
                                     "without CUDA)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="report folder")
    p.add_argument("--deadline-s", type=float, default=570.0,
                   help="wall-clock deadline (default 570): checked before every run, caps each run's timeout")
    p.add_argument("--quick", action="store_true", help="small sizes on any device (automatic without CUDA)")
    p.add_argument("--kit", help="a GPU kit folder (make gpu-kit): its records, and its versions in the report")
    p.add_argument("--records", help="pre-built records: vocab.txt and records_SEQ/ (default: built with Beam)")
    p.add_argument("--setup-json", help="set-up rows of the kit's node script, listed first in the report")
    p.add_argument("--lengths-from", nargs="+", metavar="MANIFEST", help="records to sample row lengths from")
    p.add_argument("--configs", help="preset:seq:batch,... in measuring order (default on CUDA: "
                                     "large:128:64,large:512:16,base:128:64,base:512:16)")
    p.add_argument("--variants", help="train_throughput variants")
    p.add_argument("--rounds", type=int, help="interleaved rounds of the throughput variants")
    p.add_argument("--steps", type=int, help="timed steps per variant")
    p.add_argument("--recipes", help="recipe files under configs/pretrain to time with bertdist pretrain "
                                     "(default: all)")
    p.add_argument("--recipe-steps", type=int, help="steps of each bertdist pretrain run")
    p.add_argument("--recipe-overrides", help="comma-separated dotted overrides for every recipe run "
                                              "(e.g. model.compile=true)")
    p.add_argument("--repeats", type=int, help="interleaved runs per side of kernels auto vs reference")
    p.add_argument("--profile", action="store_true",
                   help="the last steps of every recipe run under torch.profiler: where each step's time goes")
    p.add_argument("--profile-steps", type=int, help="each throughput variant's next N steps under torch.profiler "
                                                      "(launches, host syncs, device busy, top kernels)")
    p.add_argument("--kernels-budget-s", metavar="SECONDS",
                   help="seconds kernels: auto may spend measuring in each throughput run (or none: no "
                        "limit; default: model.kernels_budget_s's); cases left run torch's kernels, the "
                        "kernel table says which")
    p.add_argument("--compile-cache-dir", help="load and save torch's compile cache of each throughput "
                                               "configuration here (DIR/compile_cache_PRESET_SEQ.bin)")
    p.add_argument("--skip", help="stages to skip: records,throughput,auto_vs_reference,recipes,tests,kernels,"
                                  "decisions")
    p.set_defaults(func=run)
