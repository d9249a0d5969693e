"""The trade an int8 export made, as the card and the log report it: the metric before and after,
the nodes kept in fp32, and the speed against fp32 ONNX and against PyTorch eager fp32 (the
model the export traced) at batch 1 and 32.

The three take turns batch by batch on the same real examples (a task's first dev examples, else
the calibration set's; each batch padded to its longest), so that a machine busy with other work
slows all of them alike; each figure is the median of 3 passes.
"""
from __future__ import annotations

import statistics
import time

from bertdist.serve.int8_gates import batch_feeds

BATCHES = {1: 16, 32: 64}  # batch size -> examples timed per pass
REPEATS = 3


def take_turns(runners: dict, feeds: list) -> dict[str, float]:
    """Seconds of each runner over ``feeds``, taking turns batch by batch (the order rotated)."""
    names = list(runners)
    secs = dict.fromkeys(names, 0.0)
    for i, f in enumerate(feeds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            runners[k](f)
            secs[k] += time.perf_counter() - t0
    return secs


def speed(torch_model, fp32_session, int8_session, examples: list, threads: int | None = None,
          repeats: int = REPEATS) -> dict:
    """Sequences per second of each at batch 1 and 32, and the int8 model's ratios."""
    import torch

    from bertdist.serve import parity

    runners = {"torch_eager_fp32": lambda f: parity.run_torch(torch_model, f),
               "onnx_fp32": lambda f: parity.run_onnx(fp32_session, f),
               "onnx_int8": lambda f: parity.run_onnx(int8_session, f)}
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    out = {"examples": {str(b): min(n, len(examples)) for b, n in BATCHES.items()}, "repeats": repeats,
           "torch_threads": torch.get_num_threads()}
    try:
        for batch, n in BATCHES.items():
            feeds = batch_feeds(examples[:n], batch)
            seqs = sum(len(f["input_ids"]) for f in feeds)
            for run in runners.values():
                run(feeds[0])  # warm-up
            times = {k: [] for k in runners}
            for _ in range(repeats):
                for k, t in take_turns(runners, feeds).items():
                    times[k].append(t)
            rate = {k: seqs / statistics.median(v) for k, v in times.items()}
            out[f"batch_{batch}"] = {**{f"{k}_seq_per_s": round(v, 1) for k, v in rate.items()},
                                     "int8_vs_onnx_fp32": round(rate["onnx_int8"] / rate["onnx_fp32"], 3),
                                     "int8_vs_torch_eager": round(rate["onnx_int8"] / rate["torch_eager_fp32"], 3)}
    finally:
        torch.set_num_threads(before)
    return out


def summary(verdict: dict, settings: dict, timing: dict | None) -> dict:
    """The card's ``int8_report``."""
    return {"mode": settings["mode"], "metric": verdict.get("metric"), "fp32": verdict.get("fp32"),
            "int8": verdict.get("int8"), "drop_points": verdict.get("drop_points"),
            "kept_fp32": settings["kept_fp32"], "speed": timing}


def log_lines(report: dict) -> list[str]:
    lines = []
    if report["metric"] is not None:
        lines.append(f"int8 report ({report['mode']}): {report['metric']} {report['fp32']:.4f} fp32 -> "
                     f"{report['int8']:.4f} int8" + (f" (drop {report['drop_points']:+.2f} points)"
                                                     if report["drop_points"] is not None else ""))
    kept = report["kept_fp32"]
    lines.append(f"int8 report: {len(kept)} node(s) kept in fp32" + (f": {', '.join(kept)}" if kept else ""))
    for b in (1, 32):
        s = (report["speed"] or {}).get(f"batch_{b}")
        if s:
            lines.append(f"int8 report: batch {b}: {s['onnx_int8_seq_per_s']:.0f} seq/s int8, "
                         f"{s['int8_vs_onnx_fp32']:.2f}x fp32 ONNX ({s['onnx_fp32_seq_per_s']:.0f}), "
                         f"{s['int8_vs_torch_eager']:.2f}x PyTorch eager fp32 ({s['torch_eager_fp32_seq_per_s']:.0f})")
    return lines
