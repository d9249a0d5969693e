"""ModernBERT pretrained by bertdist's trainer against ``transformers.ModernBertForMaskedLM``
trained by a plain PyTorch loop: the same start, batches, masks, optimizer and schedule; held-out
MLM loss along the way and at the end, per seed; then the training step of both timed side by side
(CPU, fp32).

    python benchmarks/modernbert_parity.py --out benchmarks/results/modernbert_parity_cpu_DATE
    python benchmarks/modernbert_parity.py --steps 8 --eval-every 4 --seeds 1 --timing-rounds 2 --out /tmp/p

What each side is:

- ours: ``configs/pretrain/modernbert-tiny.yaml`` (overridden to ``--steps`` steps, a 10% warmup,
  ``--seq``), built by ``bertdist.train.inprocess.build_run`` as ``bertdist pretrain`` builds it:
  the DeepSpeed engine, the recipe's optimizer (torch AdamW on CPU) and LR schedule, the trainer's
  step (``step.train_step``: the loader's micro-batches fed packed, gradient accumulation, the
  gradient clipped to the recipe's norm), and its held-out evaluation (``step.evaluate``).
- reference: ``transformers.ModernBertForMaskedLM`` (``attn_implementation="sdpa"``, dense MLM
  head, as ``from_pretrained`` gives it) loaded from the directory ``bertdist/export/modernbert_hf.py``
  writes of our model's initial weights; trained by a loop written here: each micro-batch padded
  with its ``attention_mask``, loss / accumulation steps, backward; ``clip_grad_norm_``; ``torch.optim.AdamW``
  with the recipe's hyper-parameters and no weight decay on biases and norms; ``LambdaLR`` with a
  warmup-then-linear-decay multiplier written out here from the recipe's numbers (not bertdist's).

Batches: ``PretrainingLoader`` of the recipe (dynamic 30% masking, seeded by ``data.seed``) yields
each step's micro-batches once; both sides take the same tensors. Held-out: ``loader.eval_batches``
of the records' held-out split (fixed masks, ``eval.seed``), the same for both; the loss is the sum
of the masked positions' cross-entropy over their count. Seeds: seed ``s`` sets the initial weights
(``seed``) and the data order and masks (``data.seed``).

Verdict: the final held-out MLM loss of ours within ``--tolerance`` (3%) of the reference's, for
every seed. Exit status 1 and "NOT met" otherwise.

Speed: after training, the training step of each arm is timed on the same step batches (the
loader's, the global batch in its micro-batches): ``ours`` (the trainer's ``train_step`` through
the engine: packed forward, backward, clipping, optimizer and schedule step), ``hf-padded`` (the
reference loop's step: padded batches, dense head) and ``hf-packed-sparse`` (transformers' model on
the packed rows, positions restarting per sequence, one block-diagonal (+window) mask per layer
type, ``sparse_prediction=True``: the like-for-like arm; its inputs are built before the clock
starts, ours builds its packing inside its step). The arms take turns in rounds, the order rotating
each round, so a busy spell of a shared machine hits them alike; medians over the timed steps.

Records (``--work``): a WordPiece vocab of ``--vocab-size`` and unmasked records at ``--seq`` built
by the Beam pipeline from ``data_pipeline/samples`` (the bundled Gutenberg books and Wikipedia
sample), cached.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Run as a script, this folder comes first on sys.path, and its data_pipeline.py (a benchmark)
# would shadow the package of that name: the repository root goes first instead.
sys.path[:] = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
RECIPE = REPO / "configs" / "pretrain" / "modernbert-tiny.yaml"
SAMPLES = REPO / "data_pipeline" / "samples"
IGNORE = -100
ARMS = ("ours", "hf-padded", "hf-packed-sparse")


# ----- data ------------------------------------------------------------------------------------
def build_data(work: Path, seq: int, vocab_size: int = 3000) -> tuple[Path, Path]:
    """(manifest, vocab.txt) of unmasked records at ``seq`` from the bundled samples; cached in ``work``."""
    from data_pipeline import build_records
    from data_pipeline.config import InputConfig
    from data_pipeline.tokenization import train_vocab
    from data_pipeline.vocab_corpus import iter_sentences

    work.mkdir(parents=True, exist_ok=True)
    vocab = work / f"vocab{vocab_size}.txt"
    if not vocab.is_file():
        train_vocab(iter_sentences([InputConfig(kind="books", path=str(SAMPLES / "books"))]), vocab,
                    vocab_size=vocab_size, lowercase=True)
    out = work / f"records_seq{seq}_v{vocab_size}"
    manifest = out / "manifest.json"
    if not manifest.is_file():
        manifest = Path(build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], out, vocab,
                                      max_seq_length=seq, dupe_factor=2, num_shards=4, heldout_fraction=0.1,
                                      masking="dynamic"))
    return manifest, vocab


def train_config(manifest: Path, vocab: Path, run_dir: Path, *, seed: int, steps: int, seq: int,
                 micro: int, global_batch: int, eval_sequences: int, eval_micro: int, extra: tuple[str, ...] = ()):
    """The tiny recipe for this benchmark: ``steps`` steps, a 10% warmup and a linear decay to 0
    (the recipe's warmup-stable-decay would spend a short run on its plateau), the vocab's size;
    ``extra`` overrides win (``schedule.decay=wsd`` runs the recipe's shape on both sides)."""
    from bertdist.data import load_vocab
    from bertdist.train.config import load_train_config

    cfg = load_train_config(RECIPE, [
        f"run_dir={run_dir}", f"data.train_manifest={manifest}", f"data.vocab_file={vocab}",
        f"data.max_seq_length={seq}", f"model.max_position_embeddings={seq}", f"data.micro_batch_size={micro}",
        f"data.global_batch_size={global_batch}", "data.prefetch_steps=0", f"seed={seed}", f"data.seed={seed}",
        f"schedule.total_steps={steps}", f"schedule.warmup_steps={max(1, steps // 10)}", "schedule.decay=linear",
        f"eval.max_sequences={eval_sequences}", f"eval.micro_batch_size={eval_micro}", *extra])
    return dataclasses.replace(cfg, model=cfg.model.with_vocab(len(load_vocab(vocab))))


def loader_for(cfg):
    from bertdist.data import continuation_mask
    from bertdist.train.loader import PretrainingLoader, open_training_records

    records = open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length)
    accum = cfg.data.global_batch_size // cfg.data.micro_batch_size
    return PretrainingLoader(records, cfg.data, rank=0, world_size=1, grad_accum=accum,
                             continuation=continuation_mask(cfg.data.vocab_file))


def heldout_batches(cfg) -> list[dict]:
    from bertdist.data import continuation_mask
    from bertdist.train.loader import eval_batches, open_training_records

    held = open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length,
                                 split=cfg.data.eval_split)
    return eval_batches(held, cfg.data, continuation_mask(cfg.data.vocab_file), rank=0, world_size=1,
                        micro_batch_size=cfg.eval.micro_batch_size, max_sequences=cfg.eval.max_sequences,
                        seed=cfg.eval.seed)


def step_batches(cfg, n: int) -> list[list[dict]]:
    """The micro-batches of the first ``n`` optimizer steps, as the trainer's loader yields them."""
    from bertdist.train.loader import LoaderState

    gen = loader_for(cfg).steps(LoaderState())
    try:
        return [next(gen)[0] for _ in range(n)]
    finally:
        gen.close()


# ----- the reference: transformers' model in a plain loop ----------------------------------------
def hf_model(cfg_model, state_dict, *, sparse: bool = False):
    """transformers' ModernBertForMaskedLM from the directory our export writes of ``state_dict``."""
    import transformers

    from bertdist.export.modernbert_hf import write_modernbert_hf_dir

    with tempfile.TemporaryDirectory() as d:
        write_modernbert_hf_dir(d, cfg_model, state_dict)
        model = transformers.ModernBertForMaskedLM.from_pretrained(d, attn_implementation="sdpa",
                                                                   sparse_prediction=sparse)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model.train()


def lr_multiplier(warmup: int, total: int, decay_fraction: float | None = None, shape: str = "linear"):
    """Linear warmup to the peak over ``warmup`` updates; then, with ``decay_fraction`` None, linear
    decay to 0 at ``total``; else warmup-stable-decay: the peak until the last
    ``max(1, round(decay_fraction x total))`` updates (none when the fraction is 0), which go down to
    0 at ``total``, linearly or as 1 - sqrt. The value for LambdaLR's count ``k`` of completed
    updates is the lr of update k + 1."""
    decay = None if decay_fraction is None else (max(1, round(decay_fraction * total)) if decay_fraction else 0)

    def f(k: int) -> float:
        s = k + 1
        if s <= warmup:
            return s / warmup
        if decay is None:
            return max(0.0, 1.0 - (s - warmup) / (total - warmup))
        if decay == 0:
            return 1.0
        frac = min(1.0, max(0.0, (s - (total - decay)) / decay))
        return 1.0 - (math.sqrt(frac) if shape == "1-sqrt" else frac)
    return f


class Reference:
    """transformers' model, torch's AdamW and LambdaLR, gradient accumulation and clipping by hand."""

    def __init__(self, model, cfg):
        self.model, self.cfg = model, cfg
        o = cfg.optimizer
        assert o.name == "adamw", f"the reference loop reproduces AdamW; the recipe uses {o.name}"
        sch = cfg.schedule
        assert sch.decay in ("linear", "wsd") and sch.min_lr_ratio == 0.0, sch
        assert cfg.deepspeed.precision == "fp32"
        decay, no_decay = [], []
        for name, p in model.named_parameters():  # tied weights appear once
            (no_decay if any(t in name for t in o.no_decay) else decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_multiplier(sch.resolved_warmup_steps, sch.total_steps,
                                    sch.decay_fraction if sch.decay == "wsd" else None, sch.decay_shape))
        self.clip = cfg.deepspeed.gradient_clipping

    def step(self, micro_batches: list[dict], packed: list[dict] | None = None) -> dict:
        """One optimizer step; ``packed``: transformers' packed inputs of the micro-batches instead
        of the padded ones."""
        lr = self.opt.param_groups[0]["lr"]
        n = len(micro_batches)
        total = 0.0
        for i, mb in enumerate(micro_batches):
            inputs = packed[i] if packed is not None else dict(
                input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], labels=mb["labels"])
            loss = self.model(**inputs).loss
            (loss / n).backward()
            total += loss.item() / n
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else math.inf)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return {"loss": total, "lr": lr, "grad_norm": float(norm)}

    @torch.no_grad()
    def evaluate(self, batches: list[dict]) -> dict:
        self.model.eval()
        loss_sum, count, correct = 0.0, 0, 0
        for mb in batches:
            logits = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            labels = mb["labels"]
            keep = labels != IGNORE
            loss_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1),
                                        ignore_index=IGNORE, reduction="sum").item()
            count += int(keep.sum())
            correct += int(((logits.argmax(-1) == labels) & keep).sum())
        self.model.train()
        return {"mlm_loss": loss_sum / count, "mlm_acc": correct / count, "masked_tokens": count}


def hf_packed_inputs(mb: dict, half_window: int) -> dict:
    """transformers' inputs for a micro-batch's real tokens in one row [1, T]: positions restart in
    each sequence; a block-diagonal mask for the global layers, the same within the window for the
    local ones; only the masked positions go through the head (``sparse_prediction``)."""
    from bertdist.ops.windowed_attention import Packing

    index = mb["token_index"]
    ids, labels = mb["input_ids"].reshape(-1)[index], mb["labels"].reshape(-1)[index]
    packing = Packing.from_cu_seqlens(mb["cu_seqlens"], int(mb["max_seqlen"]), ids.shape[0])
    same = packing.sequence[:, None] == packing.sequence[None, :]
    near = (packing.position[:, None] - packing.position[None, :]).abs() <= half_window
    return dict(input_ids=ids[None], labels=labels[None], position_ids=packing.position[None],
                attention_mask={"full_attention": same[None, None], "sliding_attention": (same & near)[None, None]})


# ----- ours: the trainer's step ------------------------------------------------------------------
def build_run(cfg, device: torch.device):
    """``bertdist.train.inprocess.build_run`` with the recipe's gradient accumulation (global batch /
    micro-batch; ``build_run`` builds one micro-batch per step): the same calls, in the same order,
    as ``run_pretraining`` makes before its first step on one rank."""
    from bertdist.train.compile import apply_compile, decide_compile
    from bertdist.train.engine import build_engine
    from bertdist.train.inprocess import InProcessRun
    from bertdist.train.objective import build_objective
    from bertdist.train.restore import RestorePlan, new_state, restore
    from bertdist.train.step import StepRunner
    from bertdist.train.config import check_batch_sizes

    accum = check_batch_sizes(cfg.data, 1)
    built = build_engine(cfg, RestorePlan("fresh"), 1, accum, device.type)
    decision = decide_compile(cfg.model.compile, device.type)
    regions = apply_compile(built.engine.module, decision)
    objective = build_objective(cfg, built.engine.module, device, 0)
    restore(built.engine, built.scheduler, RestorePlan("fresh"), cfg, 0, new_state(cfg, 1, accum),
            objective.generators)
    built.engine.train()
    return InProcessRun(StepRunner.for_run(built.engine, cfg, device, accum, objective), built.engine,
                        decision.reason, len(regions))


class Ours:
    def __init__(self, cfg):
        self.cfg = cfg
        self.run = build_run(cfg, torch.device("cpu"))
        self.step_no = 0

    @property
    def module(self):
        return self.run.engine.module

    def step(self, micro_batches: list[dict]) -> dict:
        from bertdist.train.step import train_step

        self.step_no += 1
        res = train_step(self.run.runner, micro_batches, self.step_no, stop_requested=False)
        return {"loss": res.sums["loss"], "lr": res.lr, "grad_norm": res.grad_norm}

    def evaluate(self, batches: list[dict]) -> dict:
        from bertdist.train.step import evaluate

        return evaluate(self.run.engine, batches, torch.device("cpu"), self.run.runner.objective)


# ----- one seed ----------------------------------------------------------------------------------
def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def parity_seed(manifest: Path, vocab: Path, seed: int, args, log=print) -> dict:
    """Trains both sides ``args.steps`` steps from the same start on the same batches; returns
    the per-step rows, the held-out curve and the final held-out losses."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = train_config(manifest, vocab, Path(run_dir), seed=seed, steps=args.steps, seq=args.seq,
                           micro=args.micro, global_batch=args.global_batch, eval_sequences=args.eval_sequences,
                           eval_micro=args.eval_micro)
        t0 = time.perf_counter()
        batches = step_batches(cfg, args.steps)
        held = heldout_batches(cfg)
        ours = Ours(cfg)
        ref = Reference(hf_model(cfg.model, ours.module.state_dict()), cfg)
        prep_s = time.perf_counter() - t0
        # the same start: every weight equal, and the held-out loss of both
        theirs_sd = ref.model.state_dict()
        worst_weight = max(float((v - theirs_sd[k]).abs().max()) for k, v in ours.module.state_dict().items())
        curve = []

        def evaluate(step: int) -> None:
            o, r = ours.evaluate(held), ref.evaluate(held)
            assert o["masked_tokens"] == r["masked_tokens"], (o, r)
            curve.append({"step": step, "ours": o["mlm_loss"], "reference": r["mlm_loss"],
                          "ours_acc": o["mlm_acc"], "reference_acc": r["mlm_acc"],
                          "rel_diff": rel(o["mlm_loss"], r["mlm_loss"])})
            log(f"# seed {seed} step {step}: held-out MLM ours {o['mlm_loss']:.5f}, reference {r['mlm_loss']:.5f} "
                f"(rel. diff {curve[-1]['rel_diff']:.2e}); {o['masked_tokens']} masked tokens")

        evaluate(0)
        rows = []
        t_ours = t_ref = 0.0
        for step, mbs in enumerate(batches, 1):
            t = time.perf_counter()
            o = ours.step(mbs)
            t_ours += time.perf_counter() - t
            t = time.perf_counter()
            r = ref.step(mbs)
            t_ref += time.perf_counter() - t
            rows.append({"step": step, "ours_loss": o["loss"], "reference_loss": r["loss"], "ours_lr": o["lr"],
                         "reference_lr": r["lr"], "ours_grad_norm": o["grad_norm"],
                         "reference_grad_norm": r["grad_norm"]})
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                evaluate(step)
        final = curve[-1]
        unigram = unigram_loss(batches, held, cfg.model.vocab_size)
        out = {
            "seed": seed, "steps": args.steps, "initial_max_abs_weight_diff": worst_weight,
            "initial_heldout": {"ours": curve[0]["ours"], "reference": curve[0]["reference"],
                                "rel_diff": curve[0]["rel_diff"]},
            "final_heldout": {"ours": final["ours"], "reference": final["reference"], "rel_diff": final["rel_diff"]},
            "unigram_heldout_loss": unigram,
            "max_train_loss_rel_diff": max(rel(r["ours_loss"], r["reference_loss"]) for r in rows),
            "max_heldout_rel_diff": max(c["rel_diff"] for c in curve),
            "heldout_curve": curve, "train_steps": rows,
            "real_tokens_per_step": sum(int(mb["attention_mask"].sum()) for mb in batches[0]),
            "heldout_sequences": sum(int(mb["input_ids"].shape[0]) for mb in held),
            "heldout_masked_tokens": sum(int((mb["labels"] != IGNORE).sum()) for mb in held),
            "seconds": {"prepare": prep_s, "ours_train": t_ours, "reference_train": t_ref},
            "lr_schedule_equal": all(r["ours_lr"] == r["reference_lr"] for r in rows),
        }
        if args.timing_rounds and seed == args.seeds[0]:
            out["timing"] = time_steps(ours, ref, cfg, batches, args, log)
        return out


def unigram_loss(batches: list[list[dict]], held: list[dict], vocab_size: int) -> float:
    """The held-out loss of predicting every masked token by its frequency among the masked tokens
    of the training batches (add-one smoothed): what a model learns before it uses the context."""
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for mbs in batches:
        for mb in mbs:
            labels = mb["labels"][mb["labels"] != IGNORE]
            counts += torch.bincount(labels, minlength=vocab_size).double()
    logp = (counts / counts.sum()).log()
    labels = torch.cat([mb["labels"][mb["labels"] != IGNORE] for mb in held])
    return float(-logp[labels].mean())


# ----- speed -------------------------------------------------------------------------------------
def time_steps(ours: Ours, ref: Reference, cfg, batches: list[list[dict]], args, log=print) -> dict:
    """Interleaved rounds: in each, every arm takes ``args.timing_steps`` training steps on the same
    step batches, the order rotating round by round; the first ``args.timing_warmup`` rounds are
    not kept."""
    sparse = Reference(hf_model(cfg.model, ours.module.state_dict(), sparse=True), cfg)
    half = cfg.model.half_window
    n = args.timing_steps
    chosen = [batches[i % len(batches)] for i in range(args.timing_rounds * n)]
    packed = [[hf_packed_inputs(mb, half) for mb in mbs] for mbs in chosen]  # before the clock starts
    arms = {"ours": lambda i: ours.step(chosen[i]),
            "hf-padded": lambda i: ref.step(chosen[i]),
            "hf-packed-sparse": lambda i: sparse.step(chosen[i], packed[i])}
    rounds = []
    for rnd in range(args.timing_rounds):
        order = list(ARMS[rnd % 3:] + ARMS[:rnd % 3])
        row = {"round": rnd, "order": order, "warmup": rnd < args.timing_warmup, "ms": {}, "loss": {},
               "loadavg": os.getloadavg()[0]}
        for arm in order:
            times, losses = [], []
            for k in range(n):
                t = time.perf_counter()
                res = arms[arm](rnd * n + k)
                times.append((time.perf_counter() - t) * 1e3)
                losses.append(res["loss"])
            row["ms"][arm], row["loss"][arm] = times, losses
        rounds.append(row)
        log(f"# timing round {rnd + 1}/{args.timing_rounds}{' (warm-up)' if row['warmup'] else ''}: " + ", ".join(
            f"{a} {statistics.median(row['ms'][a]):.0f} ms" for a in ARMS) + f"; load {row['loadavg']:.2f}")
    # The first round's first step of every arm is on the same batch at the same weights (ours and the
    # reference have ended their schedules at lr 0; the sparse model starts from ours): the losses agree.
    first = {a: rounds[0]["loss"][a][0] for a in ARMS}
    spread = (max(first.values()) - min(first.values())) / abs(first["ours"])
    if spread > 1e-4:
        raise SystemExit(f"the arms' losses on the first timed batch differ (relative spread {spread:.1e}): {first}")
    kept = [r for r in rounds if not r["warmup"]]
    med = {a: statistics.median(t for r in kept for t in r["ms"][a]) for a in ARMS}
    per_round = [{a: statistics.median(r["ms"][a]) / statistics.median(r["ms"]["ours"]) for a in ARMS} for r in kept]
    return {
        "first_step_losses": first, "first_step_rel_spread": spread,
        "steps_per_arm_per_round": n, "rounds": len(rounds), "warmup_rounds": args.timing_warmup,
        "timed_steps_per_arm": len(kept) * n, "micro_batches_per_step": len(batches[0]),
        "real_tokens_per_step_mean": statistics.mean(sum(int(mb["attention_mask"].sum()) for mb in mbs)
                                                     for mbs in chosen),
        "median_ms": med,
        "min_ms": {a: min(t for r in kept for t in r["ms"][a]) for a in ARMS},
        "max_ms": {a: max(t for r in kept for t in r["ms"][a]) for a in ARMS},
        "ratio_over_ours": {a: med[a] / med["ours"] for a in ARMS},
        "per_round_ratio_over_ours": per_round,
        "raw_rounds": rounds,
    }


def parameter_count(cfg_model) -> int:
    from bertdist.model.modernbert import ModernBertForMaskedLM

    with torch.device("meta"):
        m = ModernBertForMaskedLM(cfg_model)
    return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())


# ----- report ------------------------------------------------------------------------------------
def verdict(seeds: list[dict], tolerance: float) -> tuple[bool, list[str]]:
    """(met, one line per seed): every seed's final held-out loss within ``tolerance`` of the reference's."""
    lines, ok = [], True
    for s in seeds:
        f = s["final_heldout"]
        good = math.isfinite(f["ours"]) and math.isfinite(f["reference"]) and f["rel_diff"] <= tolerance
        ok &= good
        lines.append(f"seed {s['seed']}: final held-out MLM loss ours {f['ours']:.5f}, reference {f['reference']:.5f}, "
                     f"relative difference {f['rel_diff']:.1e} ({'within' if good else 'NOT within'} "
                     f"{100 * tolerance:g}%)")
    return ok, lines


def env_text(load_before, load_after, threads: int) -> str:
    import transformers

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        model = "?"
    return "\n".join([
        "# bertdist CPU environment (benchmarks/modernbert_parity.py)",
        f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        f"host: {' '.join(platform.uname())}",
        f"cpu: {model}, {os.cpu_count()} logical CPUs",
        f"load average (1, 5, 15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
        f"{' '.join(f'{x:.2f}' for x in load_after)} (the machine is shared with other jobs)",
        f"threads: torch {threads}",
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
        "",
    ])


def markdown(res: dict) -> str:
    a = res["args"]
    ok, lines = verdict(res["seeds"], a["tolerance"])
    out = [f"# ModernBERT: bertdist's trainer against transformers' ModernBertForMaskedLM in a plain PyTorch loop (CPU)",
           "",
           f"Command (repository root, `PYTHONPATH=$PWD`): `{res['command']}`",
           f"Date {res['date']}; {res['env']}. Environment: `env.txt`; raw numbers: `results.json`.",
           "",
           "## What was run",
           "",
           f"- Model: ModernBERT `tiny` ({res['model']['num_hidden_layers']} layers: global, local, local; hidden "
           f"{res['model']['hidden_size']}, {res['model']['num_attention_heads']} heads, window "
           f"{res['model']['local_attention']}), a {res['model']['vocab_size']}-token WordPiece vocab, "
           f"{res['parameters']:,} parameters; fp32, dropout 0 in both.",
           f"- Data: records at seq {a['seq']} built by the Beam pipeline from `data_pipeline/samples` (Gutenberg "
           f"books + a Wikipedia sample), {res['train_sequences']:,} training and {res['heldout_sequences_total']:,} "
           f"held-out sequences; dynamic 30% masking (80/10/10) by `PretrainingLoader`, seeded. The vocab is trained "
           f"afresh when the work folder has none, and two builds on this machine gave different vocab files, so "
           f"the exact losses differ from build to build; both sides of a run always take the same build.",
           f"- Steps: {a['steps']} optimizer steps of {a['global_batch']} sequences ({a['global_batch'] // a['micro']} "
           f"micro-batches of {a['micro']}), about {res['seeds'][0]['real_tokens_per_step']:,} real tokens a step.",
           f"- Optimizer and schedule (the recipe `configs/pretrain/modernbert-tiny.yaml`): AdamW lr "
           f"{res['optimizer']['lr']:g}, betas {tuple(res['optimizer']['betas'])}, eps {res['optimizer']['eps']:g}, "
           f"weight decay {res['optimizer']['weight_decay']:g} (none on biases and norms); linear warmup over "
           f"{res['warmup_steps']} steps, linear decay to 0 at step {a['steps']}; gradients clipped to norm "
           f"{res['gradient_clipping']:g}.",
           "- Ours: the trainer's engine, objective and step, built by the calls `run_pretraining` makes before "
           "its first step (the script's `build_run`: `bertdist.train.inprocess.build_run` with the recipe's "
           "gradient accumulation), stepped by `step.train_step`: the loader's micro-batches fed packed (real "
           "tokens back to back, `cu_seqlens`), sparse MLM head, SDPA, eager (`model.compile: auto` is eager on "
           "CPU).",
           "- Reference: `transformers.ModernBertForMaskedLM`, `attn_implementation=\"sdpa\"`, loaded with "
           "`from_pretrained` from the directory `bertdist/export/modernbert_hf.py` writes of our initial weights; "
           "a plain loop: the same micro-batches padded with their `attention_mask`, loss / accumulation steps, "
           "backward, `clip_grad_norm_`, `torch.optim.AdamW`, `LambdaLR` (the multiplier written in the script, "
           "not bertdist's).",
           f"- Held-out: the first {res['seeds'][0]['heldout_sequences']} sequences of the held-out split, masked once "
           f"with fixed masks ({res['seeds'][0]['heldout_masked_tokens']:,} masked tokens), the same batches for both; "
           f"loss = summed cross-entropy of the masked tokens / their count; every {a['eval_every']} steps.",
           f"- Seeds: {', '.join(str(s) for s in a['seeds'])}: seed s sets the initial weights and the data order "
           "and masks.",
           f"- Wall time of the whole command: {res['wall_s']:.0f} s"
           + ({True: " (the vocab and records built first).", False: " (the vocab and records found built in the work "
               "folder).", None: "."}[res.get("records_built")]),
           "",
           "## Same start",
           "",
           "| seed | max abs weight difference at step 0 | held-out loss at step 0, ours | reference | relative difference |",
           "|---|---|---|---|---|"]
    for s in res["seeds"]:
        i = s["initial_heldout"]
        out.append(f"| {s['seed']} | {s['initial_max_abs_weight_diff']:.1e} | {i['ours']:.6f} | {i['reference']:.6f} "
                   f"| {i['rel_diff']:.1e} |")
    out += ["", "First training steps (loss as each side's step reports it: the mean over the micro-batches of the "
                "micro-batch's mean masked-token loss):", "",
            "| seed | step | ours | reference | relative difference | grad norm ours | reference |",
            "|---|---|---|---|---|---|---|"]
    for s in res["seeds"]:
        for r in s["train_steps"][:5]:
            out.append(f"| {s['seed']} | {r['step']} | {r['ours_loss']:.6f} | {r['reference_loss']:.6f} | "
                       f"{rel(r['ours_loss'], r['reference_loss']):.1e} | {r['ours_grad_norm']:.5f} | "
                       f"{r['reference_grad_norm']:.5f} |")
    out += ["", f"The learning rate of every step is the same on both sides: "
                f"{all(s['lr_schedule_equal'] for s in res['seeds'])}.", "",
            "## Held-out MLM loss along the way", "",
            "| step | " + " | ".join(f"seed {s['seed']} ours | seed {s['seed']} reference | rel. diff"
                                    for s in res["seeds"]) + " |",
            "|---|" + "---|---|---|" * len(res["seeds"])]
    steps = [c["step"] for c in res["seeds"][0]["heldout_curve"]]
    for k, step in enumerate(steps):
        cells = []
        for s in res["seeds"]:
            c = s["heldout_curve"][k]
            cells.append(f"{c['ours']:.5f} | {c['reference']:.5f} | {c['rel_diff']:.1e}")
        out.append(f"| {step} | " + " | ".join(cells) + " |")
    out += ["", "Training loss (mean of the step's micro-batches), every "
                f"{a['eval_every']} steps:", "",
            "| step | " + " | ".join(f"seed {s['seed']} ours | seed {s['seed']} reference" for s in res["seeds"]) + " |",
            "|---|" + "---|---|" * len(res["seeds"])]
    for step in steps[1:]:
        cells = []
        for s in res["seeds"]:
            r = s["train_steps"][step - 1]
            cells.append(f"{r['ours_loss']:.4f} | {r['reference_loss']:.4f}")
        out.append(f"| {step} | " + " | ".join(cells) + " |")
    out += ["", "## Final held-out MLM loss", "",
            "| seed | ours | reference | relative difference | largest relative difference, held-out (all evaluations) "
            "| largest relative difference, training loss (all steps) | unigram baseline |",
            "|---|---|---|---|---|---|---|"]
    for s in res["seeds"]:
        f = s["final_heldout"]
        out.append(f"| {s['seed']} | {f['ours']:.5f} | {f['reference']:.5f} | {f['rel_diff']:.1e} | "
                   f"{s['max_heldout_rel_diff']:.1e} | {s['max_train_loss_rel_diff']:.1e} | "
                   f"{s['unigram_heldout_loss']:.4f} |")
    below = [s["unigram_heldout_loss"] - max(s["final_heldout"]["ours"], s["final_heldout"]["reference"])
             for s in res["seeds"]]
    out += ["", "Unigram baseline: the held-out loss of predicting each masked token by its frequency among the "
                "masked tokens of the run's training batches (add-one smoothed), for scale. "
            + (f"Both sides end {min(below):.3f} to {max(below):.3f} below it, for every seed: they learned more "
               "than the token frequencies (from the context, or from the 10% of masked positions that keep their "
               "token)." if min(below) > 0 else
               "Not every run ends below it: at this budget the model has not learned past the token frequencies."),
            "", "## Verdict", ""] + [f"- {ln}" for ln in lines] + [
        "", f"**{'Met' if ok else 'NOT met'}**: the final held-out MLM loss of ours is "
            f"{'within' if ok else 'not within'} {100 * a['tolerance']:g}% of the reference's for every seed.", ""]
    t = res["seeds"][0].get("timing")
    if t:
        loads = [r["loadavg"] for r in t["raw_rounds"]]
        out += ["## Speed of the training step (CPU)", "",
                f"**The machine is shared** (2 cores, other engineers' jobs running; 1-minute load average "
                f"{res['load_before'][0]:.2f} before the run, {min(loads):.2f} to {max(loads):.2f} during the timing "
                f"rounds, {res['load_after'][0]:.2f} after; each round's in `results.json`): the figures are medians "
                "of steps taken in turns, and a busy spell can still move single steps (min and max columns) and "
                "the ratios between runs.", "",
                f"One step = the global batch of {a['global_batch']} sequences in {t['micro_batches_per_step']} "
                f"micro-batches (about {t['real_tokens_per_step_mean']:.0f} real tokens), forward, backward, "
                "clipping, optimizer and schedule step; the loader's batches, the same for every arm. "
                f"{t['rounds']} rounds ({t['warmup_rounds']} warm-up, not kept), each arm {t['steps_per_arm_per_round']} "
                f"steps a round, the order rotating; {t['timed_steps_per_arm']} timed steps per arm; "
                f"torch {a['threads']} thread(s).", "",
                "| arm | median ms | min ms | max ms | arm / ours (medians) |", "|---|---|---|---|---|"]
        for arm in ARMS:
            out.append(f"| {arm} | {t['median_ms'][arm]:.1f} | {t['min_ms'][arm]:.1f} | {t['max_ms'][arm]:.1f} | "
                       f"{t['ratio_over_ours'][arm]:.3f} |")
        pr = t["per_round_ratio_over_ours"]
        out += ["", "Per kept round, the ratio of the round's medians (arm / ours): " + "; ".join(
            f"{a2} " + ", ".join(f"{r[a2]:.2f}" for r in pr) for a2 in ARMS[1:]) + ".", "",
            "The three arms' losses on the first timed batch, at the same weights: "
            + ", ".join(f"{a2} {t['first_step_losses'][a2]:.6f}" for a2 in ARMS)
            + f" (relative spread {t['first_step_rel_spread']:.1e}): they compute the same thing.", "",
            "- ours: the trainer's `train_step` through the DeepSpeed engine (packing built inside the step, "
            "sparse MLM head, SDPA).",
            "- hf-padded: the reference loop's step (padded micro-batches with `attention_mask`, dense MLM head, SDPA): "
            "transformers' model as it runs on CPU.",
            "- hf-packed-sparse: transformers' model on each micro-batch's real tokens in one row, positions "
            "restarting per sequence, a block-diagonal mask (windowed for the local layers) per layer type, "
            "`sparse_prediction=True`; its inputs (masks, positions) are built before the clock starts. "
            "transformers has no variable-length attention on CPU, so this arm's SDPA runs over the whole "
            "[T, T] of a micro-batch's row (T = its real tokens) under the mask.",
            ""]
        out += ["`benchmarks/modernbert_cpu.py` times the models' forward and backward alone on synthetic packed "
                "batches; this is the whole training step, on the loader's batches of the recipe.", ""]
        slower = [arm for arm in ARMS[1:] if t["ratio_over_ours"][arm] < 1.0]
        out.append("Our step's median is at or below both transformers arms' in this run." if not slower else
                   f"Our step's median is above {', '.join(slower)}'s in this run.")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bertdist-modernbert-parity",
                   help="where the vocab and records are built and cached")
    p.add_argument("--manifest", type=Path, help="records to use instead of building them (with --vocab)")
    p.add_argument("--vocab", type=Path)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-sequences", type=int, default=256)
    p.add_argument("--eval-micro", type=int, default=32)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--timing-rounds", type=int, default=8, help="0: no timing")
    p.add_argument("--timing-steps", type=int, default=3, help="steps per arm per round")
    p.add_argument("--timing-warmup", type=int, default=1, help="rounds not kept")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="results folder: report.md, results.json, env.txt")
    p.add_argument("--render", type=Path, help="only rewrite report.md of this results folder from its results.json")
    args = p.parse_args(argv)
    if args.render:
        res = json.loads((args.render / "results.json").read_text())
        (args.render / "report.md").write_text(markdown(res))
        return 0 if res["met"] else 1
    if args.timing_rounds and args.timing_rounds <= args.timing_warmup:
        p.error("--timing-rounds must exceed --timing-warmup")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    if args.manifest:
        manifest, vocab = args.manifest, args.vocab
        built = False
    else:
        built = not (args.work / f"records_seq{args.seq}_v3000" / "manifest.json").is_file()
        manifest, vocab = build_data(args.work, args.seq)
    import transformers

    from bertdist.train.distributed import single_process_group
    from bertdist.train.loader import open_training_records

    seeds = []
    with single_process_group():
        for seed in args.seeds:
            seeds.append(parity_seed(manifest, vocab, seed, args, log=lambda m: print(m, file=sys.stderr, flush=True)))
    cfg = train_config(manifest, vocab, Path("unused"), seed=args.seeds[0], steps=args.steps, seq=args.seq,
                       micro=args.micro, global_batch=args.global_batch, eval_sequences=args.eval_sequences,
                       eval_micro=args.eval_micro)
    res = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/modernbert_parity.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "env": f"python {platform.python_version()}, torch {torch.__version__}, transformers "
               f"{transformers.__version__}, {os.cpu_count()} CPUs, {args.threads} torch thread(s)",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": dataclasses.asdict(cfg.model),
        "parameters": parameter_count(cfg.model),
        "optimizer": dataclasses.asdict(cfg.optimizer), "warmup_steps": cfg.schedule.resolved_warmup_steps,
        "gradient_clipping": cfg.deepspeed.gradient_clipping,
        "train_sequences": open_training_records(str(manifest), str(vocab), args.seq).num_rows,
        "heldout_sequences_total": open_training_records(str(manifest), str(vocab), args.seq, split="heldout").num_rows,
        "seeds": seeds, "load_before": load_before, "load_after": os.getloadavg(),
        "wall_s": time.perf_counter() - t0, "records_built": built,
    }
    ok, lines = verdict(seeds, args.tolerance)
    res["met"] = ok
    for ln in lines:
        print(ln)
    t = seeds[0].get("timing")
    if t:
        print("step time medians (ms): " + ", ".join(f"{a} {t['median_ms'][a]:.1f}" for a in ARMS)
              + "; arm / ours: " + ", ".join(f"{a} {t['ratio_over_ours'][a]:.3f}" for a in ARMS[1:])
              + " (a shared machine: see the report)")
    print(f"{'met' if ok else 'NOT met'}: final held-out MLM loss within {100 * args.tolerance:g}% of the "
          f"reference for every seed ({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "report.md").write_text(markdown(res))
        (args.out / "env.txt").write_text(env_text(load_before, res["load_after"], args.threads))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
