"""The one-command GPU acceptance (``bertdist bench``): training throughput, kernels, tests, one report.

It fits one time slot: ``--deadline-s`` is checked before every run, each run's timeout is capped
by the time left, and the Markdown and JSON reports are rewritten after every run, so a kill at
any moment leaves a report of everything finished. The most valuable figures come first:

  1. BERT-large seq 128 bf16 training throughput (benchmarks/train_throughput.py, one child
     process): ours-optimized (kernels: auto, unpadded, sparse MLM head) against HF
     BertForPreTraining + SDPA and HF + SDPA + ``torch.compile``, all built in the same process
     and timed interleaved (rounds that rotate the order); row lengths from real records;
  2. "kernels: auto never slower than reference": ``bertdist pretrain`` of the bert-large-phase1
     recipe with ``kernels: auto`` and with ``kernels: reference``, runs interleaved (the order
     flips per repeat); "NOT met" when auto's median step is slower than reference's by more
     than the spread of either side's runs. Its auto runs also give the trainer's own seq/s and
     MFU for the H100/H200 targets;
  3. ``bertdist pretrain`` of the remaining recipes at seq 128 (configs/pretrain/*.yaml), with the
     recipe's optimizer, precision, ``unpad``, kernels and ``model.compile``, scaled only in the
     global batch (one micro-batch, one process) and the step count; the trainer's metrics.jsonl;
  4. seq 512: the throughput comparison and the seq-512 recipes;
  5. BERT-base at seq 128, the GPU tests (``pytest -m gpu``; no test collected is a failure), the
     kernel benchmark (benchmarks/kernels.py) and the kernels: auto decision tables.

Records come from ``--kit`` (a GPU kit's pre-built records: no Beam needed), ``--records``, or are
built here from the bundled samples. Targets are judged per device with that device's own peak
(H100 and H200). On CPU the same command runs a quick variant (small models, a few steps), so CI
proves the harness end to end; its numbers are not GPU claims.

A stage, run or variant that fails is a failed row; one the deadline leaves out is a skipped row;
``exit_status`` is 1 when anything failed or a target is "NOT met".

    bertdist bench --out OUT --deadline-s 480     # or: python benchmarks/acceptance.py
    bertdist bench --quick                        # the CPU variant's sizes on any device
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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GPU_TEST_FILES = ("tests/ops/test_fused_gpu.py", "tests/ops/test_torch_native_gpu.py")
# Targets for one H100 (and one H200, judged against its own peak); reported, never asserted.
TARGET_DEVICES = re.compile(r"\b(H100|H200)\b")
TARGET_LARGE_128_SEQ_PER_S = 1850
TARGET_LARGE_128_MFU = 0.45
TARGET_VS_HF = 1.5
TARGET_VS_HF_COMPILE = 1.2
TARGET_ELECTRA_STEP_RATIO = 1.35  # ELECTRA's step over an MLM step of the same discriminator
# The trainer's own step, in the side-by-side benchmark (train_throughput's ours-trainer).
TRAINER_VARIANT = "ours-trainer"
# The same step with model.cuda_graphs=true: its time against ours-trainer's is what graphs' auto waits for.
GRAPHS_VARIANT = "ours-trainer-graphs"
MODEL_ONLY_VARIANT = "ours-reference-compile"  # the same model and compile, torch's AdamW, no trainer
TARGET_TRAINER_VS_HF_COMPILE = 1.25
TARGET_TRAINER_OVER_MODEL = 1.10  # the trainer's step time over the model-only step's, at most
# (preset, seq, batch) in the order they are measured: the target configuration first.
GPU_CONFIGS = [("large", 128, 64), ("large", 512, 16), ("base", 128, 64), ("base", 512, 16)]
CPU_CONFIGS = [("mini", 64, 2)]
GPU_VARIANTS = "ours-optimized,hf-sdpa,hf-sdpa-compile"
CPU_VARIANTS = "ours-optimized,ours-reference,hf-sdpa,hf-sdpa-compile"
RECIPES = REPO / "configs" / "pretrain"
# The recipe whose whole training steps compare kernels: auto with kernels: reference (the H100 target's).
AUTO_VS_REFERENCE_RECIPE = "bert-large-phase1.yaml"
RUN_TIMEOUT_S = 600.0  # one child run at most, before the deadline caps it
STAGES = ("records", "throughput", "auto_vs_reference", "recipes", "tests", "kernels", "decisions")


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


def _command_output(cmd: list[str]) -> str | None:
    """A tool's output, or None where it is missing or fails (git and nvidia-smi may be absent)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def environment(torch, kit: dict | None = None) -> dict:
    gpu = torch.cuda.is_available()
    rev = _command_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = _command_output(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    env = {
        "device": torch.cuda.get_device_name() if gpu else f"CPU ({platform.processor() or platform.machine()}, "
                                                             f"{torch.get_num_threads()} torch threads)",
        "device_type": "cuda" if gpu else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
        "cudnn": str(torch.backends.cudnn.version()) if gpu else "n/a",
        "driver": (_command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or
                   "unknown (nvidia-smi not found)").splitlines()[0] if gpu else "n/a",
        "deepspeed": _version("deepspeed"), "transformers": _version("transformers"),
        "bertdist": f"{_version('bertdist').replace('not installed', 'source checkout')} "
                    f"(git {rev or 'unknown: no git or no repository'}"
                    f"{', uncommitted changes' if dirty else ''})",
    }
    if gpu:
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible"
    if kit:
        env["kit"] = (f"image {kit['image']['name']}, built {kit['built']} from git {kit['built_with']['bertdist_git']}; "
                      + ", ".join(f"{w['name']} {w['version']}" for w in kit["wheels"]))
    return env


class Deadline:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def cap(self, timeout: float = RUN_TIMEOUT_S) -> float:
        """A run's timeout: its own limit, or the time left if that is less."""
        return max(0.0, min(timeout, self.left()))


# ---------------------------------------------------------------- stages


def run_child(cmd: list[str], timeout: float, cwd: Path = REPO, env: dict | None = None) -> dict:
    """A child process killed with its whole process group at ``timeout``: returncode, output, seconds."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        timed_out = True
    return {"returncode": p.returncode, "output": out or "", "seconds": time.perf_counter() - t0, "timed_out": timed_out}


def stage_tests(python: str, quick: bool, deadline: Deadline) -> dict:
    """pytest -m gpu in a child process (skips cleanly without CUDA)."""
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs", *GPU_TEST_FILES]
    r = run_child(cmd, deadline.cap())
    out = r["output"]
    summary = next((ln.strip("= ") for ln in reversed(out.splitlines()) if re.search(r"\b(passed|failed|skipped|error)", ln)), "")
    if r["timed_out"]:
        summary = f"timed out after {r['seconds']:.0f} s (deadline); {summary}"
    return {"command": shlex.join(cmd), "returncode": 1 if r["timed_out"] else r["returncode"], "summary": summary,
            "seconds": r["seconds"], "output": out[-20000:]}


def stage_kernels(quick: bool, device_type: str) -> dict:
    kernels = _load("kernels")
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        data = kernels.run(["--device", device_type, *(["--quick"] if quick else [])])
    return {"seconds": time.perf_counter() - t0, "output": buf.getvalue(), **data}


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


def _budget_arg(text: str) -> str:
    """--kernels-budget-s, checked here by train_throughput's own parser (before any run) and
    passed on to it as given."""
    _load("train_throughput")._budget_seconds(text)
    return text


def throughput_extra(args, preset: str, seq: int) -> tuple[str, ...]:
    """The bench's options that train_throughput takes as they are, for one configuration."""
    extra: tuple[str, ...] = ("--profile-steps", str(args.profile_steps)) if args.profile_steps else ()
    if args.compile_cache_dir:
        extra += ("--compile-cache", str(Path(args.compile_cache_dir).resolve() / f"compile_cache_{preset}_{seq}.bin"))
    if args.kernels_budget_s is not None:
        extra += ("--kernels-budget-s", args.kernels_budget_s)
    return extra


def stage_throughput(preset: str, seq: int, batch: int, manifest: str | None, variants: str, steps: int | None,
                     precision: str | None, rounds: int, deadline: Deadline, extra: tuple[str, ...] = ()) -> dict:
    """benchmarks/train_throughput.py in a child process (killed at the deadline): every variant
    built in that one process and timed interleaved, ``rounds`` rounds that rotate the order.
    Without ``steps`` (the GPU default): 5 distinct batches, 10 warm-up steps and 10 steps a round,
    so that each round of the trainer's step holds exactly one of its settles (one per 10 steps)."""
    argv = ["--preset", preset, "--seq", str(seq), "--batch", str(batch), "--variants", variants,
            "--interleave", str(rounds), "--keep-going", *extra]
    argv += ["--lengths-from", manifest] if manifest else []
    if steps:
        argv += ["--steps", str(steps), "--warmup", "1", "--num-batches", str(min(2, steps))]
    else:
        argv += ["--steps", str(10 * rounds), "--warmup", "10", "--num-batches", "5"]
    if precision:
        argv += ["--precision", precision]
    with tempfile.TemporaryDirectory(prefix="bench_throughput_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), *argv, "--json", str(out)]
        r = run_child(cmd, deadline.cap())
        if r["timed_out"] or r["returncode"] != 0 or not out.is_file():
            why = (f"timed out after {r['seconds']:.0f} s (deadline)" if r["timed_out"]
                   else f"exit {r['returncode']}")
            raise RuntimeError(f"train_throughput {preset} seq {seq}: {why}: "
                               + " | ".join(r["output"].strip().splitlines()[-8:])[-1500:])
        res = json.loads(out.read_text())
    res["seconds"] = r["seconds"]
    res["failed_variants"] = res.pop("failed", {})  # a variant that raised: a failed row, the others ran
    res["output"] = r["output"]
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
    profile_steps: int = 0  # the last steps of each run under torch.profiler (profiling.*), out of the medians

    @classmethod
    def for_device(cls, gpu: bool, quick: bool, steps: int | None = None, profile: bool = False) -> "RecipeScale":
        if gpu and not quick:
            scale = cls(steps=steps or 30, skip_steps=5, profile_steps=PROFILE_STEPS if profile else 0)
        else:
            scale = cls(steps=max(steps or 4, 2), skip_steps=1, model_preset="tiny", micro_batch=4,
                        profile_steps=1 if profile else 0)
        least = scale.skip_steps + scale.profile_steps + 1
        if profile and scale.steps < least:
            raise SystemExit(f"--profile: {scale.steps} steps per recipe run leave none to time after the "
                             f"{scale.skip_steps} warm-up and {scale.profile_steps} profiled steps; use "
                             f"--recipe-steps {least} or more")
        return scale

    @property
    def profile_start(self) -> int:
        return self.steps - self.profile_steps + 1

    def describe(self) -> str:
        what = ["global batch = one micro-batch (accumulation 1, one process)", f"{self.steps} steps"]
        if self.profile_steps:
            what.append(f"steps {self.profile_start}-{self.steps} under torch.profiler (left out of the medians)")
        if self.model_preset:
            what.append(f"model preset {self.model_preset}")
        if self.micro_batch:
            what.append(f"micro batch {self.micro_batch}")
        return ("scaled: " + ", ".join(what) + "; phase 2 recipes start from fresh weights instead of their phase 1 "
                "checkpoint; everything else as in the recipe")


def recipe_command(recipe: Path, manifest: str, vocab: str, run_dir: Path, scale: RecipeScale,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """``bertdist pretrain RECIPE`` with the scaling overrides (and no checkpoints or evaluation)."""
    data = _recipe(recipe)
    micro = scale.micro_batch or int(data["data"]["micro_batch_size"])
    args = [str(recipe), f"run_dir={run_dir}", f"data.train_manifest={manifest}", f"data.vocab_file={vocab}",
            f"data.micro_batch_size={micro}", f"data.global_batch_size={micro}", f"max_steps={scale.steps}",
            "data.eval_split=null", "checkpoint.every_steps=0", "checkpoint.save_at_end=false",
            "checkpoint.save_on_sigterm=false", "eval.at_start=false", "eval.at_end=false", "eval.every_steps=0",
            "logging.progress=none", "logging.tensorboard=false"]
    if scale.model_preset:
        args.append(f"model.preset={scale.model_preset}")
    if scale.profile_steps:
        args += ["profiling.enabled=true", f"profiling.start_step={scale.profile_start}",
                 f"profiling.num_steps={scale.profile_steps}", "profiling.trace=false"]
    if (data.get("checkpoint") or {}).get("init_from"):
        # A phase 2 starts from its phase 1's checkpoint; the time of a step does not depend on the weights.
        args.append("checkpoint.init_from=null")
    return [sys.executable, "-m", "bertdist.cli.pretrain", *args, *extra]


def trainer_metrics(run_dir: Path, skip_steps: int) -> dict:
    """Medians of the trainer's own per-step metrics (metrics.jsonl), after ``skip_steps``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    unprofiled = [r for r in train if not r.get("profiled")]
    timed = [r for r in train[skip_steps:] if not r.get("profiled")] or unprofiled[-1:] or train[-1:]
    if not timed:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'} holds no training step")
    run = next((r for r in rows if r["kind"] == "run"), {})
    out = {k: statistics.median(r[k] for r in timed) for k in ("seq_per_s", "tokens_per_s", "mfu", "step_time_s")}
    return {**out, "steps_timed": len(timed), "steps_run": len(train), "peak_note": run.get("peak_note", ""),
            "compiled": run.get("compile")}


def run_recipe(recipe: Path, manifest: str, vocab: str, out_dir: Path, scale: RecipeScale,
               extra: tuple[str, ...] = (), timeout: float = RUN_TIMEOUT_S) -> dict:
    """One timed ``bertdist pretrain`` run: a row with the recipe's resolved settings and the
    trainer's metrics, a failed row with the error, or a skipped row when ``timeout`` is 0
    (never an exception)."""
    import yaml

    run_dir = out_dir / (recipe.stem + "".join("_" + re.sub(r"[^a-z0-9]+", "-", e.lower()) for e in extra))
    cmd = recipe_command(recipe, manifest, vocab, run_dir, scale, extra)
    row = {"recipe": recipe.name, "command": shlex.join(cmd), "scaled": scale.describe(), "status": "failed",
           **({"overrides": list(extra)} if extra else {})}
    if timeout <= 0:
        return {**row, "status": "skipped", "error": "deadline reached before it could start"}
    r = run_child(cmd, timeout)
    row["seconds"] = r["seconds"]
    if r["timed_out"] and timeout < RUN_TIMEOUT_S:  # the deadline capped it: left out, not failed
        return {**row, "status": "skipped", "error": f"cut off by the deadline after {timeout:.0f} s"}
    if r["timed_out"]:
        return {**row, "error": f"timed out after {timeout:.0f} s"}
    if r["returncode"] != 0:
        tail = r["output"].strip().splitlines()[-12:]
        return {**row, "error": f"exit {r['returncode']}: " + " | ".join(tail)[-1500:]}
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        row.update(optimizer=cfg["optimizer"]["name"], precision=cfg["deepspeed"]["precision"],
                   zero_stage=cfg["deepspeed"]["zero_stage"], unpad=cfg["model"]["unpad"],
                   kernels=cfg["model"]["kernels"], compile=cfg["model"].get("compile"),
                   model=cfg["model"]["preset"], seq=cfg["data"]["max_seq_length"],
                   micro_batch=cfg["data"]["micro_batch_size"], **trainer_metrics(run_dir, scale.skip_steps))
    except Exception as e:  # noqa: BLE001 - a run without readable metrics is a failed row
        return {**row, "error": f"{type(e).__name__}: {e}"}
    profile = run_dir / "profile" / "rank0.summary.json"
    if profile.is_file():
        row["profile"] = json.loads(profile.read_text())
    row["status"] = "ok"
    return row


def stage_recipes(recipes: list[Path], manifests: dict[str, dict[int, str]], vocab: str, out_dir: Path,
                  scale: RecipeScale, deadline: Deadline, rows: list[dict], saved=lambda: None,
                  overrides: tuple[str, ...] = ()) -> list[dict]:
    """Each recipe once, appended to ``rows`` (the report's list) and saved after every run. An
    ELECTRA recipe runs a second time with ``electra=null``: the same discriminator trained by MLM,
    the denominator of ELECTRA's step-cost ratio."""
    for recipe in recipes:
        print(f"[bench] pretrain {recipe.name} ...", file=sys.stderr, flush=True)
        try:
            manifest = _manifest_for(recipe, manifests)
        except ValueError as e:
            rows.append({"recipe": recipe.name, "status": "failed", "error": str(e), "scaled": scale.describe(),
                         "command": "-"})
            saved()
            continue
        rows.append(run_recipe(recipe, manifest, vocab, out_dir, scale, overrides, timeout=deadline.cap()))
        saved()
        if _is_electra(recipe) and rows[-1]["status"] == "ok":
            rows.append(run_recipe(recipe, manifest, vocab, out_dir, scale, (*overrides, *ELECTRA_AS_MLM),
                                   timeout=deadline.cap()))
            saved()
    return rows


# Steps of each recipe run under torch.profiler with --profile (the run's last ones).
PROFILE_STEPS = 3
# Rows of each top-operators list in the report's profile section.
PROFILE_TOP = 8

# The override that trains an ELECTRA recipe's discriminator by MLM alone (same model, data, batch).
ELECTRA_AS_MLM = ("electra=null",)


def _is_electra(recipe: Path) -> bool:
    return _recipe(recipe).get("electra") is not None


def electra_step_ratios(recipes: list[dict]) -> list[dict]:
    """ELECTRA's step time over MLM's, per ELECTRA recipe with both rows measured."""
    out = []
    for r in recipes:
        overrides = r.get("overrides") or []
        if r["status"] != "ok" or ELECTRA_AS_MLM[0] in overrides:
            continue
        twin = [*overrides, *ELECTRA_AS_MLM]
        mlm = next((m for m in recipes if m["recipe"] == r["recipe"] and m.get("overrides") == twin
                    and m["status"] == "ok"), None)
        if mlm is not None:
            out.append({"recipe": _recipe_label(r), "electra_ms": r["step_time_s"] * 1e3,
                        "mlm_ms": mlm["step_time_s"] * 1e3,
                        "ratio": r["step_time_s"] / mlm["step_time_s"]})
    return out


def _recipe(recipe: Path) -> dict:
    """The recipe file's mapping, as written (no overrides, no defaults)."""
    import yaml

    return yaml.safe_load(recipe.read_text())


def _seq_of(recipe: Path) -> int:
    return int(_recipe(recipe)["data"]["max_seq_length"])


def _records_kind(recipe: Path) -> str:
    """The kind of records (bertdist/gpu_kit/records.py) the recipe's data.masking reads."""
    from bertdist.gpu_kit import records

    return records.kind_for_masking(_recipe(recipe)["data"].get("masking", "auto"))


def _manifest_for(recipe: Path, manifests: dict[str, dict[int, str]]) -> str:
    seq, kind = _seq_of(recipe), _records_kind(recipe)
    have = manifests.get(kind, {})
    if seq not in have:
        raise ValueError(f"no {kind} records with max_seq_length {seq} for {recipe.name} (have {kind} records at "
                         f"seq {sorted(have)})")
    return have[seq]


def compare_auto_reference(auto_s: list[float], reference_s: list[float]) -> dict:
    """The verdict on per-run median step times: "NOT met" when auto's median is slower than
    reference's by more than the spread (the larger max - min of the two sides' runs)."""
    if not auto_s or not reference_s:
        return {"verdict": "NOT met (no measurement)", "auto_s": auto_s, "reference_s": reference_s}
    a, r = statistics.median(auto_s), statistics.median(reference_s)
    spread = max(max(auto_s) - min(auto_s), max(reference_s) - min(reference_s))
    return {"auto_s": auto_s, "reference_s": reference_s, "auto_median_s": a, "reference_median_s": r,
            "spread_s": spread, "auto_slower_by_s": a - r, "verdict": "NOT met" if a - r > spread else "met"}


def stage_auto_vs_reference(recipe: Path, manifests: dict[str, dict[int, str]], vocab: str, out_dir: Path,
                            scale: RecipeScale, repeats: int, deadline: Deadline, res: dict,
                            saved=lambda: None) -> dict:
    """Whole training steps with kernels: auto and kernels: reference, interleaved (the order
    alternates per repeat) and repeated; each run contributes its median step time. ``res`` (the
    report's entry) is filled in and saved after every run."""
    manifest = _manifest_for(recipe, manifests)
    times: dict[str, list[float]] = {"auto": [], "reference": []}
    res.update(recipe=recipe.name, scaled=scale.describe(), repeats=repeats, runs=[])
    runs = res["runs"]
    for i in range(repeats):
        for mode in (("auto", "reference") if i % 2 == 0 else ("reference", "auto")):
            print(f"[bench] auto vs reference: {recipe.name} kernels={mode} ({i + 1}/{repeats}) ...",
                  file=sys.stderr, flush=True)
            row = run_recipe(recipe, manifest, vocab, out_dir / f"repeat{i}", scale, (f"model.kernels={mode}",),
                             timeout=deadline.cap())
            runs.append({"kernels": mode, "repeat": i, **row})
            if row["status"] == "ok":
                times[mode].append(row["step_time_s"])
            res.update(compare_auto_reference(times["auto"], times["reference"]))
            saved()
    failed = [r for r in runs if r["status"] == "failed"]
    if failed:
        res["verdict"] = f"NOT met ({len(failed)} of {len(runs)} runs failed)"
    return res


def large_trainer_figures(recipes: list[dict] | None, auto_ref: dict | None) -> dict | None:
    """The trainer's own seq/s and MFU for bert-large-phase1 with kernels: auto: its recipe row,
    else the median of the auto runs of the auto-vs-reference stage."""
    row = next((r for r in recipes or [] if r["recipe"] == AUTO_VS_REFERENCE_RECIPE and r["status"] == "ok"), None)
    if row:
        return {"seq_per_s": row["seq_per_s"], "mfu": row["mfu"], "source": "bertdist pretrain, recipe run"}
    auto = [r for r in (auto_ref or {}).get("runs", []) if r["kernels"] == "auto" and r["status"] == "ok"]
    if auto:
        return {"seq_per_s": statistics.median(r["seq_per_s"] for r in auto),
                "mfu": statistics.median(r["mfu"] for r in auto),
                "source": f"bertdist pretrain, median of {len(auto)} kernels: auto run(s)"}
    return None


def target_device(env: dict) -> str | None:
    """"H100" or "H200" where the targets apply (each judged with its own peak), else None."""
    m = TARGET_DEVICES.search(env["device"]) if env["device_type"] == "cuda" else None
    return m.group(1) if m else None


def targets(env: dict, runs: list[dict], auto_ref: dict | None,
            recipes: list[dict] | None = None) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) rows. seq/s and MFU are the trainer's own (bert-large-phase1
    with kernels: auto) and the side-by-side benchmark's ours-optimized at large seq 128; the
    ratios to HF come from the side-by-side runs, measured in one process."""
    gpu = env["device_type"] == "cuda"
    dev = target_device(env)
    out = []
    large = large_trainer_figures(recipes, auto_ref)
    tp = next((r for r in runs if r["preset"] == "large" and r["seq"] == 128), None)
    ours_tp = (tp or {}).get("variants", {}).get("ours-optimized")
    in_bench = any(n.startswith(TRAINER_VARIANT) for n in (tp or {}).get("variants", {}))
    if dev:
        for figures, source in ((large, (large or {}).get("source")), (ours_tp, "train_throughput ours-optimized")):
            if not figures and in_bench:  # the trainer's step was measured in the bench: its rows judge it
                continue
            if not figures:
                out.append((f"BERT-large seq 128 bf16, one {dev}: >= {TARGET_LARGE_128_SEQ_PER_S:,} seq/s, "
                            f">= {TARGET_LARGE_128_MFU:.0%} MFU", "-", "NOT met (no measurement)"))
                continue
            out.append((f"BERT-large seq 128 bf16, one {dev}: >= {TARGET_LARGE_128_SEQ_PER_S:,} seq/s ({source})",
                        f"{figures['seq_per_s']:,.0f} seq/s",
                        "met" if figures["seq_per_s"] >= TARGET_LARGE_128_SEQ_PER_S else "NOT met"))
            out.append((f"BERT-large seq 128 bf16, one {dev}: >= {TARGET_LARGE_128_MFU:.0%} MFU, {dev} peak ({source})",
                        f"{figures['mfu']:.1%}", "met" if figures["mfu"] >= TARGET_LARGE_128_MFU else "NOT met"))
    else:
        out.append((f"BERT-large seq 128 bf16 on one H100 or H200: {TARGET_LARGE_128_SEQ_PER_S:,} seq/s, "
                    f"{TARGET_LARGE_128_MFU:.0%} MFU", "-", f"n/a on {env['device']}"))
    out += trainer_targets(runs, dev, gpu)
    for r in runs:
        variants = r.get("variants", {})
        o = variants.get("ours-optimized")
        if o is None and any(n.startswith(TRAINER_VARIANT) for n in variants):  # judged by the trainer's rows
            continue
        for base, goal in (("hf-sdpa", TARGET_VS_HF), ("hf-sdpa-compile", TARGET_VS_HF_COMPILE)):
            label = f"{r['preset']} seq {r['seq']}: ours-optimized >= {goal}x {base} seq/s (same process, interleaved)"
            hf = variants.get(base)
            if o and hf:
                ratio = o["seq_per_s"] / hf["seq_per_s"]
                verdict = ("met" if ratio >= goal else "NOT met") if gpu else "n/a (CPU: no GPU claim)"
                out.append((label, f"{ratio:.2f}x", verdict))
            elif gpu and r["preset"] == "large" and r["seq"] == 128:
                why = (r.get("skipped") or {}).get(base) or (r.get("failed_variants") or {}).get(base) or "not measured"
                out.append((label, "-", f"NOT met (no measurement: {why})"))
    if auto_ref is not None and auto_ref.get("recipe"):
        label = (f"kernels: auto never slower than kernels: reference (whole training steps of {auto_ref['recipe']}, "
                 f"{auto_ref['repeats']} interleaved runs each)")
        if "auto_median_s" in auto_ref:
            measured = (f"auto {1000 * auto_ref['auto_median_s']:.1f} ms vs reference "
                        f"{1000 * auto_ref['reference_median_s']:.1f} ms per step (spread "
                        f"{1000 * auto_ref['spread_s']:.1f} ms)")
        else:
            measured = "-"
        out.append((label, measured, auto_ref.get("verdict", "NOT met (no measurement)")))
    for e in electra_step_ratios(recipes or []):
        out.append((f"{e['recipe']}: ELECTRA step <= {TARGET_ELECTRA_STEP_RATIO}x the MLM step of the same "
                    f"discriminator ({' '.join(ELECTRA_AS_MLM)}, bertdist pretrain)",
                    f"{e['ratio']:.2f}x ({e['electra_ms']:.1f} ms vs {e['mlm_ms']:.1f} ms)",
                    ("met" if e["ratio"] <= TARGET_ELECTRA_STEP_RATIO else "NOT met") if gpu
                    else "n/a (CPU: no GPU claim)"))
    return out


def trainer_targets(runs: list[dict], dev: str | None, gpu: bool) -> list[tuple[str, str, str]]:
    """The trainer's own step (each ``ours-trainer*`` variant) in each side-by-side run: its speed against HF +
    SDPA + torch.compile, its MFU at BERT-large seq 128, and its step time against the model-only
    step of the same model (``ours-reference-compile``), all from the same process."""
    out = []
    for r, name in ((r, n) for r in runs for n in r.get("variants", {}) if n.startswith(TRAINER_VARIANT)):
        variants = r["variants"]
        t = variants[name]
        where = f"{r['preset']} seq {r['seq']} batch {r['batch']}, {name}"
        judged = (lambda ok: "met" if ok else "NOT met") if gpu else (lambda ok: "n/a (CPU: no GPU claim)")
        hf = variants.get("hf-sdpa-compile")
        label = (f"{where}: bertdist pretrain's step >= {TARGET_TRAINER_VS_HF_COMPILE}x hf-sdpa-compile seq/s "
                 "(same process, interleaved)")
        if hf:
            ratio = t["seq_per_s"] / hf["seq_per_s"]
            out.append((label, f"{ratio:.2f}x ({t['seq_per_s']:,.0f} vs {hf['seq_per_s']:,.0f} seq/s)",
                        judged(ratio >= TARGET_TRAINER_VS_HF_COMPILE)))
        elif gpu:
            why = (r.get("skipped") or {}).get("hf-sdpa-compile") or "not measured"
            out.append((label, "-", f"NOT met (no measurement: {why})"))
        model = variants.get(MODEL_ONLY_VARIANT)
        if model:
            over = t["step_s"] / model["step_s"]
            out.append((f"{where}: bertdist pretrain's step <= {TARGET_TRAINER_OVER_MODEL}x the model-only step "
                        f"({MODEL_ONLY_VARIANT})", f"{over:.2f}x ({1e3 * t['step_s']:.1f} vs "
                        f"{1e3 * model['step_s']:.1f} ms)", judged(over <= TARGET_TRAINER_OVER_MODEL)))
        plain = variants.get(TRAINER_VARIANT)
        if name == GRAPHS_VARIANT and plain:  # no target: the measurement model.cuda_graphs: auto waits for
            ratio = t["step_s"] / plain["step_s"]
            out.append((f"{where}: step time with CUDA graphs / without ({TRAINER_VARIANT}); decides "
                        "model.cuda_graphs: auto (bertdist/train/cuda_graphs.py)",
                        f"{ratio:.2f}x ({1e3 * t['step_s']:.1f} vs {1e3 * plain['step_s']:.1f} ms)",
                        ("faster" if ratio < 1 else "not faster") if gpu else "n/a (CPU: no GPU claim)"))
        if dev and r["preset"] == "large" and r["seq"] == 128:
            out.append((f"BERT-large seq 128 bf16, one {dev}: >= {TARGET_LARGE_128_MFU:.0%} MFU, {dev} peak "
                        f"(bertdist pretrain's step, train_throughput {name})", f"{t['mfu']:.1%} "
                        f"({t['seq_per_s']:,.0f} seq/s)", judged(t["mfu"] >= TARGET_LARGE_128_MFU)))
    return out


def _recipe_label(row: dict) -> str:
    return row["recipe"] + "".join(f" `{o}`" for o in row.get("overrides") or [])


def exit_status(report: dict) -> int:
    """1 when anything failed or a target is not met: a set-up step of the node script, a GPU test
    (pytest's exit 5, no test collected, included), a stage, a recipe run, a throughput
    configuration; else 0. What the deadline left out is a skipped row, not a failure."""
    if any(r["status"] == "failed" for r in report.get("setup") or []):
        return 1
    tests = report.get("tests")
    if tests is not None and tests.get("returncode") != 0:
        return 1
    if report.get("failed_stages") or any(r["status"] == "failed" for r in report.get("recipes") or []):
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


def _cell(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def profile_section(recipes: list[dict]) -> list[str]:
    """Where each profiled recipe run's step time goes (bertdist/train/profiling.py's summary)."""
    rows = [r for r in recipes if r.get("status") == "ok" and r.get("profile")]
    if not rows:
        return []
    parts = ("forward", "metrics", "backward", "optimizer_step")
    lines = ["", "## Where the step time goes (torch.profiler)", "",
             "Per step, over the profiled steps of each run above. Device busy: the union of the GPU's kernel and "
             "copy intervals (collectives apart). Each part of the step: its wall time on the host's clock (waits "
             "for the device included) and the aten operator calls that started in it on any thread (nested calls "
             "and views included). A step whose device is busy for a small part of its wall time is bound by the "
             "host, not by arithmetic.", "",
             "| recipe | wall (ms) | device busy (ms) | busy | kernels | aten calls | "
             + " | ".join(f"{p} ms (calls)" for p in parts) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(parts)]

    def part(reg: dict) -> str:
        calls = reg.get("aten_calls_per_step")
        return f"{reg['wall_ms_per_step']:.1f}" + ("" if calls is None else f" ({calls:,.0f})")

    for r in rows:
        p = r["profile"]
        reg = p.get("regions", {})
        cells = [_cell(p["wall_ms_per_step"], ".1f"), _cell(p.get("device_busy_ms_per_step"), ".1f"),
                 _cell(p.get("device_busy_fraction"), ".0%"), _cell(p.get("kernels_per_step"), ",.0f"),
                 _cell(p.get("aten_calls_per_step"), ",.0f")] + [part(reg[k]) if k in reg else "-" for k in parts]
        lines.append(f"| {_recipe_label(r)} | " + " | ".join(cells) + " |")
    notes = list(dict.fromkeys(r["profile"]["note"] for r in rows if r["profile"].get("note")))
    lines += [""] + notes if notes else []
    for r in rows:
        p = r["profile"]
        if "error" in p:
            lines += ["", f"{_recipe_label(r)}: the profile could not be summarised: {p['error']}"]
            continue
        lines += ["", f"{_recipe_label(r)}, top operators (ms per step):", "",
                  "| by host time | calls | host ms | | by device time | calls | device ms |",
                  "|---|---:|---:|---|---|---:|---:|"]
        host = p.get("top_by_self_cpu", [])[:PROFILE_TOP]
        dev = p.get("top_by_self_device", [])[:PROFILE_TOP]
        steps = p["steps"]
        for i in range(max(len(host), len(dev))):
            a = host[i] if i < len(host) else None
            b = dev[i] if i < len(dev) else None
            left = f"`{a['op']}` | {a['calls'] / steps:,.0f} | {a['self_cpu_ms'] / steps:.2f}" if a else " | |"
            right = f"`{b['op'][:60]}` | {b['calls'] / steps:,.0f} | {b['self_device_ms'] / steps:.2f}" if b else " | |"
            lines.append(f"| {left} | | {right} |")
    return lines


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU acceptance ({'quick CPU variant' if env['device_type'] == 'cpu' else 'CUDA'}): {env['device']}", "",
             f"- date: {env['date']}", f"- command: `{report['command']}`",
             "- versions: " + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda", "cudnn", "driver",
                                                                   "deepspeed", "transformers", "bertdist") if k in env),
             f"- wall time: {report['seconds']:.0f} s (deadline {report['deadline_s']:.0f} s); per stage: "
             + ", ".join(f"{k} {v:.0f} s" for k, v in report["stage_seconds"].items())]
    if env.get("gpu"):
        lines.append(f"- GPU: {env['gpu']}")
    if env.get("kit"):
        lines.append(f"- GPU kit: {env['kit']}")
    progress = report.get("progress")
    if progress:
        lines.append("- stages: " + "; ".join(f"{k} {v}" for k, v in progress.items()))
    if env["device_type"] == "cpu":
        lines += ["", "No CUDA device: this is the quick CPU variant (small models, a few steps). It shows the "
                  "harness working end to end; none of its numbers is a GPU figure."]
    setup = report.get("setup")
    if setup:
        lines += ["", "## Node set-up (the GPU kit's run.sh)", "", "| step | status | seconds | detail |", "|---|---|---:|---|"]
        for r in setup:
            detail = " / ".join(x.strip() for x in r["detail"].splitlines()[-4:]).replace("|", "\\|")
            lines.append(f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {detail[:600]} |")
    lines += ["", "## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in report["targets"]]
    for f in report.get("failed_stages") or []:
        lines.append(f"\nFAILED stage: {f}")
    for sk in report["skipped_stages"]:
        lines.append(f"\nSkipped: {sk}")
    recipes = report.get("recipes")
    if recipes:
        lines += ["", "## bertdist pretrain, each shipped recipe (the trainer's own metrics)", "",
                  f"{recipes[0]['scaled']}. Medians over the steps after the first ones (metrics.jsonl).", "",
                  "| recipe | model | seq | micro | optimizer | precision | ZeRO | unpad | kernels | compile | seq/s | "
                  "real tok/s | MFU | step (ms) |", "|---|---|---:|---:|---|---|---:|---|---|---|---:|---:|---:|---:|"]
        for r in recipes:
            if r["status"] != "ok":
                lines.append(f"| {_recipe_label(r)} | {r['status'].upper()}: {r['error']} | | | | | | | | | | | | |")
                continue
            lines.append(f"| {_recipe_label(r)} | {r['model']} | {r['seq']} | {r['micro_batch']} | {r['optimizer']} | "
                         f"{r['precision']} | {r['zero_stage']} | {r['unpad']} | {r['kernels']} | "
                         f"{r['compile']} ({'compiled' if r.get('compiled') else 'eager'}) | "
                         f"{r['seq_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.2f}% | "
                         f"{1000 * r['step_time_s']:.1f} |")
        lines += ["", "Commands: " + "; ".join(f"`{r['command']}`" for r in recipes[:1]) + " (and likewise per recipe)."]
        lines += profile_section(recipes)
    ar = report.get("auto_vs_reference")
    if ar and ar.get("recipe"):
        lines += ["", f"## kernels: auto vs kernels: reference, whole training steps ({ar['recipe']})", "",
                  f"{ar['scaled']}. Runs alternate auto/reference (the order flips every repeat); each run gives "
                  f"its median step time.", "", "| run | kernels | step (ms) | status |", "|---:|---|---:|---|"]
        for r in ar["runs"]:
            step = f"{1000 * r['step_time_s']:.1f}" if r["status"] == "ok" else "-"
            lines.append(f"| {r['repeat'] + 1} | {r['kernels']} | {step} | {r['status']}"
                         f"{': ' + r.get('error', '') if r['status'] != 'ok' else ''} |")
        if "auto_median_s" in ar:
            lines += ["", f"Median: auto {1000 * ar['auto_median_s']:.1f} ms, reference "
                          f"{1000 * ar['reference_median_s']:.1f} ms; spread {1000 * ar['spread_s']:.1f} ms; "
                          f"auto slower by {1000 * ar['auto_slower_by_s']:.1f} ms: {ar['verdict']}."]
        else:
            lines += ["", f"Verdict: {ar.get('verdict', 'no measurement yet')}."]
    lines += ["", "## Training throughput (same batches for every variant; all variants in one process, timed "
              "interleaved)", "",
              "| config | precision | variant | seq/s | real tok/s | MFU (real tokens) | peak mem (MiB) | seq/s vs HF+SDPA |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in report["throughput"]:
        for name, v in r.get("variants", {}).items():
            ratio = (v.get("vs_hf_sdpa") or {}).get("seq_per_s")
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | {r['precision']} | {name} | {v['seq_per_s']:.1f} | "
                         f"{v['real_tokens_per_s']:,.0f} | {100 * v['mfu']:.2f}% | "
                         f"{'-' if v.get('peak_mem_bytes') is None else format(v['peak_mem_bytes'] / 2**20, ',.0f')} | "
                         f"{f'{ratio:.2f}x' if ratio else '-'} |")
        if "failed" in r:
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | - | - | FAILED: {r['failed']} | | | | |")
        for name, why in r.get("failed_variants", {}).items():
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | {r.get('precision', '-')} | {name} | FAILED: {why} | | | | |")
        for name, why in r.get("skipped", {}).items():
            lines.append(f"| {r['preset']} b{r['batch']} s{r['seq']} | {r.get('precision', '-')} | {name} | skipped: {why} | | | | |")
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the CPU variant's sizes (automatic without CUDA)")
    ap.add_argument("--out", default=str(RESULTS), help="folder for the report (default benchmarks/results)")
    ap.add_argument("--deadline-s", type=float, default=570.0,
                    help="wall-clock deadline in seconds: checked before every run, caps each run's timeout")
    ap.add_argument("--kit", help="a GPU kit folder: its pre-built records, and its versions in the report")
    ap.add_argument("--records", help="pre-built records: a folder with vocab.txt and records_SEQ/ (default: "
                                      "the kit's, else built here from the bundled samples with Beam)")
    ap.add_argument("--setup-json", help="the node script's set-up rows (install, builds) to list first")
    ap.add_argument("--lengths-from", nargs="+", metavar="MANIFEST",
                    help="records whose row lengths the throughput runs sample (one per seq, matched by their "
                         "max_seq_length; others are rescaled); default: the bench's records")
    ap.add_argument("--configs", help="preset:seq:batch,... in the order to measure (default on CUDA: "
                                      "large:128:64,large:512:16,base:128:64,base:512:16)")
    ap.add_argument("--variants", help=f"train_throughput variants (default on CUDA: {GPU_VARIANTS})")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved rounds of the throughput variants (default 5 on CUDA, 2 on CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 30 on CUDA, 2 on CPU)")
    ap.add_argument("--recipes", help="comma-separated recipe files under configs/pretrain (default: all)")
    ap.add_argument("--recipe-overrides", default="",
                    help="comma-separated dotted overrides for every recipe run (e.g. model.compile=true)")
    ap.add_argument("--recipe-steps", type=int, default=None,
                    help="steps of each bertdist pretrain run (default 30 on CUDA, 4 on CPU)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved runs of each side for auto vs reference (default 2)")
    ap.add_argument("--profile", action="store_true",
                    help=f"run the last {PROFILE_STEPS} steps of every recipe run under torch.profiler: the report "
                         f"says where each step's time goes (host and device, per part of the step)")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="each throughput variant's next N steps under torch.profiler after its timed rounds: "
                         "launches, host syncs, device-busy fraction, top kernels")
    ap.add_argument("--kernels-budget-s", metavar="SECONDS", type=_budget_arg,
                    help="seconds kernels: auto may spend measuring in each throughput run (a number, or none: no "
                         "limit; default: model.kernels_budget_s's default); cases left run torch's kernels")
    ap.add_argument("--compile-cache-dir", metavar="DIR",
                    help="torch's compile cache of each throughput configuration, loaded from and saved to "
                         "DIR/compile_cache_PRESET_SEQ.bin")
    ap.add_argument("--skip", default="", help=f"comma-separated stages to skip: {','.join(STAGES)}")
    return ap.parse_args(argv)


def bench_records(args, seqs: list[int], tmp: Path, kinds: tuple[str, ...]) -> tuple[dict[str, dict[int, str]], str]:
    """{kind: {seq: manifest}} and the vocab: the kit's or --records' pre-built records, else
    built here (of ``kinds`` only)."""
    sys.path.insert(0, str(REPO))
    from bertdist.gpu_kit import records

    folder = Path(args.records) if args.records else (Path(args.kit) / "records" if args.kit else None)
    if folder is not None:
        # The sequence lengths and kinds it has; a recipe needing another is a failed row of its own.
        found = {}
        for kind in records.KINDS:
            have = [s for s in seqs if records.manifest_path(folder, s, kind).is_file()]
            if kind == "static":
                have = have or seqs  # none at all: find's error names what is missing
            found[kind] = records.find(folder, have, kind)
        return found, str(folder / records.VOCAB_NAME)
    return records.build(seqs, tmp / "records", kinds=kinds), str(tmp / "records" / records.VOCAB_NAME)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    kit = json.loads((Path(args.kit) / "kit.json").read_text()) if args.kit else None
    env = environment(torch, kit)
    gpu = env["device_type"] == "cuda"
    quick = args.quick or not gpu
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(STAGES)
    if unknown:
        raise SystemExit(f"--skip: unknown stage(s) {sorted(unknown)}; stages: {', '.join(STAGES)}")
    deadline = Deadline(args.deadline_s)
    configs = ([(p, int(s), int(b)) for p, s, b in (c.split(":") for c in args.configs.split(","))] if args.configs
               else (CPU_CONFIGS if quick else GPU_CONFIGS))
    variants = args.variants or (GPU_VARIANTS if gpu and not quick else CPU_VARIANTS)
    rounds = args.rounds or (5 if gpu and not quick else 2)
    steps = args.steps or (None if gpu and not quick else 2)
    scale = RecipeScale.for_device(gpu, quick, args.recipe_steps, args.profile)
    recipes = [RECIPES / name for name in args.recipes.split(",")] if args.recipes else sorted(RECIPES.glob("*.yaml"))
    repeats = args.repeats or 2
    recipe_overrides = tuple(o for o in args.recipe_overrides.split(",") if o)
    precision = "bf16" if gpu and not quick else "fp32"
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    setup = json.loads(Path(args.setup_json).read_text())["rows"] if args.setup_json else None
    report = {"environment": env, "command": command, "deadline_s": args.deadline_s, "stage_seconds": {},
              "progress": {}, "setup": setup, "skipped_stages": [], "failed_stages": [], "throughput": [],
              "tests": None, "kernels": None, "decisions": None, "recipes": [], "auto_vs_reference": {},
              "complete": False}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")[:40]
    stem = out / f"acceptance_{slug}_{env['date'][:10]}"

    def save() -> None:
        """Both reports, rewritten whole (through a rename) after every run."""
        report["seconds"] = time.perf_counter() - deadline.start
        report["targets"] = targets(env, [r for r in report["throughput"] if "failed" not in r],
                                    report["auto_vs_reference"], report["recipes"])
        report["exit_status"] = exit_status(report)
        for path, text in ((stem.with_suffix(".md"), markdown(report)),
                           (stem.with_suffix(".json"), json.dumps(report, indent=1, default=str) + "\n")):
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)

    def timed(name: str, label: str, fn, *a):
        progress = report["progress"]
        if name in skip:
            progress[label] = "skipped (--skip)"
            report["skipped_stages"].append(f"{label} (--skip)")
            save()
            return None
        if deadline.left() <= 0:
            progress[label] = "skipped (deadline)"
            report["skipped_stages"].append(f"{label} (the {args.deadline_s:.0f} s deadline had passed)")
            save()
            return None
        print(f"[bench] {label} ... ({deadline.left():.0f} s left)", file=sys.stderr, flush=True)
        progress[label] = "running"
        save()
        t0 = time.perf_counter()
        failed_before = len(report["failed_stages"])
        res = guarded(report, label, fn, *a)
        report["stage_seconds"][label] = report["stage_seconds"].get(label, 0.0) + time.perf_counter() - t0
        progress[label] = "failed" if len(report["failed_stages"]) > failed_before else "done"
        save()
        return res

    def not_run(label: str, why: str) -> None:
        report["progress"][label] = f"not run ({why})"
        report["skipped_stages"].append(f"{label}: {why}")
        save()

    def throughput(preset: str, seq: int, batch: int) -> None:
        label = f"throughput {preset} seq {seq}"
        pool = lengths or manifests.get("static", {})
        manifest = pool.get(seq) or next(iter(pool.values()), None)
        failed_before = len(report["failed_stages"])
        r = timed("throughput", label, stage_throughput, preset, seq, batch, manifest, variants, steps, precision,
                  rounds, deadline, throughput_extra(args, preset, seq))
        if r is not None:
            report["throughput"].append(r)
        elif len(report["failed_stages"]) > failed_before:
            report["throughput"].append({"preset": preset, "seq": seq, "batch": batch,
                                         "failed": report["failed_stages"][-1]})
        save()

    def recipe_rows(selected: list[Path], label: str) -> None:
        if not selected:
            return
        if not manifests:
            not_run(label, "no records (see the records stage)")
            return
        timed("recipes", label, stage_recipes, selected, manifests, vocab, tmp / "runs", scale, deadline,
              report["recipes"], save, recipe_overrides)

    old_cache = os.environ.get("BERTDIST_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bertdist_bench_") as tmp_name:
        tmp = Path(tmp_name)
        # A fresh decision cache: this run measures on this device; every later run reuses it.
        os.environ["BERTDIST_CACHE_DIR"] = str(tmp / "kernel_cache")
        save()
        recipe_seq = {r: _seq_of(r) for r in recipes}
        seqs = sorted({s for _, s, _ in configs} | set(recipe_seq.values()))
        kinds = tuple(sorted({"static"} | {_records_kind(r) for r in recipes}))
        got = timed("records", "records", bench_records, args, seqs, tmp, kinds)
        manifests, vocab = got if got else ({}, "")
        lengths = ({int(json.loads(Path(m).read_text())["records"]["max_seq_length"]): m for m in args.lengths_from}
                   if args.lengths_from else {})
        long_seq = max(seqs)
        # 1. the target configuration, side by side with HF
        throughput(*configs[0])
        # 2. kernels: auto against reference on whole training steps (and the trainer's own figures)
        ar_recipe = RECIPES / AUTO_VS_REFERENCE_RECIPE
        if "auto_vs_reference" in skip:
            timed("auto_vs_reference", "auto vs reference", None)  # records the --skip
        elif ar_recipe not in recipe_seq:
            not_run("auto vs reference", f"{AUTO_VS_REFERENCE_RECIPE} is not among --recipes")
        elif not manifests:
            not_run("auto vs reference", "no records (see the records stage)")
        else:
            timed("auto_vs_reference", "auto vs reference", stage_auto_vs_reference, ar_recipe, manifests, vocab,
                  tmp / "auto_vs_reference", scale, repeats, deadline, report["auto_vs_reference"], save)
        # 3. the remaining recipes below the longest sequence
        covered = large_trainer_figures(None, report["auto_vs_reference"]) is not None
        rest = [r for r in recipes if recipe_seq[r] < long_seq and not (covered and r == ar_recipe)]
        recipe_rows(rest, "recipes")
        # 4. the longest sequence: its throughput configurations and recipes
        for c in configs[1:]:
            if c[1] == long_seq:
                throughput(*c)
        recipe_rows([r for r in recipes if recipe_seq[r] == long_seq and not (covered and r == ar_recipe)],
                    f"recipes seq {long_seq}")
        # 5. the rest
        for c in configs[1:]:
            if c[1] != long_seq:
                throughput(*c)
        report["tests"] = timed("tests", "GPU tests", stage_tests, sys.executable, quick, deadline)
        # The kernel benchmark's quick shapes: every SDPA backend and varlen_attn within the slot;
        # `python benchmarks/kernels.py` runs them all.
        report["kernels"] = timed("kernels", "kernel benchmark", stage_kernels, True, env["device_type"])
        report["decisions"] = timed("decisions", "kernels: auto decisions", stage_decisions, configs,
                                    env["device_type"], precision)
    if old_cache is None:
        os.environ.pop("BERTDIST_CACHE_DIR", None)
    else:
        os.environ["BERTDIST_CACHE_DIR"] = old_cache
    report["complete"] = True
    save()
    report["report"] = str(stem.with_suffix(".md"))
    print(markdown(report))
    print(f"[bench] report: {report['report']} ({report['seconds']:.0f} s, exit {report['exit_status']})",
          file=sys.stderr)
    return report


if __name__ == "__main__":
    sys.exit(main()["exit_status"])
