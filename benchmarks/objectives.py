"""Time to quality of four pretraining objectives at equal training FLOPs, on this machine.

    python benchmarks/objectives.py --work /tmp/bertdist-objectives --budget-steps 540 --seeds 2 \\
        --out-md benchmarks/results/objectives_cpu_DATE.md    # JSON and PNG beside it by default
    python benchmarks/objectives.py --smoke --work /tmp/objectives-smoke --out-md /tmp/smoke.md

The defaults (tiny, batch 32 x seq 128, 2,100 steps of MLM + NSP, 2 fine-tuning seeds on 2,000
SST-2, 1,500 STS-B and 1,000 author rows for 2 epochs) took 53 minutes on a 2-core CPU: 43 minutes
of pretraining (0.28-0.42 s a step) and 10 minutes for the 78 fine-tunes. That budget is too short
for the comparison: no arm's fine-tuned score beat the random initialisation's
(benchmarks/results/objectives_cpu_2026-11-26.md); mini (4 x 256) steps cost 0.8-0.95 s here, and
at 540 of them its MLM stayed on the unigram plateau. A WordPiece vocab of 8,192 tokens trained on
the corpus (``--vocab-size``) cuts a tiny step from 25.6 to 15.2 GFLOP, but 3,000 such steps still
ended on the plateau (benchmarks/results/objectives_cpu_2026-11-27_vocab8k.md). A useful run needs
a far larger budget (``--budget-steps``), which is a GPU's job: on one H200, mini at batch 128 took
4.1 minutes to pretrain all four arms at 1,620 TFLOP each, side by side (``--concurrent-pretrain``),
and the whole run, with 117 fine-tunes in 8 processes, 5.3 minutes
(benchmarks/results/gpu-node_nvidia-h200_2026-11-27_objectives/). ``--pack DIR`` copies the
records, task data and vocab for a node without ../shared or Beam; there, ``--shared DIR/shared
--work DIR/work`` reads them (docs/pretraining.md, "Which objective to choose").

The same encoder (``--preset``, default tiny: 2 layers x 128) is pretrained with `bertdist pretrain`
under four objectives (a fifth on request), one recipe of configs/pretrain/ each, with the same
optimizer (AdamW), schedule (warmup then linear decay over the arm's own steps), batch and
sequence length:

  mlm_nsp  (a) MLM 15% + NSP, BERT's (tiny.yaml), dynamically masked NSP records
  mlm30    (b) MLM 30%, no NSP, 80/10/10 (tiny-mlm30.yaml), unmasked records
  span     (c) span masking 15%, no NSP (tiny-span.yaml), unmasked records
  electra  (d) ELECTRA: generator 1/4 of the hidden size, lambda 50 (electra-tiny.yaml); the
           discriminator is the same encoder, its embeddings as wide as the hidden size unless
           ``--electra-embedding-size`` says otherwise
  wwm      (e) whole-word masking 15%, no NSP: span masking's baseline (tiny-span.yaml with
           masking_mode=whole_word); not in the default arms
  modernbert (f) ModernBERT beside BERT (modernbert-tiny.yaml): MLM 30% on whole documents packed
           into rows (its own records, built with pack_documents), an encoder of the BERT preset's
           depth, width and heads with a GeGLU MLP of BERT's MLP parameters (2/3 of its
           intermediate size), the same vocab; its FLOPs by ModernBERT's count (local layers'
           windowed attention, full-length rows); not in the default arms. The random
           initialisation baseline stays BERT's

With ``--tasks squad`` (SQuAD v1.1 dev split by article: even articles train, odd dev; F1),
``--arms span,wwm`` judges whether span masking is no worse than whole-word masking on SQuAD.

Equal compute: one FLOP budget, ``--budget-steps`` steps of the MLM + NSP arm (or ``--budget-tflops``),
counted by bertdist/model/flops.py for the model each recipe trains (ELECTRA: both towers) with the
number of predicted positions its masking rate gives; each arm gets budget / its FLOPs per step
steps, rounded to a multiple of 3 so that its checkpoints at 1/3, 2/3 and 3/3 of the budget fall on
whole steps. Every checkpoint is fine-tuned in-process with `bertdist finetune`'s ``run_finetune``
and one recipe for all arms, on SST-2 (seeded train subset, full dev; accuracy), STS-B (dev
Spearman) and the author task of bertdist/demo.py (accuracy), with ``--seeds`` fine-tuning seeds;
a task's score is the dev metric after the last epoch (no selection on dev). A randomly initialised
encoder fine-tuned alike is the reference at zero FLOPs.

Records are built once per kind with the Beam pipeline from ../shared/data (Wikipedia + books,
seed 12345 for all) and cached in ``--work``; finished pretraining runs and fine-tunes found there
are reused, so an interrupted run continues where it stopped. The JSON (and the Markdown) is
rewritten after every fine-tune; the final budget point is fine-tuned first.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Run as a script, this folder comes first on sys.path, and its data_pipeline.py (a benchmark)
# would hide the data_pipeline package.
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared" / "data"  # --shared
VOCAB_NAME = "bert-base-uncased-vocab.txt"  # in SHARED/vocab
VOCAB = SHARED / "vocab" / VOCAB_NAME
RECIPES = REPO / "configs" / "pretrain"
POINTS = 3  # checkpoints at 1/3, 2/3 and 3/3 of the FLOP budget
BASE_ARM = "mlm_nsp"  # --budget-steps counts this arm's steps
TARGET_ARMS = ("electra", "mlm_nsp")  # the target: the first beats the second by TARGET_MARGIN points
TARGET_MARGIN = 2.0
SPREAD_DEFINITION = (
    "two arms differ beyond the seed spread when their ranges over fine-tuning seeds do not overlap: "
    "the lowest seed of the higher arm scores above the highest seed of the lower arm (with 2 seeds: "
    "the difference of the means exceeds the sum of the two half-ranges). A seed's mean downstream "
    "score is the mean over tasks of that seed's scores")


@dataclasses.dataclass(frozen=True)
class Arm:
    label: str
    recipe: str  # in configs/pretrain/
    records: str  # "nsp" or "none": the records' second objective
    mask_prob: float
    masking_mode: str
    mask_replace_prob: float
    random_replace_prob: float
    electra: bool = False
    note: str = ""  # how the recipe is changed, where the arm changes more than the masking rate
    family: str = "bert"  # the model family the recipe trains (bertdist/model/families.py)


ARMS = {
    "mlm_nsp": Arm("(a) MLM 15% + NSP", "tiny.yaml", "nsp", 0.15, "token", 0.8, 0.1),
    "mlm30": Arm("(b) MLM 30%, no NSP", "tiny-mlm30.yaml", "none", 0.30, "token", 0.8, 0.1),
    "span": Arm("(c) span masking 15%, no NSP", "tiny-span.yaml", "none", 0.15, "span", 0.8, 0.1),
    # the masking split of the ELECTRA code, as electra-tiny.yaml: 85% [MASK], 15% kept
    "electra": Arm("(d) ELECTRA (RTD, generator 1/4)", "electra-tiny.yaml", "none", 0.15, "token", 0.85, 0.0, True),
    # span masking's own baseline (SpanBERT compares with whole words): the span recipe with whole-word
    # masking, the same budget of masked tokens; not in the default arms
    "wwm": Arm("(e) whole-word masking 15%, no NSP", "tiny-span.yaml", "none", 0.15, "whole_word", 0.8, 0.1,
               note="masking_mode=whole_word"),
    # ModernBERT beside BERT: MLM 30% on documents packed into rows, as ModernBERT trains; its encoder
    # has the BERT preset's depth, width and heads (modernbert_sizes); not in the default arms
    "modernbert": Arm("(f) ModernBERT, MLM 30%, packed rows", "modernbert-tiny.yaml", "packed", 0.30, "token", 0.8,
                      0.1, note="the BERT preset's layers, width and heads; GeGLU MLP of 2/3 its intermediate size",
                      family="modernbert"),
}
DEFAULT_ARMS = ("mlm_nsp", "mlm30", "span", "electra")
SPAN_TARGET = ("span", "wwm", "squad")  # span masking no worse than whole-word masking on SQuAD


@dataclasses.dataclass(frozen=True)
class Task:
    name: str  # the `bertdist finetune` task
    metric: str  # the dev metric reported
    label: str
    percent: bool = False  # the metric is in percent already (SQuAD's); else a fraction


TASKS = {"sst2": Task("sst2", "accuracy", "SST-2 acc"), "stsb": Task("stsb", "spearman", "STS-B Spearman"),
         "author": Task("sst2", "accuracy", "author acc"),
         # SQuAD v1.1 dev split by article as elsewhere (bertdist.retrieval.squad_split): even train, odd dev
         "squad": Task("squad", "f1", "SQuAD F1", percent=True)}


# ---------------------------------------------------------------- equal compute (pure)
def predicted_per_sequence(seq: int, mask_prob: float) -> int:
    """Predicted positions of a full-length row: the loader's masking budget, uncapped."""
    from bertdist.data.masking import masking_budget

    return masking_budget(seq, mask_prob, seq)


def step_flops(model_cfg, batch: int, seq: int, predicted: int) -> int:
    """Training FLOPs of one step of ``batch`` full rows (flops.py; ELECTRA counts both towers)."""
    from bertdist.model.flops import train_flops_per_sequence

    return batch * train_flops_per_sequence(model_cfg, seq, predicted)


def equal_flop_steps(budget_flops: float, flops_per_step: float, multiple: int = POINTS) -> int:
    """Steps that spend ``budget_flops``, rounded to the nearest multiple of ``multiple`` (>= one)."""
    if budget_flops <= 0 or flops_per_step <= 0:
        raise ValueError(f"budget {budget_flops:g} FLOPs and {flops_per_step:g} FLOPs per step must be positive")
    return max(multiple, int(round(budget_flops / flops_per_step / multiple)) * multiple)


def budget_points(steps: int, n: int = POINTS) -> list[int]:
    """The steps at 1/n, 2/n, ... n/n of an arm's budget."""
    if steps % n:
        raise ValueError(f"{steps} steps do not split into {n} equal parts ({steps} / {n} = {steps / n:.3f})")
    return [steps * k // n for k in range(1, n + 1)]


# ---------------------------------------------------------------- seed spread and verdicts (pure)
def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "half_range": (max(values) - min(values)) / 2, "n": len(values)}


def seed_means(per_task: dict[str, dict[str, float]], tasks: list[str]) -> dict[str, float]:
    """{seed: mean over ``tasks``} for the seeds that have a score on every task."""
    seeds = set.intersection(*(set(per_task.get(t, {})) for t in tasks)) if tasks else set()
    return {s: statistics.fmean(per_task[t][s] for t in tasks) for s in sorted(seeds)}


def separated(a: list[float], b: list[float]) -> int:
    """+1 when every seed of ``a`` beats every seed of ``b``, -1 the other way round, 0 when the
    ranges overlap (or either side has fewer than 2 seeds: no spread to compare with)."""
    if len(a) < 2 or len(b) < 2:
        return 0
    if min(a) > max(b):
        return 1
    if min(b) > max(a):
        return -1
    return 0


def target_verdict(better: list[float], worse: list[float], margin: float = TARGET_MARGIN) -> dict:
    """"``better`` >= ``margin`` points above ``worse``, beyond the seed spread": met, NOT met, or
    not evaluable (a side with fewer than 2 seeds)."""
    if len(better) < 2 or len(worse) < 2:
        return {"verdict": "not evaluable", "why": f"needs >= 2 seeds a side, has {len(better)} and {len(worse)}"}
    diff = statistics.fmean(better) - statistics.fmean(worse)
    side = separated(better, worse)
    beyond = side == 1
    met = diff >= margin and beyond
    why = (f"difference {diff:+.2f} points ({'>=' if diff >= margin else '<'} {margin}); seed ranges "
           f"[{min(better):.2f}, {max(better):.2f}] vs [{min(worse):.2f}, {max(worse):.2f}]: "
           + {1: "separated", -1: "separated the other way (lower)", 0: "overlapping, within the seed spread"}[side])
    return {"verdict": "met" if met else "NOT met", "difference": diff, "separated": beyond, "why": why}


def no_worse_verdict(candidate: list[float], baseline: list[float], init: list[float] | None = None) -> dict:
    """"``candidate`` is no worse than ``baseline``": NOT met only when the baseline scores higher
    beyond the seed spread; not evaluable with fewer than 2 seeds a side, or when neither scores
    above ``init`` (the random initialisation's seeds) on average: being no worse than a model that
    pretraining has not helped says nothing."""
    if len(candidate) < 2 or len(baseline) < 2:
        return {"verdict": "not evaluable", "why": f"needs >= 2 seeds a side, has {len(candidate)} and {len(baseline)}"}
    mean_c, mean_b = statistics.fmean(candidate), statistics.fmean(baseline)
    diff = mean_c - mean_b
    if init and max(mean_c, mean_b) <= statistics.fmean(init):
        return {"verdict": "not evaluable", "difference": diff,
                "why": (f"difference {diff:+.2f} points, but neither arm scores above the random initialisation "
                        f"({mean_c:.2f} and {mean_b:.2f} against {statistics.fmean(init):.2f}): the budget is too "
                        f"short for this comparison")}
    worse = separated(baseline, candidate) == 1
    why = (f"difference {diff:+.2f} points; seed ranges [{min(candidate):.2f}, {max(candidate):.2f}] vs "
           f"[{min(baseline):.2f}, {max(baseline):.2f}]: " + ("lower beyond the seed spread" if worse else
                                                              "not lower beyond the seed spread"))
    return {"verdict": "NOT met" if worse else "met", "difference": diff, "why": why}


def pairwise(arm_seeds: dict[str, list[float]]) -> list[dict]:
    """Every pair of arms: difference of means and whether it exceeds the seed spread."""
    names = [a for a in arm_seeds if arm_seeds[a]]
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            hi, lo = (a, b) if statistics.fmean(arm_seeds[a]) >= statistics.fmean(arm_seeds[b]) else (b, a)
            rows.append({"higher": hi, "lower": lo,
                         "difference": statistics.fmean(arm_seeds[hi]) - statistics.fmean(arm_seeds[lo]),
                         "separated": separated(arm_seeds[hi], arm_seeds[lo]) == 1})
    return rows


# ---------------------------------------------------------------- data
def corpus_key(max_books_mb: float | None) -> str:
    """The name of the corpus ``corpus_inputs`` gives, in the names of what is built from it."""
    return "full" if max_books_mb is None else f"books{max_books_mb:g}mb"


def corpus_inputs(shared: Path, work: Path, max_books_mb: float | None) -> tuple[list[str], str]:
    """The Beam inputs (wiki + books) and a key naming them; ``max_books_mb`` keeps the books, by
    name, whose sizes add up to at most that (a folder of links in ``work``)."""
    books = shared / "books"
    if max_books_mb is None:
        return [f"wiki:{shared / 'wiki'}", f"books:{books}"], corpus_key(None)
    chosen, total = [], 0
    for f in sorted(books.glob("*.txt")):
        if total + f.stat().st_size > max_books_mb * 1e6:
            continue
        chosen.append(f)
        total += f.stat().st_size
    key = corpus_key(max_books_mb)
    folder = work / "corpus" / key
    folder.mkdir(parents=True, exist_ok=True)
    for f in chosen:
        if not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    if not chosen:
        sys.exit(f"--max-books-mb {max_books_mb}: no book in {books} is that small")
    return [f"wiki:{shared / 'wiki'}", f"books:{folder}"], key


def corpus_vocab(shared: Path, work: Path, max_books_mb: float | None, size: int) -> Path:
    """A WordPiece vocab of ``size`` tokens with BERT's special ids, trained once on the pretraining
    corpus (the pipeline's vocab trainer over the same inputs)."""
    out = work / "vocab" / f"wordpiece{size}-{corpus_key(max_books_mb)}.txt"
    if not out.is_file():
        inputs, _ = corpus_inputs(shared, work, max_books_mb)
        from data_pipeline.pipeline import parse_input
        from data_pipeline.tokenization import train_vocab
        from data_pipeline.vocab_corpus import iter_sentences

        skipped: list[str] = []
        t = time.time()
        train_vocab(iter_sentences([parse_input(i) for i in inputs], skipped=skipped), out, vocab_size=size)
        print(f"trained a {size}-token vocab on {inputs} in {time.time() - t:.0f} s -> {out}"
              + (f"; skipped {skipped}" if skipped else ""), flush=True)
    return out


def vocab_tag(vocab: Path) -> str:
    """'' for BERT's own vocab, else a suffix naming the vocab (records and the initialisation depend on it)."""
    return "" if Path(vocab).name == VOCAB_NAME else f"-{Path(vocab).stem}"


def build_records(shared: Path, work: Path, kind: str, seq: int, max_books_mb: float | None, vocab: Path) -> dict:
    """Unmasked records (the loader masks each batch) with NSP pairs ("nsp"), without ("none"), or
    whole documents packed into rows ("packed", ModernBERT's), built once:
    {manifest, rows, tokens, documents, build_s}."""
    out = work / "records" / f"{kind}-seq{seq}-{corpus_key(max_books_mb)}{vocab_tag(vocab)}"
    manifest = out / "manifest.json"
    if not manifest.is_file():
        from data_pipeline import build_records as beam_build

        inputs, _ = corpus_inputs(shared, work, max_books_mb)
        t = time.time()
        print(f"building {kind} records at seq {seq} from {inputs} -> {out}", flush=True)
        packed = kind == "packed"
        beam_build(inputs, out, vocab, masking="dynamic", objective="none" if packed else kind, max_seq_length=seq,
                   max_predictions_per_seq=predicted_per_sequence(seq, 0.30 if packed else 0.15), dupe_factor=1,
                   num_shards=4, heldout_fraction=0.0, seed=12345, **({"pack_documents": True} if packed else {}))
        (out / "build_seconds.json").write_text(json.dumps({"seconds": time.time() - t}))
    m = json.loads(manifest.read_text())
    seconds = out / "build_seconds.json"
    # the inputs the records were built from (a packed copy is read on a machine without them)
    built_from = [f"{i['kind']}:{i['path']}" for i in m["config"]["inputs"]]
    return {"manifest": str(manifest), "rows": m["splits"]["train"]["rows"], "tokens": m["counts"]["tokens"],
            "documents": m["counts"]["documents"], "inputs": built_from,
            "build_s": json.loads(seconds.read_text())["seconds"] if seconds.is_file() else None}


def write_task_data(shared: Path, work: Path, task: str, train_rows: int | None, dev_rows: int | None) -> Path:
    """A task folder (train.tsv, dev.tsv): a seeded subset of the train rows (all when None) and
    the first ``dev_rows`` dev rows (all when None), lines copied as they are; written once (its
    name fixes its rows), so a packed work folder needs neither ../shared nor blingfire."""
    folder = work / "tasks" / f"{task}-train{train_rows or 'all'}-dev{dev_rows or 'all'}"
    ext = "json" if task == "squad" else "tsv"
    if (folder / f"train.{ext}").is_file() and (folder / f"dev.{ext}").is_file():
        return folder
    if task == "squad":
        return write_squad_split(shared / "squad" / "dev-v1.1.json", folder, train_rows, dev_rows)
    if task == "author":
        from bertdist.demo import build_author_task

        source = build_author_task(work / "tasks")
    else:
        source = shared / "glue" / {"sst2": "SST-2", "stsb": "STS-B"}[task]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train_rows), ("dev", dev_rows)):
        header, *body = (source / f"{split}.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
        if n is not None and n < len(body):
            # train: a seeded sample in file order; dev: its first rows
            keep = sorted(random.Random(0).sample(range(len(body)), n)) if split == "train" else range(n)
            body = [body[i] for i in keep]
        (folder / f"{split}.tsv").write_text(header + "".join(body), encoding="utf-8")
    return folder


def write_squad_split(source: Path, folder: Path, train_rows: int | None, dev_rows: int | None) -> Path:
    """SQuAD v1.1 dev split by article (even articles train.json, odd dev.json, as
    bertdist.retrieval.squad_split), each cut to its first N questions in file order (all when None)."""
    data = json.loads(source.read_text(encoding="utf-8"))
    halves: dict[str, list] = {"train": [], "dev": []}
    left = {"train": train_rows, "dev": dev_rows}
    for a, article in enumerate(data["data"]):
        split = "train" if a % 2 == 0 else "dev"
        paragraphs = []
        for para in article["paragraphs"]:
            n = len(para["qas"]) if left[split] is None else min(len(para["qas"]), left[split])
            if n:
                paragraphs.append({**para, "qas": para["qas"][:n]})
                left[split] = None if left[split] is None else left[split] - n
        if paragraphs:
            halves[split].append({**article, "paragraphs": paragraphs})
    folder.mkdir(parents=True, exist_ok=True)
    for split, articles in halves.items():
        (folder / f"{split}.json").write_text(json.dumps({"version": data.get("version", "1.1"), "data": articles}),
                                              encoding="utf-8")
    return folder


def task_rows(task: str, folder: Path) -> dict[str, int]:
    """Train and dev examples of a task folder: rows of a TSV, questions of a SQuAD file."""
    if task == "squad":
        return {s: sum(len(p["qas"]) for a in json.loads((folder / f"{s}.json").read_text(encoding="utf-8"))["data"]
                       for p in a["paragraphs"]) for s in ("train", "dev")}
    return {s: sum(1 for _ in (folder / f"{s}.tsv").open(encoding="utf-8")) - 1 for s in ("train", "dev")}


# ---------------------------------------------------------------- pretraining
def modernbert_sizes(preset: str) -> dict[str, int]:
    """A ModernBERT encoder beside the BERT ``preset``: its layers, hidden size and heads, and a
    GeGLU MLP of 2/3 BERT's intermediate size, whose input projection (value and gate) is twice
    that wide: 3 x 2/3 = 2 weight matrices' worth, BERT's MLP parameters and FLOPs."""
    from bertdist.model.config import PRESETS

    p = PRESETS[preset]
    return {"num_hidden_layers": p["num_hidden_layers"], "hidden_size": p["hidden_size"],
            "num_attention_heads": p["num_attention_heads"], "intermediate_size": p["intermediate_size"] * 2 // 3}


def model_overrides(arm: Arm, args) -> list[str]:
    """The encoder of an arm: the BERT preset itself, or a ModernBERT of its sizes whose context
    is the benchmark's sequence length (its recipe's local window kept)."""
    if arm.family != "modernbert":
        return [f"model.preset={args.preset}", "model.kernels=reference"]
    return ["model.preset=custom", *(f"model.{k}={v}" for k, v in modernbert_sizes(args.preset).items()),
            f"model.max_position_embeddings={args.seq}"]


def arm_overrides(arm: Arm, args, steps: int, manifest: str) -> list[str]:
    """The recipe overrides of one arm: everything shared by the arms, then its masking (and ELECTRA's sizes)."""
    every = steps // POINTS
    predicted = predicted_per_sequence(args.seq, arm.mask_prob)
    shared = [
        f"data.train_manifest={manifest}", f"data.vocab_file={args.vocab}", *model_overrides(arm, args),
        f"data.max_seq_length={args.seq}", f"data.micro_batch_size={args.batch}",
        f"data.global_batch_size={args.batch}", "data.eval_split=null", "data.masking=dynamic",
        "optimizer.name=adamw", f"optimizer.lr={args.lr}", "optimizer.betas=[0.9,0.999]", "optimizer.eps=1e-6",
        "optimizer.weight_decay=0.01", f"schedule.total_steps={steps}",
        f"schedule.warmup_steps={max(1, round(args.warmup_fraction * steps))}", "schedule.warmup_fraction=null",
        "schedule.decay=linear", "deepspeed.zero_stage=0", f"deepspeed.precision={args.precision}",
        "deepspeed.gradient_clipping=1.0", f"checkpoint.every_steps={every}", "checkpoint.keep_last_n=0",
        "logging.progress=none", "logging.tensorboard=false", f"logging.every_steps={max(1, every)}",
        "eval.every_steps=0", "eval.at_start=false", "eval.at_end=false", "seed=42"]
    masking = [f"data.masking_mode={arm.masking_mode}", f"data.mask_prob={arm.mask_prob}",
               f"data.max_predictions_per_seq={predicted}", f"data.mask_replace_prob={arm.mask_replace_prob}",
               f"data.random_replace_prob={arm.random_replace_prob}"]
    electra = []
    if arm.electra:
        emb = "null" if args.electra_embedding_size is None else args.electra_embedding_size
        electra = [f"electra.embedding_size={emb}", "electra.generator_size_ratio=0.25", "electra.disc_weight=50.0",
                   "electra.gen_weight=1.0", "electra.sampling=multinomial"]
    return shared + masking + electra


def arm_flops_per_step(arm: Arm, args, manifest: str = "") -> int:
    """Training FLOPs of one step of the model the arm's recipe trains (its vocab from the vocab file)."""
    from bertdist.train import load_train_config

    cfg = load_train_config(RECIPES / arm.recipe, arm_overrides(arm, args, POINTS, manifest or "unused"))
    vocab = sum(1 for _ in args.vocab.open(encoding="utf-8"))
    model = dataclasses.replace(cfg.model_config, vocab_size=vocab)
    return step_flops(model, args.batch, args.seq, predicted_per_sequence(args.seq, arm.mask_prob))


def plan_arms(args) -> dict[str, dict]:
    """Per arm: FLOPs per step, steps and checkpoint steps for one FLOP budget."""
    per_step = {name: arm_flops_per_step(ARMS[name], args) for name in dict.fromkeys([BASE_ARM, *args.arms])}
    budget = args.budget_tflops * 1e12 if args.budget_tflops else args.budget_steps * per_step[BASE_ARM]
    plan = {}
    for name in args.arms:
        steps = equal_flop_steps(budget, per_step[name])
        plan[name] = {"flops_per_step": per_step[name], "steps": steps, "points": budget_points(steps),
                      "flops": steps * per_step[name], "budget_flops": budget}
    return plan


def run_key(args, steps: int, overrides: list[str]) -> str:
    return f"{args.preset}-b{args.batch}-s{args.seq}-{steps}steps-" + hashlib.sha1("\n".join(
        o for o in overrides if not o.startswith("data.train_manifest")).encode()).hexdigest()[:8]


def tag_dir(run_dir: Path, step: int) -> Path:
    from bertdist.train.state import checkpoint_tag

    return run_dir / "checkpoints" / checkpoint_tag(step)


def read_metrics(run_dir: Path) -> dict:
    """Step times and the trainer's FLOP count from metrics.jsonl (the last row of each step, as a
    resumed run appends)."""
    rows = {}
    metrics = run_dir / "metrics.jsonl"
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
        r = json.loads(line)
        if r.get("kind") == "train":
            rows[r["step"]] = r
    times = [rows[s]["step_time_s"] for s in sorted(rows)]
    first_loss = rows[min(rows)]["loss"] if rows else None
    # where pretraining ended: means over the last tenth of the steps (one step's figures are noisy)
    tail = [rows[s] for s in sorted(rows)[-max(1, len(rows) // 10):]]
    end = {f"{k}_end": statistics.fmean(r[k] for r in tail) for k in ("mlm_loss", "mlm_acc", "disc_acc", "replaced_rate")
           if tail and all(k in r for r in tail)}
    return {"steps_logged": len(rows), "train_s": sum(times), **end,
            "median_step_s": statistics.median(times[1:] or times) if times else None,
            "trainer_flops": sum(r["tflops"] * r["step_time_s"] * 1e12 for r in rows.values()),
            "first_loss": first_loss, "last_loss": rows[max(rows)]["loss"] if rows else None}


def complete_points(run_dir: Path, points: list[int]) -> list[int]:
    return [s for s in points if (tag_dir(run_dir, s) / "COMPLETE").is_file()]


def pretrain_job(name: str, plan: dict, args, records: dict) -> dict:
    """One arm's `bertdist pretrain`: its command, run folder and whether its checkpoints are all there."""
    arm = ARMS[name]
    overrides = arm_overrides(arm, args, plan["steps"], records[arm.records]["manifest"])
    run_dir = Path(args.work) / "pretrain" / f"{name}-{run_key(args, plan['steps'], overrides)}"
    # --resume auto: a run an earlier invocation left unfinished continues from its last checkpoint
    cmd = [sys.executable, "-m", "bertdist.cli.pretrain", "--resume", "auto", str(RECIPES / arm.recipe),
           f"run_dir={run_dir}", *overrides]
    return {"name": name, "plan": plan, "cmd": cmd, "run_dir": run_dir,
            "done": complete_points(run_dir, plan["points"]) == plan["points"]}


def _kill(proc: subprocess.Popen) -> None:
    """The process and its children (its own session), if it has not ended meanwhile."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_pretraining(jobs: list[dict], concurrent: bool, timeout_s: float | None) -> dict[str, str]:
    """Run the unfinished jobs, one after another or all at once (each in its own process group),
    until they end or ``timeout_s`` has passed, when the rest are killed and none is started:
    {name: why it stopped early}. A run that fails on its own ends this script with the tail of its log."""
    end = time.time() + timeout_s if timeout_s else None
    stopped: dict[str, str] = {}
    todo = [j for j in jobs if not j["done"]]
    for wave in ([todo] if concurrent else [[j] for j in todo]):
        if end is not None and time.time() >= end:
            stopped.update({j["name"]: f"not started: past the {timeout_s:.0f} s pretraining timeout" for j in wave})
            continue
        running = []
        for j in wave:
            j["run_dir"].mkdir(parents=True, exist_ok=True)
            print(f"\n=== pretrain {j['name']}: {j['plan']['steps']} steps, checkpoints at {j['plan']['points']}\n$ "
                  + shlex.join(j["cmd"]), flush=True)
            log = (j["run_dir"] / "stdout.log").open("a")
            running.append((j, subprocess.Popen(j["cmd"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True), log, time.time()))
        for j, proc, log, t in running:
            try:
                rc = proc.wait(timeout=None if end is None else max(0.0, end - time.time()))
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc = proc.wait()
                stopped[j["name"]] = f"killed at the {timeout_s:.0f} s pretraining timeout"
            log.close()
            wall = time.time() - t
            walls = j["run_dir"] / "wall_seconds.json"
            walls.write_text(json.dumps((json.loads(walls.read_text()) if walls.is_file() else []) + [wall]))
            if rc != 0 and j["name"] not in stopped:
                for other in running:  # the others' partial runs are resumable; do not leave them running
                    _kill(other[1])
                tail = (j["run_dir"] / "stdout.log").read_text()[-3000:]
                sys.exit(f"pretraining {j['name']} failed (exit {rc}) after {wall:.0f} s; "
                         f"{j['run_dir'] / 'stdout.log'} ends:\n{tail}")
            missing = sorted(set(j["plan"]["points"]) - set(complete_points(j["run_dir"], j["plan"]["points"])))
            if missing and j["name"] not in stopped:
                sys.exit(f"pretraining {j['name']}: no complete checkpoint at steps {missing} in {j['run_dir'] / 'checkpoints'}")
    return stopped


def pretrain_result(job: dict, stopped: dict[str, str], concurrent: bool) -> dict:
    arm, run_dir, walls = ARMS[job["name"]], job["run_dir"], job["run_dir"] / "wall_seconds.json"
    return {**job["plan"], "label": arm.label, "recipe": arm.recipe, "records": arm.records, "run_dir": str(run_dir),
            "command": shlex.join(job["cmd"]), "concurrent": concurrent,
            "points_done": complete_points(run_dir, job["plan"]["points"]), "stopped": stopped.get(job["name"]),
            "wall_s": sum(json.loads(walls.read_text())) if walls.is_file() else None, **read_metrics(run_dir)}


def random_init(work: Path, args) -> Path:
    """The encoder before any pretraining (the trainer's seed), as a Hugging Face directory."""
    import torch

    from bertdist.export import write_hf_dir
    from bertdist.model import BertConfig, BertForPreTraining

    out = work / "pretrain" / f"init-{args.preset}{vocab_tag(args.vocab)}"
    if not (out / "config.json").is_file():
        cfg = BertConfig.from_preset(args.preset, vocab_size=sum(1 for _ in args.vocab.open(encoding="utf-8")),
                                     kernels="reference")
        torch.manual_seed(42)
        write_hf_dir(out, cfg, BertForPreTraining(cfg).state_dict(), args.vocab)
    return out


# ---------------------------------------------------------------- fine-tuning
def finetune_settings(args, task: str | None = None) -> dict:
    """The one fine-tuning recipe; SQuAD reads longer windows (its contexts are paragraphs)."""
    settings = {"max_seq_length": args.finetune_seq, "batch_size": 32, "epochs": args.finetune_epochs,
                "learning_rate": args.finetune_lr, "warmup_ratio": 0.1, "weight_decay": 0.01}
    if task == "squad":  # doc stride a quarter of the window (BERT's 384 / 128 is a third)
        settings.update(max_seq_length=args.squad_seq, doc_stride=args.squad_seq // 4)
    elif task is None and "squad" in args.tasks:
        settings.update(squad_max_seq_length=args.squad_seq, squad_doc_stride=args.squad_seq // 4)
    return settings


def finetune(checkpoint: Path, task: str, data: Path, seed: int, out: Path, args) -> dict:
    """One fine-tune (in this process), or the one an earlier run left in ``out``: the dev metric
    after the last epoch, in points."""
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.finetune.train import run_finetune

    metrics, wall = out / "metrics.json", out / "wall_seconds.json"
    if not metrics.is_file():
        t = time.time()
        cfg = FinetuneConfig(task=TASKS[task].name, checkpoint=str(checkpoint), data=str(data), output_dir=str(out),
                             vocab_file=str(args.vocab), kernels="reference", seed=seed, predict_test=False,
                             tensorboard=False, progress=False, **finetune_settings(args, task))
        run_finetune(cfg)
        wall.write_text(json.dumps({"seconds": time.time() - t}))  # loading and scoring included
    run = json.loads(metrics.read_text())["runs"][0]
    metric, scale = TASKS[task].metric, (1.0 if TASKS[task].percent else 100.0)
    return {"score": scale * run["history"][-1]["metrics"]["dev"][metric],
            "best_epoch_score": scale * max(h["metrics"]["dev"][metric] for h in run["history"]),
            "train_s": run["train_seconds"], "steps": run["steps"],
            "wall_s": json.loads(wall.read_text())["seconds"] if wall.is_file() else run["train_seconds"]}


def finetune_jobs(pretrained: dict, init_dir: Path | None) -> list[tuple]:
    """(arm, point, checkpoint) in the order they run: the final budget point first (the target's),
    then the others from the smallest, the random initialisation last. A point a stopped run did
    not reach has none."""
    order = [POINTS - 1, *range(POINTS - 1)]
    jobs = [(name, f"{k + 1}/{POINTS}", tag_dir(Path(p["run_dir"]), p["points"][k]))
            for k in order for name, p in pretrained.items() if p["points"][k] in p.get("points_done", p["points"])]
    if init_dir is not None:
        jobs.append(("init", "0", init_dir))
    return jobs


def run_finetunes(jobs: list[dict], args, deadline: float | None, on_done) -> list[dict]:
    """Each job's ``finetune`` in this process, or in ``--finetune-workers`` spawned processes (GPU
    fine-tunes are bound by the host, so several share one device well). No job starts after the
    deadline; one that raises is reported and the others go on. ``on_done(job, result)`` sees each
    result as it arrives; returns the jobs not run or failed, with why."""
    left: list[dict] = []

    def late(job):
        if deadline is not None and time.time() > deadline:
            left.append({**job, "why": "not started: past the deadline"})
            return True
        return False

    if args.finetune_workers <= 1:
        for job in jobs:
            if late(job):
                continue
            try:
                on_done(job, finetune(job["checkpoint"], job["task"], job["data"], job["seed"], job["out"], args))
            except Exception as e:  # noqa: BLE001 - reported in the results, the rest still run
                left.append({**job, "why": f"{type(e).__name__}: {e}"})
        return left
    import concurrent.futures as cf
    import multiprocessing

    queue = list(jobs)
    with cf.ProcessPoolExecutor(args.finetune_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {}

        def submit():
            while queue and len(running) < args.finetune_workers:
                job = queue.pop(0)
                if not late(job):
                    running[pool.submit(finetune, job["checkpoint"], job["task"], job["data"], job["seed"],
                                        job["out"], args)] = job

        submit()
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                try:
                    on_done(job, future.result())
                except Exception as e:  # noqa: BLE001 - as above
                    left.append({**job, "why": f"{type(e).__name__}: {e}"})
            submit()
    return left


# ---------------------------------------------------------------- summary
def point_scores(results: dict, arm: str, point: str) -> dict[str, dict[str, float]]:
    """{task: {seed: score}} of one arm at one budget point."""
    cell = results["finetune"].get(arm, {}).get(point, {})
    return {t: {s: r["score"] for s, r in seeds.items()} for t, seeds in cell.items()}


def summarize(results: dict) -> dict:
    """Per arm and point: each task's and the task mean's spread over seeds; per point: every pair
    of arms; the target's verdict at the final point."""
    tasks, arms = results["args"]["tasks"], list(results["pretrain"])
    points = [f"{k}/{POINTS}" for k in range(1, POINTS + 1)]
    table, pairs = {}, {}
    for point in points + ["0"]:
        seeds_of = {}
        for arm in (arms if point != "0" else ["init"]):
            per_task = point_scores(results, arm, point)
            row = {t: spread(list(per_task[t].values())) for t in tasks if per_task.get(t)}
            means = seed_means(per_task, tasks)
            if means:
                row["mean"] = spread(list(means.values()))
            seeds_of[arm] = list(means.values())
            table.setdefault(arm, {})[point] = row
        if point != "0":
            pairs[point] = pairwise(seeds_of)
    final = points[-1]
    better, worse = (list(seed_means(point_scores(results, a, final), tasks).values()) for a in TARGET_ARMS)
    target = (target_verdict(better, worse) if all(a in arms for a in TARGET_ARMS)
              else {"verdict": "not evaluable", "why": f"needs arms {list(TARGET_ARMS)}"})
    summary = {"table": table, "pairs": pairs, "target": target}
    span, wwm, task = SPAN_TARGET
    if span in arms and wwm in arms and task in tasks:
        f1 = {a: list(point_scores(results, a, final).get(task, {}).values()) for a in (span, wwm)}
        init = list(point_scores(results, "init", "0").get(task, {}).values())
        summary["span_target"] = no_worse_verdict(f1[span], f1[wwm], init)
    return summary


def end_state(p: dict) -> str:
    if "mlm_loss_end" not in p:
        return "–"
    text = f"MLM loss {p['mlm_loss_end']:.2f}, acc {p['mlm_acc_end']:.1%}"
    if "disc_acc_end" in p:
        text += f"; disc acc {p['disc_acc_end']:.1%} (all-original {1 - p['replaced_rate_end']:.1%})"
    return text


def cell(s: dict | None) -> str:
    return "–" if not s else f"{s['mean']:.2f} ± {s['half_range']:.2f}" + (f" (n={s['n']})" if s["n"] != 2 else "")


def against_init(results: dict, point: str) -> list[str]:
    """Whether pretraining helped at all: each arm's final mean against the random initialisation's."""
    table = results["summary"]["table"]
    init = table.get("init", {}).get("0", {}).get("mean")
    arms = {a: table.get(a, {}).get(point, {}).get("mean") for a in results["pretrain"]}
    arms = {a: m for a, m in arms.items() if m}
    if not init or not arms:
        return []
    below = [ARMS[a].label.split(" ", 1)[0] for a, m in arms.items() if m["mean"] < init["mean"]]
    line = (f"Against the random initialisation fine-tuned alike (mean {init['mean']:.2f}): {len(below)} of "
            f"{len(arms)} arms score below it at the final budget point" + (f" ({', '.join(below)})" if below else ""))
    if len(below) == len(arms):
        line += (". At this budget pretraining has not yet given the fine-tune anything to use, whatever the "
                 "objective, so these scores rank the objectives' noise rather than their quality: the budget is "
                 "too short for this comparison.")
    return ["", line + ("" if line.endswith(".") else ".")]


def render_md(results: dict) -> str:
    r, a, s = results, results["args"], results["summary"]
    tasks = a["tasks"]
    points = [f"{k}/{POINTS}" for k in range(1, POINTS + 1)]
    lines = [f"# Pretraining objectives at equal compute: time to quality ({r['date']})", "",
             f"- command: `{r['command']}`", f"- machine: {r['machine']}",
             f"- model: `{a['preset']}` encoder for every arm; batch {a['batch']} x seq {a['seq']}; AdamW lr "
             f"{a['lr']:g}, betas 0.9/0.999, weight decay 0.01, warmup {a['warmup_fraction']:.0%} of each arm's "
             f"steps then linear decay to 0, gradient clipping 1.0, {a.get('precision', 'fp32')}; pretraining seed 42 for every arm",
             f"- status: {r['status']}; wall time of this invocation {r['wall_s'] / 60:.1f} min; of the "
             f"work it reports (summed over the invocations that did it): records "
             f"{sum(d['build_s'] or 0 for d in r['data'].values()) / 60:.1f} min, pretraining "
             f"{sum(p['wall_s'] or 0 for p in r['pretrain'].values()) / 60:.1f} min, "
             f"{r['finetune_count']} fine-tunes {r['finetune_wall_s'] / 60:.1f} min", "", "## Data", "",
             "| records | objective | train rows | tokens | documents | build (s) |", "|---|---|---:|---:|---:|---:|"]
    for kind, d in r["data"].items():
        build = f"{d['build_s']:.0f}" if d["build_s"] is not None else "–"
        lines.append(f"| `{kind}` (dynamic masking) | {'NSP pairs' if kind == 'nsp' else 'none'} | {d['rows']:,} | "
                     f"{d['tokens']:,} | {d['documents']} | {build} |")
    first = next(iter(r["data"].values()))
    lines += ["", f"Both built by the Beam pipeline from the same text and seed (12345): {', '.join(first['inputs'])}; "
              f"vocab {Path(a.get('vocab') or VOCAB).name}"
              + (f" (WordPiece, {a['vocab_size']:,} tokens, trained on this text by the pipeline's vocab trainer)"
                 if a.get("vocab_size") else "") + f", seq {a['seq']}, dupe factor 1. The loader masks every batch anew.", "",
              "## Pretraining at equal FLOPs", "",
              f"Budget: {next(iter(r['pretrain'].values()))['budget_flops'] / 1e12:.4g} TFLOP per arm "
              "(bertdist/model/flops.py, full-length rows, each arm's own predicted positions; ELECTRA counts "
              "generator and discriminator). Checkpoints at 1/3, 2/3 and 3/3 of each arm's steps.", "",
              "| arm | recipe | GFLOP / step | steps | checkpoints | planned TFLOP | trainer-counted TFLOP | "
              "median step (s) | train time (min) | wall (min) | loss first → last | at the end |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for name, p in r["pretrain"].items():
        steps = p["steps"] if not p.get("stopped") else f"{p['steps_logged']} of {p['steps']}"
        loss = "–" if p["first_loss"] is None else f"{p['first_loss']:.3f} → {p['last_loss']:.3f}"
        note = ARMS[name].note if name in ARMS else ""
        lines.append(
            f"| {p['label']} | `{p['recipe']}`{f' with `{note}`' if note else ''} | {p['flops_per_step'] / 1e9:.1f} | {steps} | {p['points']} | "
            f"{p['flops'] / 1e12:.4g} | {p['trainer_flops'] / 1e12:.4g} | {p['median_step_s'] or 0:.3f} | "
            f"{p['train_s'] / 60:.1f} | {(p['wall_s'] or 0) / 60:.1f} | {loss} | {end_state(p)} |")
    ft = r["finetune_settings"]
    if any(p.get("concurrent") for p in r["pretrain"].values()):
        lines += ["", "The arms were pretrained at the same time on the one device (`--concurrent-pretrain`): their "
                  "step and wall times include each other's contention, their FLOPs and results do not."]
    for p in r["pretrain"].values():
        if p.get("stopped"):
            lines += ["", f"{p['label']}: {p['stopped']}, with checkpoints at steps {p['points_done'] or 'none'} "
                      f"of {p['points']}; only those are fine-tuned."]
    lines += ["", "At the end: means over the last tenth of the steps. ELECTRA's MLM figures are its generator's, "
              "and its loss is generator MLM + 50 x discriminator loss; its discriminator's accuracy is "
              "compared with always answering \"original\" (1 - the replaced rate). A BERT MLM loss near 7 "
              "with about 6% accuracy is the unigram plateau: the model predicts frequent tokens whatever the context.",
              "", "The trainer's count uses each batch's padded width and the positions actually masked (span "
              "masking can fall short of its budget), so it differs slightly from the plan.", "",
              "## Fine-tuning", "",
              f"One recipe for every checkpoint: `bertdist finetune` (run_finetune), AdamW lr {ft['learning_rate']:g}, "
              f"batch {ft['batch_size']}, {ft['epochs']:g} epochs, warmup 10%, max_seq_length {ft['max_seq_length']}"
              + (f" (SQuAD: {ft['squad_max_seq_length']}, doc stride {ft['squad_doc_stride']})" if "squad_max_seq_length" in ft else "") + "; "
              f"fine-tuning seeds 1..{a['seeds']}. Score = dev metric after the last epoch, in points (no "
              "epoch selected on dev). Tasks: " + "; ".join(
                  f"{TASKS[t].label} ({r['task_rows'][t]['train']:,} train / {r['task_rows'][t]['dev']:,} dev rows)"
                  for t in tasks) + "." + (" STS-B's figure is Spearman's rank correlation." if "stsb" in tasks else "")
              + (" The author task's sentences come from two books that are also in the pretraining text (without "
                 "their labels), for every arm." if "author" in tasks else ""), "",
              f"Scores: mean ± half-range over fine-tuning seeds (n={a['seeds']} unless shown). Mean = mean over "
              "tasks per seed, then over seeds.", "",
              "| arm | budget | TFLOP | " + " | ".join(TASKS[t].label for t in tasks) + " | mean |",
              "|---|---|---:|" + "---:|" * (len(tasks) + 1)]
    for name, p in r["pretrain"].items():
        for k, point in enumerate(points):
            row = s["table"].get(name, {}).get(point, {})
            flops = p["points"][k] * p["flops_per_step"] / 1e12
            lines.append(f"| {p['label']} | {point} | {flops:.4g} | "
                         + " | ".join(cell(row.get(t)) for t in tasks) + f" | {cell(row.get('mean'))} |")
    init = s["table"].get("init", {}).get("0")
    if init:
        lines.append("| random init (no pretraining) | 0 | 0 | " + " | ".join(cell(init.get(t)) for t in tasks)
                     + f" | {cell(init.get('mean'))} |")
    if r.get("finetune_left"):
        lines += ["", f"Not fine-tuned ({len(r['finetune_left'])}): " + "; ".join(
            f"{j['arm']} {j['point']} {j['task']} seed {j['seed']} ({j['why']})" for j in r["finetune_left"][:12])
            + (" …" if len(r["finetune_left"]) > 12 else "")]
    lines += ["", "## Do the differences exceed the seed spread?", "", f"Definition: {SPREAD_DEFINITION}.", "",
              "Checked at every budget point for every pair of arms on the mean downstream score:", "",
              "| budget | pairs separated | pairs |", "|---|---:|---|"]
    for point in points:
        pairs = s["pairs"].get(point, [])
        text = "; ".join(f"{ARMS[q['higher']].label.split(' ', 1)[0]} > {ARMS[q['lower']].label.split(' ', 1)[0]} "
                         f"by {q['difference']:.2f} ({'separated' if q['separated'] else 'within spread'})"
                         for q in pairs)
        lines.append(f"| {point} | {sum(q['separated'] for q in pairs)} of {len(pairs)} | {text or '–'} |")
    final = s["pairs"].get(points[-1], [])
    n_sep = sum(q["separated"] for q in final)
    lines += ["", f"At the final budget point {n_sep} of {len(final)} differences between arms exceed the seed spread"
              + (": the budget resolves the ranking only for the separated pairs; the others are within "
                 "fine-tuning noise at this budget." if final and n_sep < len(final) else
                 ": the budget is long enough to rank every pair." if final else "."),
              "The spread covers fine-tuning seeds only: each arm was pretrained once (seed 42), so "
              "pretraining-seed variance is not in it.", *against_init(r, points[-1]), "", "## Target", "",
              "| target | result | verdict |", "|---|---|---|",
              f"| ELECTRA's mean downstream score >= {TARGET_MARGIN:g} points above MLM + NSP at equal compute "
              f"(final budget point), beyond the seed spread | {s['target']['why']} | **{s['target']['verdict']}** |"]
    if "span_target" in s:
        lines.append(f"| span masking no worse than whole-word masking on SQuAD F1 at equal compute (final budget "
                     f"point), judged against the seed spread | {s['span_target']['why']} | "
                     f"**{s['span_target']['verdict']}** |")
    lines.append("")
    return "\n".join(lines)


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["args"]["tasks"]
    panels = tasks + ["mean"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    table = results["summary"]["table"]
    init = table.get("init", {}).get("0", {})
    for ax, panel in zip(axes[0], panels):
        for name, p in results["pretrain"].items():
            pts = [(p["points"][k] * p["flops_per_step"] / 1e12, table.get(name, {}).get(f"{k + 1}/{POINTS}", {}).get(panel))
                   for k in range(POINTS)]
            pts = [(x, c) for x, c in pts if c]
            if init.get(panel):
                pts.insert(0, (0.0, init[panel]))
            if pts:
                ax.errorbar([x for x, _ in pts], [c["mean"] for _, c in pts],
                            yerr=[[c["mean"] - c["min"] for _, c in pts], [c["max"] - c["mean"] for _, c in pts]],
                            marker="o", capsize=3, label=p["label"])
        ax.set_title(TASKS[panel].label if panel in TASKS else "mean over tasks")
        ax.set_xlabel("pretraining TFLOP")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("dev score (points); bars: seed min–max")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def machine() -> str:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor() or platform.machine())
    gpu = (f"; GPU {torch.cuda.get_device_name(0)} (pretraining and fine-tuning on it)"
           if torch.cuda.is_available() else "")
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; python "
            f"{platform.python_version()}, torch {torch.__version__}{gpu}")


def save(results: dict, args) -> None:
    results["summary"] = summarize(results)
    done = [r for cells in results["finetune"].values() for tasks in cells.values() for seeds in tasks.values()
            for r in seeds.values()]
    results["finetune_count"], results["finetune_wall_s"] = len(done), sum(r["wall_s"] for r in done)
    results["wall_s"] = time.time() - results["_t0"]
    Path(args.out_json).write_text(json.dumps({k: v for k, v in results.items() if not k.startswith("_")},
                                              indent=1, default=str) + "\n")
    Path(args.out_md).write_text(render_md(results))


# ---------------------------------------------------------------- main
SMOKE = {"preset": "mini", "budget_steps": 6, "batch": 8, "seeds": 2, "sst2_train": 96, "stsb_train": 96,
         "author_train": 96, "squad_train": 96, "dev_rows": 96, "finetune_epochs": 1.0, "finetune_seq": 32,
         "squad_seq": 128, "max_books_mb": 1.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--work", default="/tmp/bertdist-objectives", help="records, runs and fine-tunes (reused)")
    p.add_argument("--out-md", default=None, help="results Markdown (needed unless --pack)")
    p.add_argument("--out-json", default=None, help="default: --out-md with .json")
    p.add_argument("--out-png", default=None, help="default: --out-md with .png")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated subset of {','.join(ARMS)} (wwm: span masking's whole-word baseline)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--budget-steps", type=int, default=2100, help=f"the FLOP budget as steps of the {BASE_ARM} arm")
    p.add_argument("--budget-tflops", type=float, default=None, help="the FLOP budget in TFLOP (wins over --budget-steps)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="pretraining peak learning rate (AdamW)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="pretraining precision (bf16: fp32 master weights; for a GPU)")
    p.add_argument("--warmup-fraction", type=float, default=0.06)
    p.add_argument("--electra-embedding-size", type=int, default=None,
                   help="ELECTRA's shared embedding width (default: the hidden size, the other arms' encoder)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="train a WordPiece vocab of this size on the pretraining corpus (default: BERT's "
                        "uncased 30,522-token vocab)")
    p.add_argument("--max-books-mb", type=float, default=None, help="use only books adding up to this many MB")
    p.add_argument("--tasks", default="sst2,stsb,author", help="comma-separated subset of sst2,stsb,author,squad")
    p.add_argument("--seeds", type=int, default=2, help="fine-tuning seeds per task")
    p.add_argument("--sst2-train", type=int, default=2000, help="seeded subset of the 67,349 train rows")
    p.add_argument("--stsb-train", type=int, default=1500, help="seeded subset of the 5,749 train rows (0: all)")
    p.add_argument("--author-train", type=int, default=1000, help="seeded subset of about 2,000 train rows (0: all)")
    p.add_argument("--squad-train", type=int, default=0,
                   help="the first N questions of the SQuAD train half (0: all 5,000-odd)")
    p.add_argument("--squad-seq", type=int, default=256, help="SQuAD's fine-tuning window (doc stride a quarter of it)")
    p.add_argument("--dev-rows", type=int, default=None, help="score on the first N dev rows (default: all)")
    p.add_argument("--finetune-epochs", type=float, default=2.0)
    # 1e-3: of 1e-4, 3e-4 and 1e-3, the only rate at which the randomly initialised mini learned
    # SST-2 (2,000 rows, 2 epochs) at all; a higher rate than for a fully pretrained BERT, as the
    # checkpoints of a CPU-sized budget are far from one
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--finetune-seq", type=int, default=64)
    p.add_argument("--shared", default=str(SHARED), help="the shared data (vocab, wiki, books, glue)")
    p.add_argument("--pack", default=None, metavar="DIR",
                   help="build the records and task data, copy them with the vocab into DIR (which must be empty "
                        "or absent) for a machine without ../shared or Beam, and stop")
    p.add_argument("--concurrent-pretrain", action="store_true",
                   help="pretrain all arms at once (on a GPU, where small models leave the device mostly idle); "
                        "step and wall times then include the arms' contention, FLOPs do not")
    p.add_argument("--pretrain-timeout-s", type=float, default=None,
                   help="kill pretraining still running after this long; the checkpoints it reached are fine-tuned")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="start no fine-tune after this many seconds from the start (the report says what was left)")
    p.add_argument("--finetune-workers", type=int, default=1, help="fine-tune in this many spawned processes")
    p.add_argument("--pretrain-only", action="store_true", help="build the records and pretrain, then stop")
    p.add_argument("--no-init-baseline", action="store_true", help="skip fine-tuning the random initialisation")
    p.add_argument("--smoke", action="store_true", help="tiny sizes end to end: " + str(SMOKE))
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    args.arms = [a for a in args.arms.split(",") if a]
    args.tasks = [t for t in args.tasks.split(",") if t]
    bad = [a for a in args.arms if a not in ARMS] + [t for t in args.tasks if t not in TASKS]
    if bad or not args.arms or not args.tasks:
        p.error(f"unknown or empty --arms/--tasks: {bad or 'empty'}; arms are {list(ARMS)}, tasks {list(TASKS)}")
    if not args.out_md and not args.pack:
        p.error("--out-md is needed (unless --pack)")
    args.vocab = Path(args.shared) / "vocab" / VOCAB_NAME
    if args.out_md:
        args.out_json = args.out_json or str(Path(args.out_md).with_suffix(".json"))
        args.out_png = args.out_png or str(Path(args.out_md).with_suffix(".png"))
    return args


def pack(dest: Path, args, data: dict, task_dirs: dict) -> None:
    """Copy into ``dest`` what these settings need on a machine without ../shared, Beam or
    blingfire (a GPU node): ``shared/vocab``, and a work folder with the records, the task data
    and a trained vocab. Run there with ``--shared DEST/shared --work DEST/work``."""
    if dest.exists() and any(dest.iterdir()):
        sys.exit(f"--pack {dest}: the folder is not empty; choose another or remove it")
    (dest / "shared" / "vocab").mkdir(parents=True)
    shutil.copy2(Path(args.shared) / "vocab" / VOCAB_NAME, dest / "shared" / "vocab" / VOCAB_NAME)
    if args.vocab_size:
        (dest / "work" / "vocab").mkdir(parents=True)
        shutil.copy2(args.vocab, dest / "work" / "vocab" / args.vocab.name)
    for d in data.values():
        folder = Path(d["manifest"]).parent
        shutil.copytree(folder, dest / "work" / "records" / folder.name)
    for folder in task_dirs.values():
        shutil.copytree(folder, dest / "work" / "tasks" / folder.name)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"packed {size / 2**20:.1f} MiB into {dest}: run with --shared {dest / 'shared'} --work {dest / 'work'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    shared, work = Path(args.shared), Path(args.work)
    if not shared.is_dir():
        sys.exit(f"needs the shared data (--shared) at {shared}")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.deadline_s if args.deadline_s else None
    if args.vocab_size:
        args.vocab = corpus_vocab(shared, work, args.max_books_mb, args.vocab_size)
    kinds = sorted({ARMS[a].records for a in args.arms})
    data = {k: build_records(shared, work, k, args.seq, args.max_books_mb, args.vocab) for k in kinds}
    train_rows = {"sst2": args.sst2_train or None, "stsb": args.stsb_train or None, "author": args.author_train or None,
                  "squad": args.squad_train or None}
    task_dirs = {t: write_task_data(shared, work, t, train_rows[t], args.dev_rows) for t in args.tasks}
    if args.pack:
        pack(Path(args.pack), args, data, task_dirs)
        return 0
    plan = plan_arms(args)
    for name, p in plan.items():
        print(f"{name}: {p['flops_per_step'] / 1e9:.1f} GFLOP/step x {p['steps']} steps = {p['flops'] / 1e12:.4g} TFLOP "
              f"(budget {p['budget_flops'] / 1e12:.4g}); checkpoints at {p['points']}", flush=True)
    jobs = [pretrain_job(name, plan[name], args, data) for name in args.arms]
    stopped = run_pretraining(jobs, args.concurrent_pretrain, args.pretrain_timeout_s)
    pretrained = {j["name"]: pretrain_result(j, stopped, args.concurrent_pretrain) for j in jobs}
    if args.pretrain_only:
        for name, p in pretrained.items():
            print(f"{name}: {p['steps']} steps, median step {p['median_step_s'] or 0:.3f} s, wall {p['wall_s'] or 0:.0f} s, "
                  f"{p['run_dir']}" + (f"; STOPPED: {p['stopped']}" if p["stopped"] else ""))
        return 0
    init_dir = None if args.no_init_baseline else random_init(work, args)
    results = {"command": "python " + shlex.join([str(Path(sys.argv[0])), *sys.argv[1:]]) if argv is None else
               "python benchmarks/objectives.py " + shlex.join(argv),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "args": vars(args), "data": data, "pretrain": pretrained, "finetune_settings": finetune_settings(args),
               "task_rows": {t: task_rows(t, d) for t, d in task_dirs.items()},
               "finetune": {}, "status": "fine-tuning (partial)", "_t0": t0}
    ft_key = {t: hashlib.sha1(json.dumps(finetune_settings(args, t), sort_keys=True).encode()).hexdigest()[:8]
              for t in args.tasks}
    ft_jobs = []
    for arm, point, ckpt in finetune_jobs(pretrained, init_dir):
        for task in args.tasks:
            for seed in range(1, args.seeds + 1):
                # named by the task's rows and the recipe, so a run with other settings never reuses it
                name = f"{task_dirs[task].name}-{ft_key[task]}-seed{seed}"
                out = (Path(ckpt) / "finetune" / name if arm == "init"
                       else Path(ckpt).parent.parent / "finetune" / point.replace("/", "of") / name)
                ft_jobs.append({"arm": arm, "point": point, "task": task, "seed": seed, "checkpoint": ckpt,
                                "data": task_dirs[task], "out": out})

    def done(job, res):
        results["finetune"].setdefault(job["arm"], {}).setdefault(job["point"], {}).setdefault(job["task"], {})[
            str(job["seed"])] = res
        print(f"{job['arm']} {job['point']} {job['task']} seed {job['seed']}: {res['score']:.2f} "
              f"({res['wall_s']:.1f} s)", flush=True)
        save(results, args)

    left = run_finetunes(ft_jobs, args, deadline, done)
    results["finetune_left"] = [{k: str(v) for k, v in job.items()} for job in left]
    for job in left:
        print(f"NOT RUN {job['arm']} {job['point']} {job['task']} seed {job['seed']}: {job['why']}", flush=True)
    results["status"] = "complete" if not left and not stopped else (
        f"partial: {len(stopped)} pretraining run(s) stopped early, {len(left)} fine-tune(s) not run or failed")
    save(results, args)
    plot(results, Path(args.out_png))
    print(Path(args.out_md).read_text())
    print(f"wrote {args.out_md}, {args.out_json}, {args.out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
