"""Training throughput of bertdist's BERT vs Hugging Face's: one run, same device, batch and precision.

Variants (``--variants``; default: all on CUDA, ours-optimized, ours-reference and hf-sdpa on CPU):
  ours-optimized   bertdist, unpadded encoder (packed real tokens, varlen attention), sparse MLM
                   head, kernels=auto: on CUDA the measured plan for this batch, seq and precision
                   (``bertdist.ops.selection``; its table is printed and recorded), on CPU torch's
                   ops; ``--compile`` wraps it in torch.compile
  ours-torch       the same model with kernels=reference: torch-native ops only (on CUDA: SDPA on
                   the re-padded sequences with dropout, varlen_attn without); on CPU the same as
                   ours-optimized, so not a CPU default
  ours-reference   bertdist, padded encoder, sparse MLM head, kernels=reference (what the shipped
                   recipes run: unpad false)
  ours-reference-compile  the same compiled regionally, as the trainer's ``model.compile: true`` runs it
                   (the model-only step that ours-trainer is compared with)
  ours-trainer     ``bertdist pretrain``'s own step (``bertdist.train.step.launch_step``) on the
                   DeepSpeed engine a run builds from ``--trainer-recipe`` (default: BERT-large
                   phase 1: LAMB, gradient clipping, its precision and kernels), scaled to this
                   preset, batch, seq and precision, compiled regionally as ``model.compile: true``
                   runs it, settling (one host sync) every ``logging.every_steps`` steps as the
                   trainer does; one process group of this process alone (NCCL on CUDA)
  ours-trainer-eager  the same with ``model.compile: false``
  ours-trainer-torchopt  ours-trainer with ``optimizer.implementation: torch`` (bertdist's multi-tensor
                   LAMB, torch's AdamW) in place of DeepSpeed's fused optimizer
  ours-trainer-flat  ours-trainer with ``optimizer.implementation: flat`` (bertdist's flat-buffer
                   kernels, clipping fused in)
  ours-trainer-graphs  ours-trainer with ``model.cuda_graphs: true``: the compiled regions with static
                   shapes captured in CUDA graphs (bertdist/train/cuda_graphs.py); against
                   ours-trainer it is the measurement ``model.cuda_graphs: auto`` waits for. CUDA
                   only: skipped, with the reason, on CPU
  hf-sdpa          transformers.BertForPreTraining, attn_implementation="sdpa" (dense MLM head)
  hf-sdpa-compile  the same under torch.compile (skipped, with the reason, if compiling fails)

One training step = forward + backward + AdamW step (fused on CUDA; the trainer variants: the
recipe's optimizer and clipping) on a right-padded batch of
``--batch`` rows of width ``--seq`` (fixed shape, as in the public BERT benchmarks). Every variant
runs the same batches. Row lengths are realistic:
  --lengths-from MANIFEST  lengths are sampled from the ``input_ids`` list lengths of the real
                           shards (pyarrow, train split); if the shards were built for another
                           max_seq_length the lengths are rescaled to ``--seq`` (printed, recorded);
  otherwise                a synthetic distribution modelled on BERT's create_pretraining_data
                           (calibrated on this repo's pipeline output at 128, mean 125.7 / 128, 87%
                           full rows): with prob 0.1 (BERT's short_seq_prob) uniform in [8, seq];
                           else ``seq`` with prob 0.9, or ``seq`` minus uniform [1, seq // 8].
Token ids are random (lengths, not ids, drive the cost). Token types: A = the first half of the
real tokens. Predicted positions per row: min(max_predictions, max(1, round(0.15 * length))) as
in BERT (max_predictions 20 at seq 128, 80 at 512, else ceil(0.15 * seq)). NSP labels random.

Reported per variant: sequences/s, real (non-pad) tokens/s, MFU over real tokens, peak memory
and the ratio of each to hf-sdpa. MFU: BERT's training FLOPs of the real tokens only
(``bertdist.model.flops.train_flops_per_sequence(cfg, length, predicted)`` summed over rows, the
MLM head over predicted positions only; the same useful-work count for every variant, so padding
and a dense head are overhead) over the device's dense peak: H100/H200 SXM 989.4 TFLOP/s bf16,
A100 312 (``bertdist.train.metrics``), CPU an estimate (cores x clock x FMA width) that is printed;
``--peak-tflops`` overrides. Peak memory: torch.cuda.max_memory_allocated on CUDA; on CPU the
peak-RSS delta over the variant (VmHWM reset via /proc/self/clear_refs, else a 2 ms sampler).
A check forward (no grad, batch 0, uncompiled module) counts the rows the encoder really ran on:
the real tokens for the unpadded variant, batch x seq for the padded ones.

``--loss-curve N`` also trains ours-optimized and ours-reference from the same initial weights
for N steps on the real shards of --lengths-from (trainer's loader, same batches, AdamW, the
run's precision, dropout ``--curve-dropout``, default 0 so that the curves differ only by
kernels / unpadding numerics) and records per-step losses in the JSON and a PNG. No verdict is
drawn here.

    # CPU (mini, a few steps)
    .venv/bin/python benchmarks/train_throughput.py --preset mini --batch 8 --seq 128 --steps 2 \\
        --lengths-from /path/to/records/manifest.json --markdown out.md --json out.json
    # GPU: records from the real Wikipedia fragment + books, one build per seq
    .venv/bin/bertdist data build --config configs/data/bert_base_wiki_books.yaml --input wiki:../shared/data/wiki \\
        --input books:../shared/data/books --vocab ../shared/data/vocab/bert-base-uncased-vocab.txt \\
        --output runs/data/wiki_books_128 --set dupe_factor=1
    .venv/bin/python benchmarks/train_throughput.py --preset large --batch 64 --seq 128 --compile \\
        --lengths-from runs/data/wiki_books_128/manifest.json --loss-curve 300 \\
        --json benchmarks/results/train_throughput_h100_large_128.json \\
        --markdown benchmarks/results/train_throughput_h100_large_128.md
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bertdist.model import IGNORE_INDEX, BertConfig  # noqa: E402
from bertdist.train.loader import batch_to_device, packing  # noqa: E402

VARIANTS = ("ours-trainer", "ours-trainer-eager", "ours-trainer-torchopt", "ours-trainer-flat", "ours-trainer-graphs",
            "ours-optimized", "ours-torch", "ours-reference", "ours-reference-compile", "hf-sdpa", "hf-sdpa-compile")
# trainer variant -> its overrides of the recipe
TRAINER_VARIANTS = {
    "ours-trainer": ("model.compile=true",),
    "ours-trainer-eager": ("model.compile=false",),
    "ours-trainer-torchopt": ("model.compile=true", "optimizer.implementation=torch"),
    "ours-trainer-flat": ("model.compile=true", "optimizer.implementation=flat"),
    "ours-trainer-graphs": ("model.compile=true", "model.cuda_graphs=true"),
}
# variant -> why it cannot run off CUDA
CUDA_ONLY = {"ours-trainer-graphs": "CUDA graphs need a CUDA device (model.cuda_graphs=true)"}


def unrunnable(name: str, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device`` (reported as a skip), or None."""
    return CUDA_ONLY.get(name) if device.type != "cuda" else None


RECIPES = Path(__file__).resolve().parents[1] / "configs" / "pretrain"
TRAINER_RECIPE = RECIPES / "bert-large-phase1.yaml"


def default_recipe(preset: str, seq: int) -> Path:
    """BERT's recipe of this size and phase (phase 2 above seq 128), else BERT-large phase 1's."""
    path = RECIPES / f"bert-{preset}-phase{1 if seq <= 128 else 2}.yaml"
    return path if path.is_file() else TRAINER_RECIPE
CPU_DEFAULT_VARIANTS = ("ours-optimized", "ours-reference", "hf-sdpa")
BASELINE = "hf-sdpa"
SHORT_SEQ_PROB = 0.1  # BERT's create_pretraining_data default
MIN_LENGTH = 8
MAX_LENGTH_ROWS = 200_000  # enough rows for a length distribution; shards are read until this many


# ----- sequence lengths ----------------------------------------------------------------------------
def lengths_from_manifest(manifest: str, split: str = "train") -> tuple[np.ndarray, int]:
    """Real sequence lengths (``input_ids`` list lengths) of the shards, and their max_seq_length."""
    import pyarrow.compute as pc

    from bertdist.data import open_records

    recs = open_records(manifest, verify=False, split=split)
    out, have = [], 0
    for i in range(len(recs.shards)):
        col = recs.read_shard(i, columns=["input_ids"]).column("input_ids")
        out.append(pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64))
        have += len(out[-1])
        if have >= MAX_LENGTH_ROWS:
            break
    lengths = np.concatenate(out) if out else np.zeros(0, np.int64)
    if not len(lengths):
        raise ValueError(f"{manifest}: the {split} split holds no rows")
    return lengths, recs.max_seq_length


def synthetic_lengths(n: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """The synthetic distribution of the module docstring."""
    short = rng.random(n) < SHORT_SEQ_PROB
    shortfall = np.where(rng.random(n) < 0.9, 0, rng.integers(1, max(2, seq // 8 + 1), n))
    full = seq - shortfall
    return np.where(short, rng.integers(min(MIN_LENGTH, seq), seq + 1, n), full).astype(np.int64)


def sample_lengths(pool: np.ndarray | None, pool_seq: int | None, shape: tuple[int, int], seq: int,
                   rng: np.random.Generator) -> np.ndarray:
    if pool is None:
        return synthetic_lengths(int(np.prod(shape)), seq, rng).reshape(shape)
    picked = rng.choice(pool, size=shape, replace=True)
    if pool_seq != seq:  # keep the padding fraction of the shards at the benchmark's width
        picked = np.rint(picked * (seq / pool_seq)).astype(np.int64)
    return np.clip(picked, 2, seq)


def default_max_predictions(seq: int) -> int:
    return {128: 20, 512: 80}.get(seq, math.ceil(0.15 * seq))


# ----- batches -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    lengths: np.ndarray  # [B] real tokens per row
    predicted: np.ndarray  # [B] MLM positions per row

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def make_batch(lengths: np.ndarray, seq: int, vocab_size: int, max_predictions: int, rng: np.random.Generator) -> Batch:
    b = len(lengths)
    cols = np.arange(seq)
    mask = cols[None, :] < lengths[:, None]
    ids = rng.integers(5, vocab_size, (b, seq)) * mask
    ids[:, 0] = 2  # a stand-in [CLS]; ids do not change the cost
    types = (cols[None, :] >= ((lengths + 1) // 2)[:, None]) & mask
    labels = np.full((b, seq), IGNORE_INDEX, dtype=np.int64)
    predicted = np.minimum(max_predictions, np.maximum(1, np.rint(0.15 * lengths))).astype(np.int64)
    for r in range(b):
        k = min(int(predicted[r]), int(lengths[r]) - 1)
        pos = 1 + rng.choice(int(lengths[r]) - 1, size=k, replace=False)  # never [CLS]
        labels[r, pos] = ids[r, pos]
        predicted[r] = k
    t = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels,
             next_sentence_label=rng.integers(0, 2, b))
    return Batch({k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in t.items()}, lengths, predicted)


# ----- models --------------------------------------------------------------------------------------
OURS = {  # variant -> (unpad, kernels)
    "ours-optimized": (True, "auto"),
    "ours-torch": (True, "reference"),
    "ours-reference": (False, "reference"),
}


def ours_kernels(name: str, cfg, device: torch.device, batch: int | None, seq: int | None, precision: str,
                 compiled: bool = False):
    """The variant's KernelSet: for ours-optimized on CUDA the measured plan of this run's
    shapes (under autocast, as make_step runs it; timed in compiled layers when the variant
    compiles), else what ``kernels`` resolves to."""
    from bertdist.ops import kernels_for_run

    _, mode = OURS[name]
    if mode == "auto" and device.type == "cuda" and batch:
        return kernels_for_run(mode, cfg, device, micro_batch=batch, seq=seq, precision=precision,
                               autocast=precision != "fp32", compiled=compiled, budget_s=cfg.kernels_budget_s)
    return None  # resolved by the model from cfg.kernels


def build_variant(name: str, cfg, device: torch.device, compile_ours: bool, *, batch: int | None = None,
                  seq: int | None = None, precision: str = "fp32") -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """(module to train, the uncompiled module, description)."""
    from bertdist.model import BertForPreTraining

    if name.startswith("ours-"):
        base = name.removesuffix("-compile")
        unpad, mode = OURS[base]
        vcfg = dataclasses.replace(cfg, unpad=unpad, sparse_mlm_head=True, kernels=mode)
        compiled = name.endswith("-compile") or (name == "ours-optimized" and compile_ours)
        kernels = ours_kernels(base, vcfg, device, batch, seq, precision, compiled)
        raw = BertForPreTraining(vcfg, device_type=device.type, kernels=kernels).to(device).train()
        info = {"impl": "bertdist", "unpad": vcfg.unpad, "sparse_mlm_head": vcfg.sparse_mlm_head,
                "kernels": dict(raw.bert.kernels.sources), "compile": compiled}
        plan = raw.bert.kernels.plan
        if plan is not None:
            info["kernel_plan"] = {"table": plan.table(), "plan": plan.to_dict()}
        if compiled:  # regionally, in place, as the trainer's model.compile does
            from bertdist.train.compile import CompileDecision, apply_compile

            info["compiled_regions"] = len(apply_compile(raw, CompileDecision(True, "benchmark variant")))
        return raw, raw, info
    import transformers

    hf_cfg = transformers.BertConfig(**cfg.to_hf_dict(), attn_implementation="sdpa")
    raw = transformers.BertForPreTraining(hf_cfg).to(device).train()
    compiled = name == "hf-sdpa-compile"
    info = {"impl": f"transformers {transformers.__version__}", "unpad": False, "sparse_mlm_head": False,
            "attn_implementation": "sdpa", "compile": compiled}
    return (torch.compile(raw) if compiled else raw), raw, info


def autocast_ctx(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def make_step(model: torch.nn.Module, device: torch.device, precision: str, lr: float = 1e-4,
              lr_at: Callable[[int], float] | None = None) -> Callable[[dict], torch.Tensor]:
    """One optimizer step on a batch; returns the (detached) loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    count = [0]

    def step(data: dict) -> torch.Tensor:
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(count[0])
        count[0] += 1
        with autocast_ctx(device, precision):
            out = model(**data)
        loss = out.loss if hasattr(out, "loss") else out[0]
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def with_packing(b: "Batch") -> dict[str, torch.Tensor]:
    """The batch with the packing the trainer's loader ships (bertdist.train.loader.packing)."""
    t = b.tensors
    return {**t, **packing(t["attention_mask"].numpy(), np.asarray(b.lengths), t["labels"].numpy())}


def encoder_rows(raw: torch.nn.Module, data: dict, hidden: int) -> int:
    """Rows of hidden states the encoder ran on for this batch (a forward hook, no grad; compiled
    regions run eagerly for it, so that it compiles no inference graph)."""
    seen = []
    h = raw.bert.encoder.register_forward_pre_hook(lambda _m, args: seen.append(args[0].numel() // hidden))
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            raw(**data)
    finally:
        h.remove()
    return seen[0]


# ----- memory --------------------------------------------------------------------------------------
class PeakMemory:
    """Peak memory of a variant: CUDA allocator peak, or the CPU peak-RSS delta."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS delta"
        self._sampler: threading.Thread | None = None

    @staticmethod
    def _status_kb(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.base = self._status_kb("VmRSS") * 1024
        try:  # "5" resets VmHWM (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
            self.hwm = True
        except OSError:
            self.hwm, self.sampled, self._stop = False, self.base, threading.Event()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
            self.kind += " (sampled every 2 ms)"
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.sampled = max(self.sampled, self._status_kb("VmRSS") * 1024)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.hwm:
            self.peak = self._status_kb("VmHWM") * 1024 - self.base
        else:
            self._stop.set()
            self._sampler.join()
            self.peak = self.sampled - self.base


# ----- throughput ----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prime_code_paths(name: str, cfg, device: torch.device, precision: str) -> None:
    """One step of a throwaway 2-layer, 128-wide model of the same implementation on CPU, so that
    lazy imports, library initialisation and code pages are in RSS before the baseline is taken."""
    small = dataclasses.replace(cfg, vocab_size=128, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                num_hidden_layers=1, preset="custom")
    model, _, _ = build_variant(name.removesuffix("-compile"), small, device, False)
    rng = np.random.default_rng(0)
    data = make_batch(np.array([16, 9]), 16, small.vocab_size, 3, rng).tensors
    make_step(model, device, precision)(data)
    del model


@dataclasses.dataclass
class Live:
    """A variant built and warmed up in this process, waiting for its timed steps."""
    name: str
    step: Callable[[dict], torch.Tensor]
    on_dev: list[dict]
    info: dict
    check: int
    resident: int | None  # CUDA bytes its weights, gradients and optimizer state hold
    block_s: list[float] = dataclasses.field(default_factory=list)
    transient: int = 0
    loss: float = float("nan")


def trainer_config(name: str, cfg, recipe: Path, batch: int, seq: int, precision: str):
    """The recipe's TrainConfig scaled to this benchmark: its model preset, vocab and dropout, one
    micro-batch per step, this seq and precision, no evaluation or checkpoints."""
    from bertdist.train.config import load_train_config

    tc = load_train_config(str(recipe), [
        f"model.preset={cfg.preset}", *TRAINER_VARIANTS[name],
        f"model.hidden_dropout_prob={cfg.hidden_dropout_prob}",
        f"model.attention_probs_dropout_prob={cfg.attention_probs_dropout_prob}",
        f"data.max_seq_length={seq}", f"data.micro_batch_size={batch}", f"data.global_batch_size={batch}",
        f"deepspeed.precision={precision}", "data.eval_split=null", "checkpoint.every_steps=0",
        f"model.kernels_budget_s={'null' if cfg.kernels_budget_s is None else cfg.kernels_budget_s}"])
    return dataclasses.replace(tc, model=tc.model.with_vocab(cfg.vocab_size))


def build_trainer_variant(name: str, cfg, recipe: Path, device: torch.device, batch: int, seq: int,
                          precision: str) -> tuple[Callable[[dict], torch.Tensor], dict]:
    """(step, description) of the trainer's own step: launched every call, settled every
    ``logging.every_steps`` calls; the step returns its loss slot, still on the device."""
    from bertdist.ops import kernels_for_run
    from bertdist.train.inprocess import build_run
    from bertdist.train.compile import decide_compile
    from bertdist.train.precision import autocast_dtype
    from bertdist.train.step import STEP_FIELDS, launch_step, settle

    tc = trainer_config(name, cfg, recipe, batch, seq, precision)
    kernels = kernels_for_run(tc.model.kernels, tc.model, device, micro_batch=batch, seq=seq, precision=precision,
                              autocast=autocast_dtype(precision) is not None,
                              compiled=decide_compile(tc.model.compile, device.type).enabled,
                              budget_s=tc.model.kernels_budget_s)
    run = build_run(tc, device, kernels)
    every, pending, loss_at = tc.logging.every_steps, [], STEP_FIELDS.index("loss")

    def step(data: dict) -> torch.Tensor:
        pending.append(launch_step(run.runner, [data], False))
        loss = pending[-1].sums.values[loss_at]
        if len(pending) == every:
            settle(pending, 1, precision)
            pending.clear()
        return loss

    module = run.engine.module
    info = {"impl": "bertdist pretrain step", "recipe": recipe.name, "unpad": tc.model.unpad,
            "sparse_mlm_head": tc.model.sparse_mlm_head, "kernels": dict(module.bert.kernels.sources),
            "compile": tc.model.compile, "compile_reason": run.compile_reason, "overrides": TRAINER_VARIANTS[name],
            "cuda_graphs": run.cuda_graphs, "cuda_graphs_reason": run.cuda_graphs_reason,
            "compiled_regions": run.compiled_regions, "optimizer": type(run.engine.optimizer).__name__,
            "optimizer_name": tc.optimizer.name, "gradient_clipping": tc.deepspeed.gradient_clipping,
            "optimizer_kernels": getattr(run.engine.optimizer, "kernel_source", None),
            "settle_every": every}
    return step, info


def build_live(name: str, cfg, batches: list[Batch], device: torch.device, precision: str, warmup: int,
               compile_ours: bool, recipe: Path = TRAINER_RECIPE) -> Live:
    on_dev = [batch_to_device(with_packing(b) if name.startswith("ours-") else b.tensors, device) for b in batches]
    gc.collect()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    torch.manual_seed(0)
    batch, seq = len(batches[0].lengths), batches[0].tensors["input_ids"].shape[1]
    if name in TRAINER_VARIANTS:
        step, info = build_trainer_variant(name, cfg, recipe, device, batch, seq, precision)
        # the recipe runs the padded encoder: every row of the batch (no check forward, which would compile)
        check = batch * seq if not info["unpad"] else batches[0].real_tokens
    else:
        model, raw, info = build_variant(name, cfg, device, compile_ours, batch=batch, seq=seq, precision=precision)
        check = encoder_rows(raw, on_dev[0], cfg.hidden_size)
        step = make_step(model, device, precision)
    for i in range(warmup):  # also compiles, for every batch shape (warmup >= number of batches)
        step(on_dev[i % len(on_dev)])
    sync(device)
    resident = torch.cuda.memory_allocated(device) - before if before is not None else None
    return Live(name, step, on_dev, info, check, resident)


def rates(v: Live, batches: list[Batch], steps: int, dt: float, flops_per_batch: list[float],
          peak_flops: float) -> dict:
    """The figures of ``steps`` steps (cycling ``batches``) that took ``dt`` seconds."""
    used = [batches[i % len(batches)] for i in range(steps)]
    seqs = sum(len(b.lengths) for b in used)
    real = sum(b.real_tokens for b in used)
    padded = sum(b.tensors["input_ids"].numel() for b in used)
    flops = sum(flops_per_batch[i % len(batches)] for i in range(steps))
    return {
        **v.info, "step_s": dt / steps, "seq_per_s": seqs / dt, "real_tokens_per_s": real / dt,
        "padded_tokens_per_s": padded / dt, "tflops_real": flops / dt / 1e12, "mfu": flops / dt / peak_flops,
        "real_tokens": real, "padded_tokens": padded, "sequences": seqs, "final_loss": v.loss,
        "encoder_rows_check": {"batch": 0, "encoder_rows": v.check, "real_tokens": batches[0].real_tokens,
                               "padded_tokens": batches[0].tensors["input_ids"].numel()},
    }


def run_variant(name: str, cfg, batches: list[Batch], device: torch.device, precision: str, steps: int,
                warmup: int, compile_ours: bool, flops_per_batch: list[float], peak_flops: float,
                recipe: Path = TRAINER_RECIPE) -> dict:
    if device.type == "cpu":
        prime_code_paths(name, cfg, device, precision)
    with PeakMemory(device) as mem:
        v = build_live(name, cfg, batches, device, precision, warmup, compile_ours, recipe)
        t0 = time.perf_counter()
        for i in range(steps):
            loss = v.step(v.on_dev[i % len(v.on_dev)])
        sync(device)
        dt = time.perf_counter() - t0
        v.loss = float(loss)
    v.step = v.on_dev = None  # the model and its batches go before the next variant is built
    return {**rates(v, batches, steps, dt, flops_per_batch, peak_flops), "peak_mem_bytes": mem.peak,
            "peak_mem_kind": mem.kind}


def time_block(v: Live, steps: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = v.step(v.on_dev[i % len(v.on_dev)])
    sync(device)
    v.block_s.append(time.perf_counter() - t0)
    v.loss = float(loss)
    if device.type == "cuda":
        v.transient = max(v.transient, torch.cuda.max_memory_allocated(device) - base)


def run_interleaved(names: list[str], args, cfg, batches: list[Batch], device: torch.device, precision: str,
                    steps: int, warmup: int, flops_per_batch: list[float], peak_flops: float,
                    rounds: int) -> dict:
    """Every variant built and warmed up in this one process, then timed in ``rounds`` rounds whose
    order rotates (a slow phase of the machine hits every variant alike). Each round runs the
    same batches for every variant; a variant's time is its median round. Peak memory on CUDA:
    its resident state plus the allocator's peak above the baseline during its own rounds (None
    on CPU, where RSS cannot be split between variants of one process)."""
    from bertdist.train.compile import compile_seconds, load_compile_cache, save_compile_cache

    per_round = math.ceil(max(1, steps // rounds) / len(batches)) * len(batches)
    live, out = [], {"variants": {}, "skipped": {}, "failed": {}}
    cache = {"path": args.compile_cache, "loaded": load_compile_cache(args.compile_cache)}
    for name in names:
        if unrunnable(name, device):
            out["skipped"][name] = unrunnable(name, device)
            continue
        print(f"  {name}: build and warm up ...", flush=True)
        try:
            t0, compiling = time.perf_counter(), compile_seconds()
            live.append(build_live(name, cfg, batches, device, precision, warmup, args.compile,
                                   Path(args.trainer_recipe or default_recipe(args.preset, args.seq))))
            live[-1].info.update(build_s=time.perf_counter() - t0, compile_s=compile_seconds() - compiling)
        except torch.OutOfMemoryError as e:
            out["skipped"][name] = f"out of memory ({str(e).splitlines()[0][:120]})"
        except Exception as e:  # noqa: BLE001 - compile failures are skips, others failures (or raised)
            compiled = name.endswith("-compile") or (name == "ours-optimized" and args.compile)
            first = str(e).splitlines()[0][:200] if str(e) else ""
            if compiled:
                out["skipped"][name] = f"torch.compile failed: {type(e).__name__}: {first}"
            elif args.keep_going:
                out["failed"][name] = f"{type(e).__name__}: {first}"
            else:
                raise
    for r in range(rounds):
        for v in live[r % len(live):] + live[:r % len(live)] if live else []:
            time_block(v, per_round, device)
    seqs = sum(len(batches[i % len(batches)].lengths) for i in range(per_round))
    if args.compile_cache:
        cache["saved"] = save_compile_cache(args.compile_cache)
    out["compile_cache"] = cache
    if args.profile_steps:
        out["profiles"] = profile_variants(live, args.profile_steps, device)
    for v in live:
        out["variants"][v.name] = {
            **rates(v, batches, per_round, statistics.median(v.block_s), flops_per_batch, peak_flops),
            "peak_mem_bytes": None if v.resident is None else v.resident + v.transient,
            "peak_mem_kind": ("resident state + torch.cuda.max_memory_allocated above it during its own rounds"
                              if v.resident is not None else "not separable between variants of one process on CPU"),
            "round_seq_per_s": [seqs / t for t in v.block_s],
            "interleaved": {"rounds": rounds, "steps_per_round": per_round},
        }
    return out


def profile_variants(live: list[Live], steps: int, device: torch.device, top: int = 8) -> dict[str, dict]:
    """Each built variant's next ``steps`` steps under torch.profiler (after its timed rounds):
    wall and device-busy time per step, kernels, launches and host syncs per step, the top kernels
    and operators (``bertdist.train.profiling.summarize``)."""
    from torch.profiler import ProfilerActivity, profile

    from bertdist.train.profiling import summarize

    out = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for v in live:
        sync(device)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for i in range(steps):
                v.step(v.on_dev[i % len(v.on_dev)])
            sync(device)
            wall = time.perf_counter() - t0
        out[v.name] = summarize(prof, steps, wall, top, device.type)
        print(f"  profile {v.name}: {out[v.name]['wall_ms_per_step']:.1f} ms/step"
              + (f", device busy {100 * out[v.name]['device_busy_fraction']:.0f}%, "
                 f"{out[v.name]['launches_per_step']:.0f} launches/step, "
                 f"{out[v.name]['host_syncs_per_step']:.1f} host syncs/step" if device.type == "cuda" else ""),
              flush=True)
    return out


RATIO_KEYS = ("seq_per_s", "real_tokens_per_s", "mfu", "peak_mem_bytes")


def add_ratios(variants: dict[str, dict]) -> None:
    base = variants.get(BASELINE)
    for r in variants.values():
        r["vs_hf_sdpa"] = ({k: r[k] / base[k] for k in RATIO_KEYS if base[k] and r[k] is not None} if base else None)


# ----- loss curve ----------------------------------------------------------------------------------
def loss_curve(manifest: str, cfg, steps: int, batch: int, device: torch.device, precision: str, compile_ours: bool,
               dropout: float, lr: float) -> dict:
    """Per-step losses of ours-optimized vs ours-reference on the same real batches, same init."""
    from bertdist.data import continuation_mask, open_records
    from bertdist.train.config import LoaderConfig
    from bertdist.train.loader import LoaderState, PretrainingLoader

    recs = open_records(manifest)
    vocab = recs.vocab
    msl = recs.max_seq_length
    wwm = bool(recs.record_format.get("whole_word_mask", False)) and recs.masking == "dynamic"
    cont = continuation_mask(vocab["path"]) if wwm else None
    dcfg = LoaderConfig(train_manifest=str(manifest), max_seq_length=msl, micro_batch_size=batch,
                      global_batch_size=batch, prefetch_steps=0)
    loader = PretrainingLoader(recs, dcfg, rank=0, world_size=1, grad_accum=1, continuation=cont)
    ccfg = dataclasses.replace(cfg, vocab_size=int(vocab["size"]), hidden_dropout_prob=dropout,
                               attention_probs_dropout_prob=dropout)
    warm = max(1, steps // 10)

    def lr_at(i: int) -> float:
        return lr * min(1.0, (i + 1) / warm)

    curves, init = {}, None
    for name in ("ours-optimized", "ours-reference"):
        torch.manual_seed(0)
        model, raw, info = build_variant(name, ccfg, device, compile_ours, batch=batch, seq=msl, precision=precision)
        if init is None:
            init = {k: v.detach().clone() for k, v in raw.state_dict().items()}
        else:
            raw.load_state_dict(init)
        step = make_step(model, device, precision, lr=lr, lr_at=lr_at)
        state, losses = LoaderState(), []
        for _ in range(steps):
            (data,) = loader.micro_batches(state)
            state = loader.advance(state)
            data = batch_to_device(data, device)
            losses.append(float(step(data)))
        curves[name] = {"loss": losses, **{k: info[k] for k in ("unpad", "kernels", "compile")}}
        del model, raw, step
        gc.collect()
    a, b = np.array(curves["ours-optimized"]["loss"]), np.array(curves["ours-reference"]["loss"])
    return {"manifest": str(Path(manifest).resolve()), "steps": steps, "batch": batch, "max_seq_length": msl,
            "vocab_size": int(vocab["size"]), "precision": precision, "dropout": dropout,
            "optimizer": f"AdamW lr {lr} (linear warmup {warm} steps), weight decay 0.01", "curves": curves,
            "max_abs_diff": float(np.abs(a - b).max()), "mean_abs_diff": float(np.abs(a - b).mean())}


def plot_loss_curve(curve: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, style in (("ours-reference", dict(lw=2.2, alpha=0.6)), ("ours-optimized", dict(lw=1.0))):
        y = curve["curves"][name]["loss"]
        ax.plot(range(1, len(y) + 1), y, label=name, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MLM + NSP)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- reporting -----------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def markdown(res: dict) -> str:
    def ratio(r, k):
        v = (r.get("vs_hf_sdpa") or {}).get(k)
        return f"{v:.2f}x" if v is not None else "-"

    lines = [
        f"# Training throughput: {res['preset']}, batch {res['batch']}, seq {res['seq']}, {res['precision']}",
        "",
        f"- device: {res['device']} ({res['device_type']}); MFU peak: {res['peak_note']}",
        f"- date: {res['date']}; torch {res['torch']}, transformers {res['transformers']}, python {res['python']}",
        f"- command: `{res['command']}`",
        f"- lengths: {res['lengths']['source']}; mean real length {res['lengths']['mean_real_length']:.1f} / "
        f"{res['seq']}, padding {100 * res['lengths']['padding_fraction']:.1f}% of tokens",
        f"- {res['steps']} timed steps after {res['warmup']} warmup steps over {res['num_batches']} distinct batches; "
        "optimizer AdamW; MFU over real tokens only",
        "",
        "| variant | seq/s | real tok/s | TFLOP/s (real) | MFU | peak mem (MiB) | seq/s vs hf-sdpa | mem vs hf-sdpa | encoder rows (batch 0) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in res["variants"].items():
        c = r["encoder_rows_check"]
        lines.append(f"| {name} | {r['seq_per_s']:.1f} | {r['real_tokens_per_s']:.0f} | {r['tflops_real']:.3f} | "
                     f"{100 * r['mfu']:.2f}% | "
                     f"{'-' if r['peak_mem_bytes'] is None else format(r['peak_mem_bytes'] / 2**20, '.0f')} | "
                     f"{ratio(r, 'seq_per_s')} | "
                     f"{ratio(r, 'peak_mem_bytes')} | {c['encoder_rows']} of {c['padded_tokens']} |")
    for name, why in res["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | |")
    built = {n: r for n, r in res["variants"].items() if "build_s" in r}
    if built:
        lines += ["", "Build and warm-up (compile included) per variant: " + "; ".join(
            f"{n} {r['build_s']:.0f} s ({r['compile_s']:.0f} s compiling)" for n, r in built.items()) + "."]
    if res.get("compile_cache", {}).get("path"):
        c = res["compile_cache"]
        lines += ["", f"Compile cache `{c['path']}`: loaded {c['loaded']}, saved {c.get('saved')}."]
    trainer = {n: r for n, r in res["variants"].items() if r.get("impl") == "bertdist pretrain step"}
    for n, r in trainer.items():
        kernels = f", its kernels {r['optimizer_kernels']}" if r.get("optimizer_kernels") else ""
        lines += ["", f"{n}: recipe {r['recipe']}, optimizer {r['optimizer_name']} ({r['optimizer']}{kernels}), clipping "
                  f"{r['gradient_clipping']}, kernels {r['kernels']}, {r['compile_reason']} "
                  f"({r['compiled_regions']} regions), one host sync every {r['settle_every']} steps."]
    lines += ["", f"Peak memory: {res['peak_mem_kind']}. Kernels of ours-optimized: "
              f"{res['variants'].get('ours-optimized', {}).get('kernels', '-')}."]
    plan = res["variants"].get("ours-optimized", {}).get("kernel_plan")
    if plan:
        lines += ["", "kernels: auto decisions of ours-optimized (numerics vs the fp32 reference, then time):", "",
                  "```", plan["table"], "```"]
    if res.get("profiles"):
        lines += ["", "Profiled steps (torch.profiler, after the timed rounds; per step):", "",
                  "| variant | steps | wall ms | device busy ms | busy | kernels | launches | host syncs | aten calls |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, p in res["profiles"].items():
            cell = lambda k, spec: format(p[k], spec) if k in p else "-"  # noqa: E731
            busy = f"{100 * p['device_busy_fraction']:.0f}%" if "device_busy_fraction" in p else "-"
            lines.append(f"| {name} | {p['steps']} | {p['wall_ms_per_step']:.1f} | {cell('device_busy_ms_per_step', '.1f')} | "
                         f"{busy} | {cell('kernels_per_step', '.0f')} | {cell('launches_per_step', '.0f')} | "
                         f"{cell('host_syncs_per_step', '.1f')} | {p['aten_calls_per_step']:.0f} |")
        for name, p in res["profiles"].items():
            if p.get("top_kernels"):
                lines += ["", f"Top kernels of {name} (device ms over the profiled steps):", ""]
                lines += [f"- {k['self_device_ms']:.2f} ms, {k['calls']} calls: `{k['op'][:110]}`" for k in p["top_kernels"]]
    if res.get("loss_curve"):
        lc = res["loss_curve"]
        lines += ["", f"Loss curve: {lc['steps']} steps on {lc['manifest']} (batch {lc['batch']}, seq {lc['max_seq_length']}, "
                  f"{lc['precision']}, dropout {lc['dropout']}): max |optimized - reference| = {lc['max_abs_diff']:.4g}, "
                  f"mean {lc['mean_abs_diff']:.4g}; final losses {lc['curves']['ours-optimized']['loss'][-1]:.4f} / "
                  f"{lc['curves']['ours-reference']['loss'][-1]:.4f}."]
    return "\n".join(lines) + "\n"


def measure(name: str, args, cfg, batches, device, precision, steps, warmup, flops_per_batch, peak) -> dict:
    """{"result": {...}} or {"skipped": reason}; compile failures, OOM and a variant the device cannot
    run are skips, anything else raises."""
    if unrunnable(name, device):
        return {"skipped": unrunnable(name, device)}
    try:
        return {"result": run_variant(name, cfg, batches, device, precision, steps, warmup, args.compile,
                                      flops_per_batch, peak, Path(args.trainer_recipe or default_recipe(args.preset, args.seq)))}
    except torch.OutOfMemoryError as e:
        return {"skipped": f"out of memory ({str(e).splitlines()[0][:120]})"}
    except Exception as e:  # noqa: BLE001 - only compile failures are tolerated, reported with the reason
        if not (name.endswith("-compile") or (name == "ours-optimized" and args.compile)):
            raise
        first = str(e).splitlines()[0][:160] if str(e) else ""
        return {"skipped": f"torch.compile failed: {type(e).__name__}: {first}"}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_in_subprocess(name: str, raw_argv: list[str]) -> dict:
    """The variant in a fresh interpreter: clean peak memory (RSS is order-dependent within a
    process, freed memory stays mapped) and no state shared between variants. Same seed, same batches."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="train_throughput_") as tmp:
        out = Path(tmp) / "variant.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *raw_argv, "--variants", name,
               "--worker", "--worker-out", str(out)]
        rc = subprocess.run(cmd).returncode
        if rc != 0 or not out.is_file():
            raise RuntimeError(f"variant {name}: worker process failed (exit {rc}): {shlex.join(cmd)}")
        return json.loads(out.read_text())


def _budget_seconds(text: str) -> float | None:
    """--kernels-budget-s: seconds >= 0, or none (no limit)."""
    if text.strip().lower() in ("none", "null"):
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"--kernels-budget-s must be >= 0 seconds or none, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini", choices=["tiny", "mini", "base", "large"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=30522, help="model vocab for the throughput runs (BERT's)")
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated subset of {','.join(VARIANTS)} (default: all on CUDA, "
                         f"{','.join(CPU_DEFAULT_VARIANTS)} on CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile ours-optimized")
    ap.add_argument("--trainer-recipe", default=None,
                    help="the pretraining recipe whose step the ours-trainer variants run (default: "
                         "configs/pretrain/bert-PRESET-phase1.yaml at seq <= 128, phase2 above, else "
                         "bert-large-phase1.yaml)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 30 on CUDA, 3 on CPU)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first (default max(10, 2 x batches) on CUDA, 1 on CPU)")
    ap.add_argument("--num-batches", type=int, default=None, help="distinct batches cycled (default min(4, steps))")
    ap.add_argument("--lengths-from", metavar="MANIFEST", help="sample row lengths from these shards (train split)")
    ap.add_argument("--max-predictions", type=int, default=None, help="MLM positions per row at most (BERT: 20 at 128, 80 at 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense peak")
    ap.add_argument("--loss-curve", type=int, default=0, metavar="N",
                    help="also train ours-optimized vs ours-reference N steps on --lengths-from's shards")
    ap.add_argument("--curve-dropout", type=float, default=0.0)
    ap.add_argument("--curve-lr", type=float, default=1e-4)
    ap.add_argument("--loss-curve-png", help="default: the --json path with a _loss_curve.png suffix")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="run each variant in a fresh process (default: yes on CPU, where peak RSS is only "
                         "meaningful per process; no on CUDA, where the allocator's peak is reset per variant)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="build every variant in this process, then time them in ROUNDS rounds of "
                         "steps / ROUNDS steps each, the order rotating per round (median round reported)")
    ap.add_argument("--compile-cache", metavar="PATH",
                    help="with --interleave: torch's compile cache artifacts, loaded first when the file exists, "
                         "written after every variant is warm (a later run on the same image starts warm)")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="with --interleave: after the timed rounds, each variant's next N steps under "
                         "torch.profiler (launches, host syncs, device-busy fraction, top kernels)")
    ap.add_argument("--kernels-budget-s", type=_budget_seconds, default=BertConfig.kernels_budget_s,
                    metavar="SECONDS", help="seconds kernels: auto may spend measuring, for ours-optimized and the "
                    "trainer variants (model.kernels_budget_s; 'none': no limit; default %(default)s); cases left "
                    "run torch's kernels and the kernel table says which")
    ap.add_argument("--keep-going", action="store_true",
                    help="a variant that raises is reported as failed and the others still run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here (e.g. benchmarks/results/...json)")
    ap.add_argument("--markdown", help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.loss_curve and not args.lengths_from:
        ap.error("--loss-curve needs --lengths-from MANIFEST (the real shards to train on)")
    if args.loss_curve and not (args.loss_curve_png or args.json):
        ap.error("--loss-curve needs --loss-curve-png or --json (the PNG goes beside it)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    chosen = args.variants.split(",") if args.variants else []
    if not any(v in TRAINER_VARIANTS for v in chosen):
        return _main(args, argv)
    import os

    from bertdist.train.distributed import single_process_group

    gpu = torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpu else "cpu")  # before DeepSpeed is imported
    with single_process_group("nccl" if gpu else "gloo"):  # the trainer variants' DeepSpeed engines
        return _main(args, argv)


def _main(args: argparse.Namespace, argv: list[str] | None) -> dict:
    import transformers

    from bertdist.model import train_flops_per_sequence
    from bertdist.train.metrics import device_peak_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    precision = args.precision or ("bf16" if gpu else "fp32")
    steps = args.steps or (30 if gpu else 3)
    num_batches = args.num_batches or min(4, steps)
    warmup = args.warmup if args.warmup is not None else (max(10, 2 * num_batches) if gpu else 1)
    chosen = (args.variants.split(",") if args.variants else list(VARIANTS if gpu else CPU_DEFAULT_VARIANTS))
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    max_pred = args.max_predictions or default_max_predictions(args.seq)
    cfg = BertConfig.from_preset(args.preset, vocab_size=args.vocab_size, hidden_dropout_prob=0.1,
                                 attention_probs_dropout_prob=0.1, kernels_budget_s=args.kernels_budget_s)
    isolate = (not gpu) if args.isolate is None else args.isolate
    peak, peak_note = device_peak_flops(device, precision, args.peak_tflops)
    if not gpu and not args.peak_tflops:
        peak_note += " (estimate)"

    rng = np.random.default_rng(args.seed)
    if args.lengths_from:
        pool, pool_seq = lengths_from_manifest(args.lengths_from)
        source = f"sampled from {len(pool)} rows of {Path(args.lengths_from).resolve()} (max_seq_length {pool_seq})"
        if pool_seq != args.seq:
            source += f", rescaled x{args.seq / pool_seq:g} to seq {args.seq}"
    else:
        pool, pool_seq = None, None
        source = "synthetic (see the module docstring)"
    lengths = sample_lengths(pool, pool_seq, (num_batches, args.batch), args.seq, rng)
    batches = [make_batch(row, args.seq, cfg.vocab_size, max_pred, rng) for row in lengths]
    flops_per_batch = [float(sum(train_flops_per_sequence(cfg, int(n), int(p)) for n, p in zip(b.lengths, b.predicted)))
                       for b in batches]
    real_all = sum(b.real_tokens for b in batches)
    res: dict[str, Any] = {
        "device": device_name(device), "device_type": device.type,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])) if argv is None
        else shlex.join(["benchmarks/train_throughput.py", *argv]),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda if gpu else None, "torch_threads": torch.get_num_threads(),
        "precision": precision, "preset": args.preset, "model": {k: getattr(cfg, k) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")},
        "batch": args.batch, "seq": args.seq, "steps": steps, "warmup": warmup, "num_batches": num_batches,
        "max_predictions": max_pred, "kernels_budget_s": args.kernels_budget_s,
        "peak_flops": peak, "peak_note": peak_note,
        "peak_mem_kind": PeakMemory(device).kind, "isolated_processes": isolate,
        "lengths": {"source": source, "mean_real_length": real_all / (num_batches * args.batch),
                    "padding_fraction": 1 - real_all / (num_batches * args.batch * args.seq),
                    "full_rows_fraction": float((lengths == args.seq).mean()),
                    "per_batch_real_tokens": [b.real_tokens for b in batches]},
        "variants": {}, "skipped": {},
    }
    if args.worker:  # one variant, for measure_in_subprocess
        outcome = measure(chosen[0], args, cfg, batches, device, precision, steps, warmup, flops_per_batch, peak)
        Path(args.worker_out).write_text(json.dumps(outcome))
        return outcome
    print(f"device: {res['device']} ({device.type}), torch {torch.__version__}, transformers {transformers.__version__}, "
          f"threads {res['torch_threads']}, precision {precision}; preset {args.preset}, batch {args.batch}, "
          f"seq {args.seq}; lengths {source}: mean {res['lengths']['mean_real_length']:.1f}, "
          f"padding {100 * res['lengths']['padding_fraction']:.1f}%; MFU peak: {peak_note}; "
          f"{'one process per variant' if isolate and not args.interleave else 'all variants in this process'}", flush=True)

    raw_argv = list(sys.argv[1:] if argv is None else argv)
    if args.interleave:
        got = run_interleaved(chosen, args, cfg, batches, device, precision, steps, warmup, flops_per_batch, peak,
                              args.interleave)
        res["variants"], res["skipped"] = got["variants"], got["skipped"]
        if "profiles" in got:
            res["profiles"] = got["profiles"]
        res["compile_cache"] = got["compile_cache"]
        if got["failed"]:
            res["failed"] = got["failed"]
        res["isolated_processes"] = False
        res["interleaved"] = {"rounds": args.interleave}
        for name, r in res["variants"].items():
            print(f"    {name}: {r['seq_per_s']:.1f} seq/s (rounds: "
                  f"{', '.join(f'{x:.1f}' for x in r['round_seq_per_s'])}), MFU {100 * r['mfu']:.2f}%", flush=True)
        for name, why in {**res["skipped"], **got["failed"]}.items():
            print(f"    {name}: {why}", flush=True)
    for name in ([] if args.interleave else chosen):
        print(f"  {name} ...", flush=True)
        try:
            outcome = (measure_in_subprocess(name, raw_argv) if isolate else
                       measure(name, args, cfg, batches, device, precision, steps, warmup, flops_per_batch, peak))
        except Exception as e:  # noqa: BLE001 - with --keep-going, a failed variant is a row and the others run
            if not args.keep_going:
                raise
            res.setdefault("failed", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"    FAILED: {res['failed'][name]}", flush=True)
            continue
        if "skipped" in outcome:
            res["skipped"][name] = outcome["skipped"]
            print(f"    skipped: {outcome['skipped']}", flush=True)
        else:
            r = res["variants"][name] = outcome["result"]
            print(f"    {r['seq_per_s']:.1f} seq/s, {r['real_tokens_per_s']:.0f} real tok/s, MFU {100 * r['mfu']:.2f}%, "
                  f"peak mem {r['peak_mem_bytes'] / 2**20:.0f} MiB", flush=True)
    add_ratios(res["variants"])

    if args.loss_curve:
        print(f"  loss curve: {args.loss_curve} steps, ours-optimized vs ours-reference ...", flush=True)
        res["loss_curve"] = loss_curve(args.lengths_from, cfg, args.loss_curve, args.batch, device, precision,
                                       args.compile, args.curve_dropout, args.curve_lr)
        png = args.loss_curve_png or str(Path(args.json).with_suffix("")) + "_loss_curve.png"
        plot_loss_curve(res["loss_curve"], png, f"{res['device']} {args.preset} batch {args.batch} "
                        f"seq {res['loss_curve']['max_seq_length']} {precision}, {args.loss_curve} steps")
        res["loss_curve"]["png"] = png

    md = markdown(res)
    res["markdown"] = md
    print("\n" + md, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(md)
    return res


if __name__ == "__main__":
    main()
