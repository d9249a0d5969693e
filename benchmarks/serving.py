"""Serving speed on CPU: PyTorch against ONNX Runtime, offline and under load through `bertdist serve`.

Offline, for each model (the fine-tuned SST-2 teacher and its distilled 3-layer student, as
`benchmarks/distill.py` writes them), five variants are timed interleaved in one process:

* PyTorch eager fp32 (transformers, default attention);
* PyTorch dynamic int8 (``torch.ao.quantization.quantize_dynamic`` over the Linear layers);
* ONNX Runtime fp32, ONNX Runtime optimised fp32 and ONNX Runtime int8 (`bertdist export --format onnx`).

Inputs are the real SST-2 dev sentences (their own length distribution): latency at batch 1 (p50 and
p95 over the first ``--latency-sentences``), throughput at batch 32 over the whole dev set in its
file order (each batch padded to its longest sentence), and each variant's dev accuracy from those
batch-32 outputs. Cost per million inferences = price per hour / (3600 x sequences per second) x 1e6,
at the stated price of a 2-vCPU machine.

Under load, `bertdist serve` runs the student in its own process and a client process keeps
1-64 connections busy for a fixed time each, with dynamic batching on and off; every answer is
checked against the offline model. Before each round, with the servers idle, the served model file
is also timed alone on the load's sentences on the server's cores: at batch 1, and at batch 32
sorted by length (the least padding any batcher could reach), the fastest of one run over all the
cores and one single-threaded run per core. The second over the unbatched
server's throughput bounds what batching can give on this machine, whatever the HTTP layer costs.

    python benchmarks/serving.py --teacher T --student S --out benchmarks/results/serving_cpu_DATE.md
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
VARIANTS = ("torch_fp32", "torch_int8", "ort_fp32", "ort_optimized", "ort_int8")
LABELS = {"torch_fp32": "PyTorch eager fp32", "torch_int8": "PyTorch dynamic int8", "ort_fp32": "ONNX Runtime fp32",
          "ort_optimized": "ONNX Runtime optimised fp32", "ort_int8": "ONNX Runtime int8"}
TARGETS = {"ort_int8_vs_torch_b32": 2.0, "max_accuracy_drop_points": 1.0, "student_vs_teacher_eager": 3.5,
           "batching_gain_32_clients": 3.0, "p99_ms_32_clients": 250.0, "served_vs_model_alone_32_clients": 0.70,
           "p99_with_hostile_vs_without": 2.0}


def sst2_dev() -> tuple[list[str], list[int]]:
    rows = list(csv.reader((SHARED / "glue" / "SST-2" / "dev.tsv").open(encoding="utf-8"), delimiter="\t", quotechar=None))
    col, lab = rows[0].index("sentence"), rows[0].index("label")
    return [r[col] for r in rows[1:]], [int(r[lab]) for r in rows[1:]]


def export(model_dir: Path, out: Path, threads: int) -> Path:
    """The ONNX directory of ``model_dir`` (fp32, optimised, int8 checked on the SST-2 dev set)."""
    from bertdist.serve.onnx_export import ExportOptions, export_onnx

    if (out / "onnx_card.json").is_file():
        return out
    export_onnx(model_dir, out, ExportOptions(optimize=True, quantize="int8", task="sst2",
                                              dev=str(SHARED / "glue" / "SST-2"), threads=threads))
    return out


class Runner:
    """One variant: ``logits(batch)`` over tokenised numpy inputs."""

    def __init__(self, kind: str, hf_dir: Path, onnx_dir: Path, threads: int):
        self.kind = kind
        if kind.startswith("torch"):
            import torch
            import transformers

            m = transformers.AutoModelForSequenceClassification.from_pretrained(str(hf_dir)).eval()
            if kind == "torch_int8":
                m = torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
            self.model = m
        else:
            from bertdist.serve.card import FILES
            from bertdist.serve.runtime import make_session

            self.session = make_session(onnx_dir / FILES[kind[len("ort_"):]], threads)

    def logits(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        if self.kind.startswith("torch"):
            import torch

            with torch.inference_mode():
                return self.model(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
        return self.session.run(None, batch)[0]


def tokenise(tok, texts: list[str], size: int) -> list[dict[str, np.ndarray]]:
    out = []
    for i in range(0, len(texts), size):
        e = tok(texts[i:i + size], padding=True, truncation=True, max_length=128, return_tensors="np")
        out.append({k: e[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
    return out


def offline(name: str, hf_dir: Path, onnx_dir: Path, texts, labels, args) -> dict:
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    b32 = tokenise(tok, texts, 32)
    b1 = tokenise(tok, texts[:args.latency_sentences], 1)
    runners = {v: Runner(v, hf_dir, onnx_dir, args.threads) for v in VARIANTS}
    for r in runners.values():  # warm-up: first-call allocations and ORT's lazy initialisation
        r.logits(b32[0])
        r.logits(b1[0])
    thr = {v: [] for v in VARIANTS}
    lat = {v: [] for v in VARIANTS}
    acc = {}
    for rnd in range(args.rounds):
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]  # rotate who goes first
        for v in order:
            r = runners[v]
            t0 = time.perf_counter()
            preds = np.concatenate([r.logits(b) for b in b32]).argmax(-1)
            thr[v].append(len(texts) / (time.perf_counter() - t0))
            acc[v] = float((preds == np.asarray(labels)).mean())
            for b in b1:
                t0 = time.perf_counter()
                r.logits(b)
                lat[v].append(1000 * (time.perf_counter() - t0))
        print(f"[{name}] round {rnd + 1}/{args.rounds}: " + ", ".join(f"{v} {thr[v][-1]:.1f}/s" for v in VARIANTS),
              flush=True)
    # Dynamic int8 quantises activations with one scale per batch tensor, so an answer can depend on
    # the batch it rides in: label flips between batch 1 and batch 32, over the whole dev set.
    b1_all = tokenise(tok, texts, 1)
    flips = {}
    for v in ("torch_int8", "ort_int8"):
        single = np.concatenate([runners[v].logits(b) for b in b1_all])
        batched = np.concatenate([runners[v].logits(b) for b in b32])
        flips[v] = int((single.argmax(-1) != batched.argmax(-1)).sum())
    res = {}
    for v in VARIANTS:
        sps = statistics.median(thr[v])
        res[v] = {"b32_seq_per_s": round(sps, 1), "b32_rounds": [round(x, 1) for x in thr[v]],
                  "b1_p50_ms": round(float(np.percentile(lat[v], 50)), 2),
                  "b1_p95_ms": round(float(np.percentile(lat[v], 95)), 2), "dev_accuracy": round(acc[v], 4),
                  "usd_per_million": round(args.price_per_hour / (3600 * sps) * 1e6, 3),
                  "b1_vs_b32_label_flips": flips.get(v, 0)}
    return res


# ---------------------------------------------------------------- under load
def model_alone(onnx_dir: Path, texts: list[str], args) -> dict:
    """The served model file timed without a server, on the server's cores (``--threads``):
    sequences per second at batch 1 (one sentence a call) and at batch 32 in length order. Each
    is the fastest of three ways to use those cores: one run at a time over all of them, with ONNX
    Runtime's pool threads spinning between calls (its default, best for a process that only runs
    the model) or sleeping; and one single-threaded run per core at once, on one session (as the
    server runs by default), the batches dealt out in turn."""
    import threading

    from transformers import AutoTokenizer

    from bertdist.serve.card import FILES
    from bertdist.serve.runtime import make_session

    tok = AutoTokenizer.from_pretrained(str(onnx_dir))
    path = onnx_dir / FILES[args.serve_variant]
    sessions = {"spin": make_session(path, args.threads, spin=True), "sleep": make_session(path, args.threads),
                "per_core": make_session(path, 1)}
    by_length = sorted(texts, key=lambda t: len(tok(t, truncation=True, max_length=128)["input_ids"]))
    batches = {"b1": tokenise(tok, texts, 1), "b32_sorted": tokenise(tok, by_length, 32)}
    for session in sessions.values():
        for b in batches.values():  # warm-up
            session.run(None, b[0])

    def run_all(session, bs):
        for b in bs:
            session.run(None, b)

    out = {}
    for name, bs in batches.items():
        for way, session in sessions.items():
            t0 = time.perf_counter()
            if way == "per_core":
                runs = [threading.Thread(target=run_all, args=(session, bs[i::args.threads]))
                        for i in range(args.threads)]
                for t in runs:
                    t.start()
                for t in runs:
                    t.join()
            else:
                run_all(session, bs)
            out[f"{name}_{way}"] = len(texts) / (time.perf_counter() - t0)
        out[f"{name}_seq_per_s"] = max(out[f"{name}_{way}"] for way in sessions)
    return out


def load_test(onnx_dir: Path, texts: list[str], args) -> tuple[list[dict], dict]:
    """Two `bertdist serve` processes, batching on and off, each driven in turn by
    benchmarks/serving_load.py from another process: for each client count, on then off (the
    order swapped each round), ``--load-rounds`` rounds; each row is the median round. Also the
    model alone (``model_alone``) before each round: medians and every round."""
    from bertdist.serve.runtime import load_served_model

    m = load_served_model(onnx_dir, variant=args.serve_variant, threads=1)
    sample = texts[:args.load_sentences]
    expected = []
    for t in sample:
        job = m.prepare("predict", {"inputs": t})
        expected.append(job.finish(m.run(job.items))[0]["label"])
    exp_file = Path(args.work) / "expected.json"
    exp_file.write_text(json.dumps({"texts": sample, "labels": expected}))
    servers = {}
    try:
        for batching in (True, False):
            port = _free_port()
            cmd = [sys.executable, "-m", "bertdist.cli.main", "serve", str(onnx_dir), "--port", str(port),
                   "--variant", args.serve_variant, "--threads", "1", "--workers", str(args.threads),
                   "--max-batch-size", "32",
                   "--max-wait-ms", str(args.max_wait_ms), "--max-queue", "1024"]
            if not batching:
                cmd.append("--no-batching")
            servers[batching] = (port, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                        cwd=REPO))
        for port, proc in servers.values():
            _wait_healthy(port, proc)
        runs: dict[tuple[bool, int], list[dict]] = {}
        alone: list[dict] = []
        for rnd in range(args.load_rounds):
            alone.append(model_alone(onnx_dir, sample, args))
            print(f"[load] round {rnd + 1} model alone: " + ", ".join(f"{k} {v:.1f}" for k, v in alone[-1].items()),
                  flush=True)
            for clients in args.clients:
                for batching in ((True, False) if rnd % 2 == 0 else (False, True)):
                    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving_load.py"), "--port",
                                          str(servers[batching][0]), "--clients", str(clients), "--seconds",
                                          str(args.load_seconds), "--expected", str(exp_file)],
                                         capture_output=True, text=True, check=True)
                    row = json.loads(out.stdout)
                    runs.setdefault((batching, clients), []).append(row)
                    print(f"[load] round {rnd + 1} batching={batching} clients={clients}: {row['throughput_rps']:.1f} "
                          f"req/s, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, wrong {row['wrong']}, "
                          f"errors {row['errors']}, shed {row['shed']}", flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            proc.wait(timeout=30)
    rows = []
    for (batching, clients), rs in sorted(runs.items(), key=lambda kv: (not kv[0][0], kv[0][1])):
        med = sorted(rs, key=lambda r: r["throughput_rps"])[len(rs) // 2]
        rows.append({**med, "batching": batching, "clients": clients,
                     "rounds_rps": [round(r["throughput_rps"], 1) for r in rs],
                     "answered": sum(r["answered"] for r in rs), "wrong": sum(r["wrong"] for r in rs),
                     "shed": sum(r["shed"] for r in rs), "errors": sum(r["errors"] for r in rs),
                     "lost": sum(r["lost"] for r in rs)})
    ceiling = {k: statistics.median(a[k] for a in alone) for k in alone[0]}
    ceiling["rounds"] = [{k: round(v, 1) for k, v in a.items()} for a in alone]
    return rows, ceiling


def hostile_test(onnx_dir: Path, args) -> dict:
    """One `bertdist serve` with its default settings; 16 well-behaved clients with and without
    one client sending maximum-size bodies beside them (benchmarks/serving_load.py --hostile),
    alternating, ``--hostile-rounds`` rounds each. Their p99 (median round) with it over without."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bertdist.cli.main", "serve", str(onnx_dir), "--port", str(port),
                             "--variant", args.serve_variant, "--threads", "1", "--workers", str(args.threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    runs: dict[int, list[dict]] = {0: [], 1: []}
    try:
        _wait_healthy(port, proc)
        for rnd in range(args.hostile_rounds):
            for hostile in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving_load.py"), "--port", str(port),
                                      "--clients", "16", "--seconds", str(args.load_seconds), "--expected",
                                      str(Path(args.work) / "expected.json"), "--hostile", str(hostile)],
                                     capture_output=True, text=True, check=True)
                row = json.loads(out.stdout)
                runs[hostile].append(row)
                print(f"[hostile] round {rnd + 1} hostile={hostile}: {row['throughput_rps']:.1f} req/s, p99 "
                      f"{row['p99_ms']:.1f} ms, hostile answers {row['hostile']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    med = {h: sorted(rs, key=lambda r: r["p99_ms"])[len(rs) // 2] for h, rs in runs.items()}
    return {"without": med[0], "with": med[1], "rounds_p99_ms": {h: [round(r["p99_ms"], 1) for r in rs]
                                                                for h, rs in runs.items()},
            "hostile_answers": [r["hostile"] for r in runs[1]],
            "ratio": med[1]["p99_ms"] / med[0]["p99_ms"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc, timeout: float = 60.0) -> None:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"bertdist serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("bertdist serve did not become healthy")


# ---------------------------------------------------------------- report
def report(res: dict, load: list[dict], args, seconds: float, alone: dict | None = None,
           hostile: dict | None = None) -> str:
    lines = [f"# Serving benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"Command: `python benchmarks/serving.py {' '.join(sys.argv[1:])}`",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads per variant; "
             f"price {args.price_per_hour} USD per hour (a 2-vCPU on-demand VM, as stated by --price-per-hour)", "",
             "## Offline, SST-2 dev (872 sentences)", "",
             "| model | variant | b32 seq/s | x eager fp32 | b1 p50 ms | b1 p95 ms | dev accuracy | USD per 1M | labels b1 vs b32 differ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in res:
        base = res[name]["torch_fp32"]["b32_seq_per_s"]
        for v in VARIANTS:
            r = res[name][v]
            lines.append(f"| {name} | {LABELS[v]} | {r['b32_seq_per_s']:.1f} | {r['b32_seq_per_s'] / base:.2f}x | "
                         f"{r['b1_p50_ms']:.1f} | {r['b1_p95_ms']:.1f} | {r['dev_accuracy']:.4f} | {r['usd_per_million']:.3f} | "
                         f"{r['b1_vs_b32_label_flips']} |")
    lines += ["", f"Throughput: median of {args.rounds} interleaved rounds (order rotated each round); latency: "
              f"p50/p95 of {args.rounds} x {args.latency_sentences} single-sentence calls.", ""]
    if load:
        lines += ["## Under load: `bertdist serve` (student, ONNX Runtime " + args.serve_variant + ")", "",
                  f"Each row: the median of {args.load_rounds} rounds of {args.load_seconds:.0f} s (req/s of every round "
                  "listed), batching on and off alternating; answered/differ/503/errors/lost summed over the rounds. "
                  "*differ*: answers whose label is not the one the offline model gives the sentence alone (batch 1); "
                  "with dynamic int8 a label can change with the batch a sentence rides in (see the offline table).", "",
                  "| batching | clients | req/s | rounds | p50 ms | p99 ms | answered | differ | 503 | errors | lost |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in load:
            lines.append(f"| {'on' if r['batching'] else 'off'} | {r['clients']} | {r['throughput_rps']:.1f} | "
                         f"{', '.join(str(x) for x in r['rounds_rps'])} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                         f"{r['answered']} | {r['wrong']} | {r['shed']} | {r['errors']} | {r['lost']} |")
        lines.append("")
    if alone:
        rounds = "; ".join(f"{a['b1_seq_per_s']:.0f} and {a['b32_sorted_seq_per_s']:.0f}" for a in alone["rounds"])
        lines += [f"The model alone (the served file on {args.threads} cores, no server), before each round: "
                  f"{alone['b1_seq_per_s']:.1f} sentences/s at batch 1 and {alone['b32_sorted_seq_per_s']:.1f} at "
                  f"batch 32 sorted by length (medians; every round: {rounds}). Each is the fastest of one run at a "
                  f"time over the {args.threads} cores, ONNX Runtime's pool threads spinning between calls or sleeping, "
                  f"and one single-threaded run per core at once (as the server runs); at batch 32, medians "
                  f"{alone.get('b32_sorted_spin', float('nan')):.1f} spinning, "
                  f"{alone.get('b32_sorted_sleep', float('nan')):.1f} sleeping and "
                  f"{alone.get('b32_sorted_per_core', float('nan')):.1f} per core.", ""]
    if hostile:
        w, wo = hostile["with"], hostile["without"]
        lines += ["## Beside a hostile client", "",
                  f"`bertdist serve` with its default settings; 16 well-behaved clients for {args.load_seconds:.0f} s, "
                  f"with and without one more client sending maximum-size bodies (a megabyte of one text, 256 texts of "
                  f"4 KiB, 1,000 texts of a kilobyte, in turn), alternating; medians of {args.hostile_rounds} rounds "
                  "(every round's p99 listed).", "",
                  "| beside them | req/s | p50 ms | p99 ms | every round's p99 ms | answered | errors | lost |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r, h in (("nothing", wo, 0), ("the hostile client", w, 1)):
            lines.append(f"| {name} | {r['throughput_rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                         f"{', '.join(str(x) for x in hostile['rounds_p99_ms'][h])} | {r['answered']} | "
                         f"{r['errors']} | {r['lost']} |")
        lines += ["", f"The hostile client's answers by status, each round: {hostile['hostile_answers']}.", ""]
    lines += ["## Targets", ""] + [f"- {t}" for t in verdicts(res, load, alone, hostile)] + ["", f"Wall time: {seconds:.0f} s", ""]
    return "\n".join(lines)


def verdicts(res: dict, load: list[dict], alone: dict | None = None, hostile: dict | None = None) -> list[str]:
    out = []
    for name in res:
        r = res[name]
        x = r["ort_int8"]["b32_seq_per_s"] / r["torch_fp32"]["b32_seq_per_s"]
        drop = 100 * (r["torch_fp32"]["dev_accuracy"] - r["ort_int8"]["dev_accuracy"])
        out.append(f"{name}: ORT int8 at batch 32 = {x:.2f}x PyTorch eager fp32 (target >= {TARGETS['ort_int8_vs_torch_b32']}: "
                   f"{'met' if x >= TARGETS['ort_int8_vs_torch_b32'] else 'NOT met'}); accuracy drop {drop:+.2f} points "
                   f"(target <= {TARGETS['max_accuracy_drop_points']}: {'met' if drop <= TARGETS['max_accuracy_drop_points'] else 'NOT met'})")
    if "teacher" in res and "student" in res:
        x = res["student"]["ort_int8"]["b32_seq_per_s"] / res["teacher"]["torch_fp32"]["b32_seq_per_s"]
        out.append(f"served student (ORT int8) = {x:.2f}x the teacher's eager throughput (target >= "
                   f"{TARGETS['student_vs_teacher_eager']}: {'met' if x >= TARGETS['student_vs_teacher_eager'] else 'NOT met'})")
    on = {r["clients"]: r for r in load if r["batching"]}
    off = {r["clients"]: r for r in load if not r["batching"]}
    if 32 in on and 32 in off:
        g = on[32]["throughput_rps"] / off[32]["throughput_rps"]
        p99 = on[32]["p99_ms"]
        out.append(f"32 clients: batching {g:.2f}x the throughput without (target >= {TARGETS['batching_gain_32_clients']}: "
                   f"{'met' if g >= TARGETS['batching_gain_32_clients'] else 'NOT met'}), p99 {p99:.0f} ms (target <= "
                   f"{TARGETS['p99_ms_32_clients']:.0f}: {'met' if p99 <= TARGETS['p99_ms_32_clients'] else 'NOT met'})"
                   + (f"; the model alone at batch 32 sorted by length runs "
                      f"{alone['b32_sorted_seq_per_s'] / off[32]['throughput_rps']:.2f}x the unbatched server's "
                      f"throughput ({alone['b32_sorted_seq_per_s'] / alone['b1_seq_per_s']:.2f}x "
                      "its own batch-1 rate): the most batching could give here, with HTTP at no cost"
                      if alone else ""))
    if 32 in on and alone:
        x = on[32]["throughput_rps"] / alone["b32_sorted_seq_per_s"]
        t = TARGETS["served_vs_model_alone_32_clients"]
        out.append(f"32 clients: the batching server answers {x:.0%} of the model's own batch-32 length-sorted rate "
                   f"(target >= {t:.0%}: {'met' if x >= t else 'NOT met'})")
    if hostile:
        t = TARGETS["p99_with_hostile_vs_without"]
        out.append(f"16 clients' p99 beside a client sending maximum-size bodies: {hostile['with']['p99_ms']:.1f} ms, "
                   f"{hostile['ratio']:.2f}x their p99 without it ({hostile['without']['p99_ms']:.1f} ms; target <= "
                   f"{t}x: {'met' if hostile['ratio'] <= t else 'NOT met'})")
    if load:
        n = sum(r["answered"] for r in load)
        differ = sum(r["wrong"] for r in load)
        bad = sum(r["errors"] + r["lost"] for r in load)
        out.append(f"under load: {n} answered, {bad} lost or failed, {sum(r['shed'] for r in load)} shed (503); "
                   f"{differ} labels ({100 * differ / max(n, 1):.2f}%) differ from the offline batch-1 answer")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="the fine-tuned SST-2 teacher (HF task directory)")
    p.add_argument("--student", required=True, help="the distilled student (HF task directory)")
    p.add_argument("--out", required=True, help="results markdown (the JSON goes beside it)")
    p.add_argument("--work", default="/tmp/bertdist-serving-bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency-sentences", type=int, default=100)
    p.add_argument("--price-per-hour", type=float, default=0.085)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    p.add_argument("--load-seconds", type=float, default=8.0)
    p.add_argument("--load-rounds", type=int, default=2)
    p.add_argument("--load-sentences", type=int, default=872)
    p.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="the batching server's wait (default: the server's own, 0)")
    p.add_argument("--serve-variant", default="int8")
    p.add_argument("--hostile-rounds", type=int, default=3, help="rounds of the hostile-client comparison (0: none)")
    args = p.parse_args(argv)
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    texts, labels = sst2_dev()
    models = {"teacher": Path(args.teacher), "student": Path(args.student)}
    onnx = {n: export(d, work / f"onnx-{n}", args.threads) for n, d in models.items()}
    res = {} if args.skip_offline else {n: offline(n, models[n], onnx[n], texts, labels, args) for n in models}
    load, alone = ([], {}) if args.skip_load else load_test(onnx["student"], texts, args)
    hostile = hostile_test(onnx["student"], args) if args.hostile_rounds and not args.skip_load else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"offline": res, "load": load, "model_alone": alone,
                                                    "hostile": hostile, "args": vars(args)}, indent=2) + "\n")
    out.write_text(report(res, load, args, time.time() - t0, alone, hostile))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
