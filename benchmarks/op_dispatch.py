"""Host time per call of the fused layer-norm ops on CPU, for two checkouts side by side.

What a call costs beyond its kernel: the public function, the dispatcher, and autograd (the
forward's node, the backward's call). At a tiny shape (8 x 768 fp32) that is nearly all of it;
at a BERT-base micro-batch (32 x 128 tokens x 768) the kernel dominates. Each checkout is timed
in its own interpreter (a checkout's ``bertdist`` package with its own prebuilt ``bertdist._C``),
alternating between them round by round so that a load change on the machine hits both alike.

    python benchmarks/op_dispatch.py --repo old=/path/to/checkout --repo new=. [--rounds 7]

One thread (torch.set_num_threads(1)): the kernels' OpenMP fan-out would add its own noise.
Prints a Markdown table; --json writes every round's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

SHAPES = {"tiny 8x768": (8, 768), "BERT-base 4096x768": (32 * 128, 768)}


def _child(calls: int, reps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from bertdist.ops import _extension, fused

    mod, why = _extension.load()
    assert mod is not None, why
    out = {"module": mod.__file__, "fused": fused.__file__, "results": {}}
    for label, (rows, hidden) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        x, res = (torch.randn(rows, hidden, generator=g).requires_grad_(True) for _ in range(2))
        bias, w, b = (torch.randn(hidden, generator=g).requires_grad_(True) for _ in range(3))
        dy = torch.randn(rows, hidden, generator=g)
        n = max(3, calls // (rows // 8))  # fewer calls where the kernel dominates

        cases = {
            "layer_norm fwd+bwd": lambda: fused.layer_norm(x, w, b, 1e-12).backward(dy),
            "bias_dropout_add_layer_norm p=0.1 fwd+bwd": lambda: fused.bias_dropout_add_layer_norm(
                x, bias, res, w, b, p=0.1, training=True, eps=1e-12).backward(dy),
        }
        for name, fn in cases.items():
            out["results"][f"{name} | {label}"] = _median_seconds(fn, n, reps)
        with torch.no_grad():  # inference: no autograd node
            out["results"][f"layer_norm fwd, no_grad | {label}"] = _median_seconds(
                lambda: fused.layer_norm(x, w, b, 1e-12), n, reps)
    return out


def _median_seconds(fn, n: int, reps: int) -> float:
    """Seconds per call of ``fn``: the median of ``reps`` batches of ``n`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", default=[], help="label=path of a checkout (give two or more)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="calls per timed batch at the tiny shape")
    ap.add_argument("--reps", type=int, default=7, help="timed batches per round (their median counts)")
    ap.add_argument("--json", help="write every round's figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.calls, a.reps)))
        return 0
    repos = dict(r.split("=", 1) for r in a.repo)
    if len(repos) < 2:
        ap.error("give at least two --repo label=path")
    rounds: dict[str, list[dict]] = {k: [] for k in repos}
    modules = {}
    for i in range(a.rounds):
        order = list(repos) if i % 2 == 0 else list(reversed(repos))
        for label in order:
            path = os.path.abspath(repos[label])
            env = {**os.environ, "PYTHONPATH": path, "BERTDIST_JIT": "0", "OMP_NUM_THREADS": "1"}
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--calls", str(a.calls),
                                "--reps", str(a.reps)], cwd=path, env=env, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            res = json.loads(r.stdout.strip().splitlines()[-1])
            modules[label] = res["module"]
            rounds[label].append(res["results"])
        print(f"round {i + 1}/{a.rounds} done", file=sys.stderr)
    labels = list(repos)
    keys = list(rounds[labels[0]][0])
    med = {k: {lab: statistics.median(r[k] for r in rounds[lab]) for lab in labels} for k in keys}
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the end; torch threads 1; {a.rounds} rounds alternating; "
          f"each figure the median over rounds of the median of {a.reps} timed batches")
    for lab in labels:
        print(f"- {lab}: {repos[lab]} ({modules[lab]})")
    print()
    print("| case | shape | " + " | ".join(f"{lab} us/call" for lab in labels)
          + f" | {labels[0]} - {labels[-1]} us |")
    print("|---|---|" + "---:|" * (len(labels) + 1))
    for k in keys:
        case, shape = k.split(" | ")
        vals = [med[k][lab] * 1e6 for lab in labels]
        print(f"| {case} | {shape} | " + " | ".join(f"{v:,.1f}" for v in vals) + f" | {vals[0] - vals[-1]:,.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"repos": repos, "modules": modules, "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
