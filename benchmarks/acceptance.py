"""The one-command GPU acceptance (``bertdist bench``): tests, kernels, training throughput, one report.

On a CUDA machine (the target: under 10 minutes on one H100):
  1. the GPU tests (``pytest -m gpu``: fused CUDA kernels, torch-native paths, kernels: auto on
     this GPU); no test collected (pytest's exit 5) is a failure;
  2. the kernel benchmark (benchmarks/kernels.py): our kernels against every SDPA backend and
     ``varlen_attn``;
  3. ``bertdist pretrain`` itself, once per shipped recipe (configs/pretrain/*.yaml), with the
     recipe's optimizer, precision, ``unpad``, kernels and ``model.compile``, scaled only in the
     global batch (one micro-batch: accumulation 1, one process) and the step count; seq/s, real
     tokens/s and MFU are the medians of the trainer's own metrics.jsonl after the first steps.
     On CPU the model is also scaled (tiny preset, micro batch 4); the report says what was;
  4. "kernels: auto never slower than reference": whole training steps of one recipe with
     ``kernels: auto`` and with ``kernels: reference``, runs interleaved (alternating order) and
     repeated; the verdict is "NOT met" when auto's median step is slower than reference's by
     more than the spread of either side's runs;
  5. training throughput side by side in this run (benchmarks/train_throughput.py), bf16, the
     same batch for every variant: ours-optimized (kernels: auto, unpadded, sparse MLM head),
     ours-torch (the same model on torch-native kernels), HF BertForPreTraining + SDPA with and
     without torch.compile; BERT-base and BERT-large at seq 128 and 512; row lengths from real
     shards (built here from the bundled samples unless --lengths-from is given);
  6. one Markdown report (and the raw JSON) under benchmarks/results/: device, date, exact
     command, versions, the targets met or not, sequences/s, real tokens/s, MFU over real tokens
     with the stated peak, peak memory, ratio to HF, the kernel decisions, raw output.

On CPU the same command runs a quick variant (small models, a few steps), so CI proves the
harness end to end; its numbers are not GPU claims.

Stages run in order against a time budget (``--budget-s``); a stage that would start after it is
spent is reported as skipped, never silently dropped. A stage, recipe or variant that fails is a
failed row of the report, which is always written; ``exit_status`` is then 1, as it is for a
failed GPU test or a target "NOT met".

    bertdist bench                      # or: python benchmarks/acceptance.py
    bertdist bench --quick              # the CPU variant's sizes on any device
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GPU_TEST_FILES = ("tests/ops/test_fused_gpu.py", "tests/ops/test_torch_native_gpu.py")
# Targets for one H100; reported, never asserted.
TARGET_LARGE_128_SEQ_PER_S = 1850
TARGET_LARGE_128_MFU = 0.45
TARGET_VS_HF = 1.5
GPU_CONFIGS = [("base", 128, 64), ("base", 512, 16), ("large", 128, 64), ("large", 512, 16)]  # preset, seq, batch
CPU_CONFIGS = [("mini", 64, 2)]
GPU_VARIANTS = "ours-optimized,ours-torch,hf-sdpa,hf-sdpa-compile"
CPU_VARIANTS = "ours-optimized,ours-reference,hf-sdpa,hf-sdpa-compile"
RECIPES = REPO / "configs" / "pretrain"
# The recipe whose whole training steps compare kernels: auto with kernels: reference (the H100 target's).
AUTO_VS_REFERENCE_RECIPE = "bert-large-phase1.yaml"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(torch) -> dict:
    gpu = torch.cuda.is_available()
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    env = {
        "device": torch.cuda.get_device_name() if gpu else f"CPU ({platform.processor() or platform.machine()}, "
                                                             f"{torch.get_num_threads()} torch threads)",
        "device_type": "cuda" if gpu else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if gpu else "n/a",
        "deepspeed": _version("deepspeed"), "transformers": _version("transformers"),
        "bertdist": f"{_version('bertdist')} (git {git.stdout.strip() or 'unknown'}"
                    f"{', uncommitted changes' if dirty.stdout.strip() else ''})",
    }
    if gpu:
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible"
    return env


class Budget:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


# ---------------------------------------------------------------- stages


def stage_tests(python: str, quick: bool) -> dict:
    """pytest -m gpu in a child process (skips cleanly without CUDA)."""
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", *GPU_TEST_FILES]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    summary = next((ln.strip("= ") for ln in reversed(out.splitlines()) if re.search(r"\b(passed|failed|skipped|error)", ln)), "")
    return {"command": shlex.join(cmd), "returncode": proc.returncode, "summary": summary,
            "seconds": time.perf_counter() - t0, "output": out[-20000:]}


def stage_kernels(quick: bool, device_type: str) -> dict:
    kernels = _load("kernels")
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        data = kernels.run(["--device", device_type, *(["--quick"] if quick else [])])
    return {"seconds": time.perf_counter() - t0, "output": buf.getvalue(), **data}


def build_length_records(seqs: list[int], out: Path) -> dict[int, str]:
    """Records from the bundled real text (books + Wikipedia sample), one build per seq: their
    row lengths are what the throughput runs sample."""
    from data_pipeline import build_records
    from data_pipeline.config import InputConfig
    from data_pipeline.tokenization import train_vocab
    from data_pipeline.vocab_corpus import iter_sentences

    samples = REPO / "data_pipeline" / "samples"
    vocab = out / "vocab.txt"
    train_vocab(iter_sentences([InputConfig(kind="books", path=str(samples / "books"))]), vocab, vocab_size=8000,
                lowercase=True)
    manifests = {}
    for seq in seqs:
        manifests[seq] = str(build_records([f"wiki:{samples / 'wiki'}", f"books:{samples / 'books'}"],
                                           out / f"records_{seq}", vocab, max_seq_length=seq, dupe_factor=1,
                                           num_shards=2, heldout_fraction=0.0,
                                           max_predictions_per_seq={128: 20, 512: 80}.get(seq, 20)))
    return manifests


def stage_decisions(configs: list[tuple[str, int, int]], device_type: str, precision: str) -> list[dict]:
    """kernels: auto's measured choice for each configuration's shapes, as ours-optimized will run
    them (unpadded; bf16 under autocast on CUDA). On CPU this is the explicit exercise of the
    mechanism, with the C++ CPU kernels as candidates (a CPU run's auto does not measure)."""
    import torch

    from bertdist.model import BertConfig
    from bertdist.ops import selection
    from bertdist.ops.decision_cache import DecisionCache

    out = []
    for preset, seq, batch in configs:
        cfg = BertConfig.from_preset(preset, unpad=True)
        w = selection.Workload.for_model(cfg, batch=batch, seq=seq, precision=precision, autocast=precision != "fp32")
        dev = torch.device("cuda" if device_type == "cuda" else "cpu")
        plan = selection.decide(w, dev, cache=DecisionCache())
        out.append({"preset": preset, "seq": seq, "batch": batch, "table": plan.table(), "plan": plan.to_dict()})
    return out


def stage_throughput(preset: str, seq: int, batch: int, manifest: str, variants: str, steps: int | None,
                     precision: str | None, isolate: bool) -> dict:
    tt = _load("train_throughput")
    argv = ["--preset", preset, "--seq", str(seq), "--batch", str(batch), "--lengths-from", manifest,
            "--variants", variants, "--isolate" if isolate else "--no-isolate", "--keep-going"]
    if steps:
        argv += ["--steps", str(steps), "--warmup", "1", "--num-batches", str(min(2, steps))]
    if precision:
        argv += ["--precision", precision]
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        res = tt.main(argv)
    res["seconds"] = time.perf_counter() - t0
    res["failed_variants"] = res.pop("failed", {})  # a variant that raised: a failed row, the others ran
    res["output"] = buf.getvalue()
    res["argv"] = argv
    return res


# ---------------------------------------------------------------- bertdist pretrain itself


@dataclasses.dataclass(frozen=True)
class RecipeScale:
    """How the recipes are cut down to fit the time budget (reported with every row)."""

    steps: int  # max_steps of each run
    skip_steps: int  # first steps left out of the medians (start-up, allocator warm-up)
    model_preset: str | None = None  # None: the recipe's model
    micro_batch: int | None = None  # None: the recipe's micro batch

    @classmethod
    def for_device(cls, gpu: bool, quick: bool, steps: int | None = None) -> "RecipeScale":
        if gpu and not quick:
            return cls(steps=steps or 30, skip_steps=5)
        return cls(steps=max(steps or 4, 2), skip_steps=1, model_preset="tiny", micro_batch=4)

    def describe(self) -> str:
        what = ["global batch = one micro-batch (accumulation 1, one process)", f"{self.steps} steps"]
        if self.model_preset:
            what.append(f"model preset {self.model_preset}")
        if self.micro_batch:
            what.append(f"micro batch {self.micro_batch}")
        return ("scaled: " + ", ".join(what) + "; phase 2 recipes start from fresh weights instead of their phase 1 "
                "checkpoint; everything else as in the recipe")


def recipe_command(recipe: Path, manifest: str, vocab: str, run_dir: Path, scale: RecipeScale,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """``bertdist pretrain RECIPE`` with the scaling overrides (and no checkpoints or evaluation)."""
    import yaml

    data = yaml.safe_load(recipe.read_text())
    micro = scale.micro_batch or int(data["data"]["micro_batch_size"])
    args = [str(recipe), f"run_dir={run_dir}", f"data.train_manifest={manifest}", f"data.vocab_file={vocab}",
            f"data.micro_batch_size={micro}", f"data.global_batch_size={micro}", f"max_steps={scale.steps}",
            "data.eval_split=null", "checkpoint.every_steps=0", "checkpoint.save_at_end=false",
            "checkpoint.save_on_sigterm=false", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
            "logging.progress=none", "logging.tensorboard=false"]
    if scale.model_preset:
        args.append(f"model.preset={scale.model_preset}")
    if (data.get("checkpoint") or {}).get("init_from"):
        # A phase 2 starts from its phase 1's checkpoint; the time of a step does not depend on the weights.
        args.append("checkpoint.init_from=null")
    return [sys.executable, "-m", "bertdist.cli.pretrain", *args, *extra]


def trainer_metrics(run_dir: Path, skip_steps: int) -> dict:
    """Medians of the trainer's own per-step metrics (metrics.jsonl), after ``skip_steps``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    timed = train[skip_steps:] or train[-1:]
    if not timed:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'} holds no training step")
    run = next((r for r in rows if r["kind"] == "run"), {})
    out = {k: statistics.median(r[k] for r in timed) for k in ("seq_per_s", "tokens_per_s", "mfu", "step_time_s")}
    return {**out, "steps_timed": len(timed), "steps_run": len(train), "peak_note": run.get("peak_note", ""),
            "compiled": run.get("compile")}


def run_recipe(recipe: Path, manifest: str, vocab: str, out_dir: Path, scale: RecipeScale,
               extra: tuple[str, ...] = (), timeout: float = 600) -> dict:
    """One timed ``bertdist pretrain`` run: a row with the recipe's resolved settings and the
    trainer's metrics, or a failed row with the error (never an exception)."""
    import yaml

    run_dir = out_dir / (recipe.stem + "".join("_" + re.sub(r"[^a-z0-9]+", "-", e.lower()) for e in extra))
    cmd = recipe_command(recipe, manifest, vocab, run_dir, scale, extra)
    row = {"recipe": recipe.name, "command": shlex.join(cmd), "scaled": scale.describe(), "status": "failed"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {timeout:.0f} s", "seconds": time.perf_counter() - t0}
    row["seconds"] = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {**row, "error": f"exit {proc.returncode}: " + " | ".join(tail)[-1500:]}
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        row.update(optimizer=cfg["optimizer"]["name"], precision=cfg["deepspeed"]["precision"],
                   zero_stage=cfg["deepspeed"]["zero_stage"], unpad=cfg["model"]["unpad"],
                   kernels=cfg["model"]["kernels"], compile=cfg["model"].get("compile"),
                   model=cfg["model"]["preset"], seq=cfg["data"]["max_seq_length"],
                   micro_batch=cfg["data"]["micro_batch_size"], **trainer_metrics(run_dir, scale.skip_steps))
    except Exception as e:  # noqa: BLE001 - a run without readable metrics is a failed row
        return {**row, "error": f"{type(e).__name__}: {e}"}
    row["status"] = "ok"
    return row


def stage_recipes(recipes: list[Path], manifests: dict[int, str], vocab: str, out_dir: Path,
                  scale: RecipeScale) -> list[dict]:
    rows = []
    for recipe in recipes:
        print(f"[bench] pretrain {recipe.name} ...", file=sys.stderr, flush=True)
        rows.append(run_recipe(recipe, _manifest_for(recipe, manifests), vocab, out_dir, scale))
    return rows


def _manifest_for(recipe: Path, manifests: dict[int, str]) -> str:
    import yaml

    seq = int(yaml.safe_load(recipe.read_text())["data"]["max_seq_length"])
    if seq not in manifests:
        raise ValueError(f"no records with max_seq_length {seq} for {recipe.name} (have {sorted(manifests)})")
    return manifests[seq]


def compare_auto_reference(auto_s: list[float], reference_s: list[float]) -> dict:
    """The verdict on per-run median step times: "NOT met" when auto's median is slower than
    reference's by more than the spread (the larger max - min of the two sides' runs)."""
    if not auto_s or not reference_s:
        return {"verdict": "NOT met (no measurement)", "auto_s": auto_s, "reference_s": reference_s}
    a, r = statistics.median(auto_s), statistics.median(reference_s)
    spread = max(max(auto_s) - min(auto_s), max(reference_s) - min(reference_s))
    return {"auto_s": auto_s, "reference_s": reference_s, "auto_median_s": a, "reference_median_s": r,
            "spread_s": spread, "auto_slower_by_s": a - r, "verdict": "NOT met" if a - r > spread else "met"}


def stage_auto_vs_reference(recipe: Path, manifests: dict[int, str], vocab: str, out_dir: Path,
                            scale: RecipeScale, repeats: int) -> dict:
    """Whole training steps with kernels: auto and kernels: reference, interleaved (the order
    alternates per repeat) and repeated; each run contributes its median step time."""
    manifest = _manifest_for(recipe, manifests)
    times: dict[str, list[float]] = {"auto": [], "reference": []}
    runs = []
    for i in range(repeats):
        for mode in (("auto", "reference") if i % 2 == 0 else ("reference", "auto")):
            print(f"[bench] auto vs reference: {recipe.name} kernels={mode} ({i + 1}/{repeats}) ...",
                  file=sys.stderr, flush=True)
            row = run_recipe(recipe, manifest, vocab, out_dir / f"repeat{i}", scale, (f"model.kernels={mode}",))
            runs.append({"kernels": mode, "repeat": i, **row})
            if row["status"] == "ok":
                times[mode].append(row["step_time_s"])
    failed = [r for r in runs if r["status"] != "ok"]
    res = {"recipe": recipe.name, "scaled": scale.describe(), "repeats": repeats, "runs": runs,
           **compare_auto_reference(times["auto"], times["reference"])}
    if failed:
        res["verdict"] = f"NOT met ({len(failed)} of {len(runs)} runs failed)"
    return res


def targets(env: dict, runs: list[dict], auto_ref: dict | None,
            recipes: list[dict] | None = None) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows. The H100 figures are the trainer's own (the
    bert-large-phase1 recipe run); the ratio to HF comes from the side-by-side throughput runs."""
    gpu = env["device_type"] == "cuda"
    h100 = gpu and "H100" in env["device"]
    out = []
    large = next((r for r in recipes or [] if r["recipe"] == "bert-large-phase1.yaml" and r["status"] == "ok"), None)
    if large and h100:
        out.append((f"BERT-large seq 128 bf16, one H100: >= {TARGET_LARGE_128_SEQ_PER_S:,} seq/s (bertdist pretrain)",
                    f"{large['seq_per_s']:,.0f} seq/s",
                    "met" if large["seq_per_s"] >= TARGET_LARGE_128_SEQ_PER_S else "NOT met"))
        out.append((f"BERT-large seq 128 bf16, one H100: >= {TARGET_LARGE_128_MFU:.0%} MFU (bertdist pretrain)",
                    f"{large['mfu']:.1%}", "met" if large["mfu"] >= TARGET_LARGE_128_MFU else "NOT met"))
    else:
        out.append(("BERT-large seq 128 bf16 on one H100: 1,850 seq/s, 45% MFU", "-",
                    f"n/a on {env['device']}"))
    for r in runs:
        o, hf = r.get("variants", {}).get("ours-optimized"), r.get("variants", {}).get("hf-sdpa")
        label = f"{r['preset']} seq {r['seq']}: ours-optimized >= {TARGET_VS_HF}x HF+SDPA seq/s"
        if o and hf:
            ratio = o["seq_per_s"] / hf["seq_per_s"]
            verdict = ("met" if ratio >= TARGET_VS_HF else "NOT met") if gpu else "n/a (CPU: no GPU claim)"
            out.append((label, f"{ratio:.2f}x", verdict))
    if auto_ref is not None:
        label = (f"kernels: auto never slower than kernels: reference (whole training steps of {auto_ref['recipe']}, "
                 f"{auto_ref['repeats']} interleaved runs each)")
        if "auto_median_s" in auto_ref:
            measured = (f"auto {1000 * auto_ref['auto_median_s']:.1f} ms vs reference "
                        f"{1000 * auto_ref['reference_median_s']:.1f} ms per step (spread "
                        f"{1000 * auto_ref['spread_s']:.1f} ms)")
        else:
            measured = "-"
        out.append((label, measured, auto_ref["verdict"]))
    return out


def exit_status(report: dict) -> int:
    """1 when anything failed or a target is not met: a GPU test (pytest's exit 5, no test
    collected, included), a stage, a recipe run, a throughput configuration; else 0."""
    tests = report.get("tests")
    if tests is not None and tests.get("returncode") != 0:
        return 1
    if report.get("failed_stages") or any(r["status"] != "ok" for r in report.get("recipes") or []):
        return 1
    if any("failed" in r or r.get("failed_variants") for r in report.get("throughput") or []):
        return 1
    return 1 if any(v.startswith("NOT met") for _, _, v in report.get("targets") or []) else 0


def guarded(report: dict, name: str, fn, *args):
    """``fn(*args)``, or None with the failure recorded in ``report["failed_stages"]``: a stage
    that raises must not stop the report from being written."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported as a failed row
        report.setdefault("failed_stages", []).append(f"{name}: {type(e).__name__}: {str(e)[:500]}")
        return None


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU acceptance ({'quick CPU variant' if env['device_type'] == 'cpu' else 'CUDA'}): {env['device']}", "",
             f"- date: {env['date']}", f"- command: `{report['command']}`",
             "- versions: " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda", "cudnn", "deepspeed",
                                                                   "transformers", "bertdist")),
             f"- wall time: {report['seconds']:.0f} s (budget {report['budget_s']:.0f} s); per stage: "
             + ", ".join(f"{k} {v:.0f} s" for k, v in report["stage_seconds"].items())]
    if env.get("gpu"):
        lines.append(f"- GPU: {env['gpu']}")
    if env["device_type"] == "cpu":
        lines += ["", "No CUDA device: this is the quick CPU variant (small models, a few steps). It shows the "
                  "harness working end to end; none of its numbers is a GPU figure."]
    lines += ["", "## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in report["targets"]]
    for f in report.get("failed_stages") or []:
        lines.append(f"\nFAILED stage: {f}")
    recipes = report.get("recipes")
    if recipes:
        lines += ["", "## bertdist pretrain, each shipped recipe (the trainer's own metrics)", "",
                  f"{recipes[0]['scaled']}. Medians over the steps after the first ones (metrics.jsonl).", "",
                  "| recipe | model | seq | micro | optimizer | precision | ZeRO | unpad | kernels | compile | seq/s | "
                  "real tok/s | MFU | step (ms) |", "|---|---|---:|---:|---|---|---:|---|---|---|---:|---:|---:|---:|"]
        for r in recipes:
            if r["status"] != "ok":
                lines.append(f"| {r['recipe']} | FAILED: {r['error']} | | | | | | | | | | | | |")
                continue
            lines.append(f"| {r['recipe']} | {r['model']} | {r['seq']} | {r['micro_batch']} | {r['optimizer']} | "
                         f"{r['precision']} | {r['zero_stage']} | {r['unpad']} | {r['kernels']} | "
                         f"{r['compile']} ({'compiled' if r.get('compiled') else 'eager'}) | "
                         f"{r['seq_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.2f}% | "
                         f"{1000 * r['step_time_s']:.1f} |")
        lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in recipes[:1]) + " (and likewise per recipe)."]
    ar = report.get("auto_vs_reference")
    if ar:
        lines += ["", f"## kernels: auto vs kernels: reference, whole training steps ({ar['recipe']})", "",
                  f"{ar['scaled']}. Runs alternate auto/reference (the order flips every repeat); each run gives "
                  f"its median step time.", "", "| run | kernels | step (ms) | status |", "|---:|---|---:|---|"]
        for r in ar["runs"]:
            step = f"{1000 * r['step_time_s']:.1f}" if r["status"] == "ok" else "-"
            lines.append(f"| {r['repeat'] + 1} | {r['kernels']} | {step} | {r['status']}"
                         f"{': ' + r['error'] if r['status'] != 'ok' else ''} |")
        if "auto_median_s" in ar:
            lines += ["", f"Median: auto {1000 * ar['auto_median_s']:.1f} ms, reference "
                          f"{1000 * ar['reference_median_s']:.1f} ms; spread {1000 * ar['spread_s']:.1f} ms; "
                          f"auto slower by {1000 * ar['auto_slower_by_s']:.1f} ms: {ar['verdict']}."]
        else:
            lines += ["", f"Verdict: {ar['verdict']}."]
    lines += ["", "## Training throughput (same batch for every variant of a configuration)", "",
              "| config | precision | variant | seq/s | real tok/s | MFU (real tokens) | peak mem (MiB) | seq/s vs HF+SDPA |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in report["throughput"]:
        for name, v in r.get("variants", {}).items():
            ratio = (v.get("vs_hf_sdpa") or {}).get("seq_per_s")
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | {r['precision']} | {name} | {v['seq_per_s']:.1f} | "
                         f"{v['real_tokens_per_s']:,.0f} | {100 * v['mfu']:.2f}% | {v['peak_mem_bytes'] / 2**20:,.0f} | "
                         f"{f'{ratio:.2f}x' if ratio else '-'} |")
        if "failed" in r:
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | - | - | FAILED: {r['failed']} | | | | |")
        for name, why in r.get("failed_variants", {}).items():
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | {r.get('precision', '-')} | {name} | FAILED: {why} | | | | |")
        for name, why in r.get("skipped", {}).items():
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | {r.get('precision', '-')} | {name} | skipped: {why} | | | | |")
    for s in report["skipped_stages"]:
        lines.append(f"\nSkipped: {s}")
    r0 = next((r for r in report["throughput"] if "peak_note" in r), None)
    if r0:
        lines += ["", f"MFU peak: {r0['peak_note']}. Lengths: {r0['lengths']['source']}. Peak memory: {r0['peak_mem_kind']}."]
    lines += ["", "## kernels: auto decisions (numerics against the fp32 reference, then time)", "",
              "What auto chose and why; the verdict on auto against reference is the whole-step measurement "
              "above, not these timings (the choice was made from them).", ""]
    if env["device_type"] == "cpu":
        lines += ["On CPU a run's `kernels: auto` keeps torch's ops without measuring; here the mechanism is "
                  "exercised explicitly, with the C++ CPU kernels as candidates.", ""]
    for r in report["decisions"] or []:
        lines += [f"{r['preset']} b{r['batch']} s{r['seq']}:", "", "```", r["table"], "```", ""]
    t = report.get("tests")
    lines += ["## GPU tests", ""]
    lines += [f"`{t['command']}`: {t['summary']} (exit {t['returncode']}, {t['seconds']:.0f} s)" if t else "skipped"]
    k = report.get("kernels")
    lines += ["", "## Kernel benchmark (benchmarks/kernels.py)", "", "```", k["output"].rstrip() if k else "skipped", "```"]
    lines += ["", "## Raw output", ""]
    if t:
        lines += ["<details><summary>GPU tests</summary>", "", "```", t["output"].rstrip(), "```", "</details>", ""]
    for r in (x for x in report["throughput"] if "argv" in x):
        lines += [f"<details><summary>train_throughput.py {' '.join(r['argv'])}</summary>", "", "```",
                  r["output"].rstrip(), "```", "</details>", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CPU variant's sizes (automatic without CUDA)")
    ap.add_argument("--out", default=str(RESULTS), help="folder for the report (default benchmarks/results)")
    ap.add_argument("--lengths-from", nargs="+", metavar="MANIFEST",
                    help="records whose row lengths the throughput runs sample (one per seq, matched by their "
                         "max_seq_length; others are rescaled); default: built here from the bundled samples")
    ap.add_argument("--configs", help="preset:seq:batch,... (default: base and large at 128 and 512 on CUDA)")
    ap.add_argument("--variants", help="train_throughput variants (default: all four)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 30 on CUDA, 2 on CPU)")
    ap.add_argument("--recipes", help="comma-separated recipe files under configs/pretrain (default: all)")
    ap.add_argument("--recipe-steps", type=int, default=None,
                    help="steps of each bertdist pretrain run (default 30 on CUDA, 4 on CPU)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved runs of each side for auto vs reference (default 5 on CUDA, 3 on CPU)")
    ap.add_argument("--skip", default="",
                    help="comma-separated stages to skip: tests,kernels,decisions,recipes,auto_vs_reference,throughput")
    ap.add_argument("--budget-s", type=float, default=570.0, help="time budget; later stages are skipped past it")
    args = ap.parse_args(argv)
    import torch

    env = environment(torch)
    gpu = env["device_type"] == "cuda"
    quick = args.quick or not gpu
    skip = {s for s in args.skip.split(",") if s}
    budget = Budget(args.budget_s)
    configs = ([(p, int(s), int(b)) for p, s, b in (c.split(":") for c in args.configs.split(","))] if args.configs
               else (CPU_CONFIGS if quick else GPU_CONFIGS))
    variants = args.variants or (GPU_VARIANTS if gpu and not quick else CPU_VARIANTS)
    steps = args.steps or (None if gpu and not quick else 2)
    scale = RecipeScale.for_device(gpu, quick, args.recipe_steps)
    recipes = [RECIPES / name for name in args.recipes.split(",")] if args.recipes else sorted(RECIPES.glob("*.yaml"))
    repeats = args.repeats or (5 if gpu and not quick else 3)
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    report = {"environment": env, "command": command, "budget_s": args.budget_s, "stage_seconds": {},
              "skipped_stages": [], "failed_stages": [], "throughput": [], "tests": None, "kernels": None,
              "decisions": None, "recipes": None, "auto_vs_reference": None}

    def timed(name, fn, *a):
        if name in skip:
            report["skipped_stages"].append(f"{name} (--skip)")
            return None
        if budget.left() <= 0:
            report["skipped_stages"].append(f"{name} (time budget of {args.budget_s:.0f} s spent)")
            return None
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = guarded(report, name, fn, *a)
        report["stage_seconds"][name] = report["stage_seconds"].get(name, 0.0) + time.perf_counter() - t0
        return res

    precision = "bf16" if gpu and not quick else "fp32"
    report["tests"] = timed("tests", stage_tests, sys.executable, quick)
    # The kernel benchmark's quick shapes (BERT-base width, 64 x 128 and 16 x 512, bf16): every SDPA
    # backend and varlen_attn within the time budget; `python benchmarks/kernels.py` runs them all.
    report["kernels"] = timed("kernels", stage_kernels, True, env["device_type"])
    old_cache = os.environ.get("BERTDIST_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bertdist_bench_") as tmp:
        # A fresh decision cache: this run measures on this device; ours-optimized then reuses it.
        os.environ["BERTDIST_CACHE_DIR"] = str(Path(tmp) / "kernel_cache")
        report["decisions"] = timed("decisions", stage_decisions, configs, env["device_type"], precision)
        import yaml

        recipe_seqs = {int(yaml.safe_load(r.read_text())["data"]["max_seq_length"]) for r in recipes}
        seqs = sorted({s for _, s, _ in configs} | recipe_seqs)
        # The recipes' records (and vocab) are built here; --lengths-from only feeds the throughput runs.
        built = timed("records", build_length_records, seqs, Path(tmp)) or {}
        vocab = str(Path(tmp) / "vocab.txt")
        if built:
            report["recipes"] = timed("recipes", stage_recipes, recipes, built, vocab, Path(tmp) / "runs", scale)
            report["auto_vs_reference"] = timed("auto_vs_reference", stage_auto_vs_reference,
                                                RECIPES / AUTO_VS_REFERENCE_RECIPE, built, vocab,
                                                Path(tmp) / "auto_vs_reference", scale, repeats)
        manifests = ({int(json.loads(Path(m).read_text())["records"]["max_seq_length"]): m for m in args.lengths_from}
                     if args.lengths_from else built)
        for preset, seq, batch in configs:
            manifest = (manifests or {}).get(seq) or next(iter((manifests or {}).values()), None)
            if manifest is None:
                continue
            failed_before = len(report["failed_stages"])
            r = timed("throughput", stage_throughput, preset, seq, batch, manifest, variants, steps, precision, False)
            if r is not None:
                report["throughput"].append(r)
            elif len(report["failed_stages"]) > failed_before:  # a variant raised: a failed row
                report["throughput"].append({"preset": preset, "seq": seq, "batch": batch,
                                             "failed": report["failed_stages"].pop()})
    if old_cache is None:
        os.environ.pop("BERTDIST_CACHE_DIR", None)
    else:
        os.environ["BERTDIST_CACHE_DIR"] = old_cache
    report["targets"] = targets(env, [r for r in report["throughput"] if "failed" not in r],
                                report["auto_vs_reference"], report["recipes"])
    report["seconds"] = time.perf_counter() - budget.start
    report["exit_status"] = exit_status(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")[:40]
    stem = out / f"acceptance_{slug}_{env['date'][:10]}"
    md = markdown(report)
    stem.with_suffix(".md").write_text(md)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    report["report"] = str(stem.with_suffix(".md"))
    print(md)
    print(f"[bench] report: {report['report']} ({report['seconds']:.0f} s, exit {report['exit_status']})",
          file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(main()["exit_status"])
