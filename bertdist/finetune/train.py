"""The fine-tuning loop: load weights, build the task model, train, evaluate, write outputs.

``run_finetune(cfg)`` runs one training per (learning rate, seed) of the sweep
(one run without a sweep), keeps the best on the dev set's main metric and
writes, under ``cfg.output_dir``: ``metrics.json`` (every run and the chosen
one), ``predictions/`` (dev predictions; SQuAD's official ``predictions.json``),
``glue_submission/`` (test-set predictions in the GLUE leaderboard format),
``tensorboard/`` and the resolved ``config.yaml``. Single process, or DeepSpeed
data parallel when ``cfg.deepspeed`` (launched with torchrun/deepspeed).
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from bertdist.config import save_config
from bertdist.export.encoders import family_of
from bertdist.export.sources import PretrainedWeights, load_pretrained
from bertdist.export.tokenizer import bert_tokenizer, read_vocab, vocab_sha256
from bertdist.finetune.config import FinetuneConfig
from bertdist.finetune.errors import DataError
from bertdist.finetune.heads import BertForTask, task_model
from bertdist.finetune.tasks import EvalSet, Runner, dump_json, make_runner
from bertdist.model import IGNORE_INDEX
from bertdist.train.distributed import local_device, rank_and_world, start_process_group


class VocabMismatch(DataError):
    """The checkpoint was trained with another vocabulary than the one the data is tokenized with."""


# ---------------------------------------------------------------- setup
def resolve_tokenizer(cfg: FinetuneConfig, w: PretrainedWeights):
    """The data tokenizer, checked against the checkpoint's vocab (same tokens, same size, same casing);
    a checkpoint that brings its own ``tokenizer.json`` (ModernBERT) is tokenized with that."""
    if w.tokenizer_json is not None:
        return checkpoint_tokenizer(cfg, w)
    vocab = cfg.vocab_file or w.vocab_file
    if vocab is None:
        raise VocabMismatch(f"the checkpoint {cfg.checkpoint} does not name its vocab; set vocab_file")
    if cfg.vocab_file and w.vocab_file and vocab_sha256(cfg.vocab_file) != vocab_sha256(w.vocab_file):
        raise VocabMismatch(
            f"the checkpoint's vocab {w.vocab_file} ({len(read_vocab(w.vocab_file))} tokens, sha256 "
            f"{vocab_sha256(w.vocab_file)[:12]}) does not match the data tokenizer's vocab {cfg.vocab_file} "
            f"({len(read_vocab(cfg.vocab_file))} tokens, sha256 {vocab_sha256(cfg.vocab_file)[:12]})")
    n = len(read_vocab(vocab))
    if n > w.config.vocab_size or (n != w.config.vocab_size and not family_of(w.config).padded_vocab):
        raise VocabMismatch(f"the data tokenizer's vocab {vocab} has {n} tokens but the checkpoint's "
                            f"embeddings have {w.config.vocab_size} rows")
    if cfg.do_lower_case is not None and w.do_lower_case is not None and cfg.do_lower_case != w.do_lower_case:
        raise VocabMismatch(f"the checkpoint was trained {'uncased' if w.do_lower_case else 'cased'}, "
                            f"but do_lower_case={cfg.do_lower_case} was asked for")
    lower = cfg.do_lower_case if cfg.do_lower_case is not None else w.do_lower_case
    return bert_tokenizer(vocab, lower)


def checkpoint_tokenizer(cfg: FinetuneConfig, w: PretrainedWeights):
    """The fast tokenizer the checkpoint came with; a WordPiece ``vocab_file`` cannot replace it."""
    from bertdist.export.tokenizer import fast_tokenizer

    if cfg.vocab_file:
        raise VocabMismatch(f"the checkpoint {cfg.checkpoint} brings its own tokenizer ({w.tokenizer_json}); "
                            f"vocab_file={cfg.vocab_file} (a WordPiece vocab) cannot replace it: leave vocab_file unset")
    tok = fast_tokenizer(w.tokenizer_json)
    if len(tok) > w.config.vocab_size:
        raise VocabMismatch(f"the checkpoint's tokenizer {w.tokenizer_json} has {len(tok)} tokens but its "
                            f"embeddings have {w.config.vocab_size} rows")
    return tok


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- batching
def collate(features: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad a list of features to the longest in the batch (choice features: [C, S] each)."""
    out = {}
    keys = [k for k in features[0] if not k.startswith("_")]
    choice = isinstance(features[0]["input_ids"][0], list)
    lengths = [len(x) for f in features for x in (f["input_ids"] if choice else [f["input_ids"]])]
    width = max(lengths)
    for k in keys:
        vals = [f[k] for f in features]
        if k in ("labels",) and not isinstance(vals[0], list) or k in ("start_positions", "end_positions"):
            out[k] = torch.tensor(vals, dtype=torch.float32 if isinstance(vals[0], float) else torch.long)
            continue
        fill = IGNORE_INDEX if k == "labels" else (pad_id if k == "input_ids" else 0)
        if choice:
            arr = [[row + [fill] * (width - len(row)) for row in v] for v in vals]
        else:
            arr = [v + [fill] * (width - len(v)) for v in vals]
        out[k] = torch.tensor(arr, dtype=torch.long)
    return out


def batches(features: list[dict], size: int, order: list[int] | None = None):
    idx = order if order is not None else list(range(len(features)))
    for i in range(0, len(idx), size):
        yield idx[i:i + size], collate([features[j] for j in idx[i:i + size]])


@torch.no_grad()
def predict(model: torch.nn.Module, features: list[dict], cfg: FinetuneConfig, device: torch.device) -> list[np.ndarray]:
    """Logits per feature (token/span tasks: trimmed to the feature's own length)."""
    model.eval()
    out: list[np.ndarray] = []
    for idx, batch in batches(features, cfg.eval_batch_size):
        batch = {k: v.to(device) for k, v in batch.items() if k not in ("labels", "start_positions", "end_positions")}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
            logits, _ = model(batch)
        logits = logits.float().cpu().numpy()
        for row, j in enumerate(idx):
            n = len(features[j]["input_ids"])
            out.append(logits[row, :n] if logits.ndim == 3 else logits[row])
    return out


def majority_baseline(runner: Runner, es: EvalSet) -> dict | None:
    """Accuracy of always predicting the dev set's most frequent label (classification tasks only)."""
    if runner.kind != "classification":
        return None
    labels = [f["labels"] for f in es.features]
    counts = np.bincount(labels, minlength=runner.num_labels)
    n_classes = runner.num_labels
    one_hot = np.eye(n_classes)[int(counts.argmax())]
    metrics, _ = runner.score(es, [one_hot] * len(labels))
    return {"label": runner.label_names[int(counts.argmax())], **metrics}


# ---------------------------------------------------------------- one training run
def param_groups(model: BertForTask, cfg: FinetuneConfig, lr: float) -> list[dict]:
    """No weight decay on biases and layer norms; the new head may get its own (higher) lr."""
    head_ids = {id(p) for m in model.head_modules() for p in m.parameters()}
    head_lr = cfg.head_learning_rate if cfg.head_learning_rate is not None else lr
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = not (name.endswith("bias") or "LayerNorm" in name or "norm." in name)  # ModernBERT's *norm
        key = (id(p) in head_ids, decay)
        groups.setdefault(key, []).append(p)
    return [{"params": ps, "lr": head_lr if is_head else lr, "weight_decay": cfg.weight_decay if decay else 0.0}
            for (is_head, decay), ps in groups.items()]


def total_steps(cfg: FinetuneConfig, n_rows: int) -> int:
    """``max_steps``, else ``epochs`` passes over ``n_rows`` at the global ``batch_size``."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(1, math.ceil(math.ceil(n_rows / cfg.batch_size) * cfg.epochs))


def warmup_steps(warmup_ratio: float, total: int) -> int:
    """The warmup's length in steps: ``ceil(ratio x total)``, as Hugging Face's Trainer counts it."""
    return math.ceil(warmup_ratio * total)


def linear_warmup_decay(step: int, warmup: int, total: int) -> float:
    """The learning-rate multiplier at ``step`` (0-based): up from 0 over ``warmup`` steps, then
    down to 0 at ``total``. The same values as google-research/bert's schedule and transformers'
    ``get_linear_schedule_with_warmup``, so a recipe means the same here as in theirs."""
    if step < warmup:
        return step / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def build_optimization(model: torch.nn.Module, cfg: FinetuneConfig, groups: list[dict], lr: float, micro: int,
                       total: int):
    """AdamW over ``groups`` with linear warmup and decay over ``total`` steps, wrapped in a
    DeepSpeed engine when ``cfg.deepspeed`` (else ``engine`` is None): (engine, optimizer, scheduler)."""
    warmup = warmup_steps(cfg.warmup_ratio, total)
    opt = torch.optim.AdamW(groups, lr=lr, eps=cfg.adam_epsilon)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_warmup_decay(s, warmup, total))
    engine = None
    if cfg.deepspeed:
        import deepspeed

        ds_cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "gradient_clipping": cfg.max_grad_norm, "zero_optimization": {"stage": cfg.zero_stage},
                  "zero_allow_untested_optimizer": True, "bf16": {"enabled": cfg.precision == "bf16"},
                  "steps_per_print": 10 ** 9}
        engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_cfg)
    return engine, opt, sched


def apply_update(engine, opt, sched, loss: torch.Tensor, params: list, max_grad_norm: float) -> None:
    """Backward and one optimizer step: through the DeepSpeed engine (which clips), or plain torch."""
    if engine is not None:
        engine.backward(loss)
        engine.step()
        return
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def train_once(cfg: FinetuneConfig, runner: Runner, w: PretrainedWeights, train_feats: list[dict],
               eval_sets: list[EvalSet], lr: float, seed: int, run_dir: Path) -> dict:
    seed_everything(seed)
    device = local_device(cfg.device)
    family = family_of(w.config)
    mcfg = family.with_kernels(family.with_dropout(w.config, cfg.hidden_dropout_prob), cfg.kernels)
    model = task_model(mcfg, runner.kind, runner.num_labels, device_type=device.type, **head_options(cfg, w))
    model.load_backbone(w.state_dict)
    model.to(device)
    rank, world = rank_and_world()
    if cfg.batch_size % world:
        raise DataError(f"batch_size {cfg.batch_size} is not divisible by the {world} processes")
    micro = cfg.batch_size // world
    family.decide_attention(model, device, batch=micro, seq=cfg.max_seq_length, precision=cfg.precision)
    total = total_steps(cfg, len(train_feats))
    engine, opt, sched = build_optimization(model, cfg, param_groups(model, cfg, lr), lr, micro, total)
    writer = None
    if cfg.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tensorboard"))
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"{runner.__class__.__name__[:-6].lower()} lr={lr:g} seed={seed}",
               disable=not cfg.progress or rank != 0, dynamic_ncols=True)
    g = torch.Generator().manual_seed(seed)
    step, history, best = 0, [], None
    t0 = time.time()
    epoch = 0
    while step < total:
        order = torch.randperm(len(train_feats), generator=g).tolist()
        if world > 1:
            # Rank r takes every world-th example: rank batches of `micro` together form exactly the
            # single-process batch of `batch_size`. Equal counts per rank, or the all-reduce would hang.
            order = order[:len(order) - len(order) % world][rank::world]
        model.train()
        for _, batch in batches(train_feats, micro, order):
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16" and engine is None):
                _, loss = (engine or model)(batch)
            apply_update(engine, opt, sched, loss, list(model.parameters()), cfg.max_grad_norm)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            if writer is not None:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0] if hasattr(sched, "get_last_lr") else lr, step)
            if step >= total:
                break
        epoch += 1
        result = evaluate(model, runner, eval_sets, cfg, device)
        result.update(epoch=epoch, step=step)
        history.append({k: v for k, v in result.items() if k != "_rows"})
        if writer is not None:
            for split, m in result["metrics"].items():
                for k, v in m.items():
                    if isinstance(v, (int, float)):
                        writer.add_scalar(f"{split}/{k}", v, step)
        if best is None or result["score"] > best["score"]:
            best = result
            if cfg.save_model or cfg.predict_test:
                best["_state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    bar.close()
    if writer is not None:
        writer.close()
    best["train_seconds"] = time.time() - t0
    best["history"] = history
    best["lr"], best["seed"], best["steps"] = lr, seed, total
    best["kernel_sources"] = family.kernel_sources(model)  # what `kernels` resolved to, per op
    return best


def head_options(cfg: FinetuneConfig, w: PretrainedWeights) -> dict:
    """What the backbone family's task heads take from the fine-tuning config."""
    return family_of(w.config).head_options(cfg)


def evaluate(model, runner: Runner, eval_sets: list[EvalSet], cfg, device) -> dict:
    metrics, rows = {}, {}
    for es in eval_sets:
        m, r = runner.score(es, predict(model, es.features, cfg, device))
        metrics[es.name], rows[es.name] = m, r
    main = metrics[eval_sets[0].name][runner.main_metric]
    return {"metrics": metrics, "score": main, "_rows": rows}


# ---------------------------------------------------------------- the sweep and the outputs
def run_finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune (with the configured sweep/restarts), write outputs, return the metrics JSON as a dict."""
    if cfg.deepspeed and cfg.zero_stage not in (0, 1, 2):
        # Evaluation and best-model snapshots read full parameters on every rank; ZeRO-3 shards them.
        raise DataError(f"zero_stage={cfg.zero_stage}: fine-tuning supports ZeRO stages 0-2 "
                        "(BERT-large fits on one device for fine-tuning; use stage 2 to shard optimizer state)")
    if cfg.deepspeed:
        start_process_group(deepspeed=True)
    rank, _ = rank_and_world()
    out = Path(cfg.output_dir)
    w = load_pretrained(cfg.checkpoint)
    tok = resolve_tokenizer(cfg, w)
    runner = make_runner(cfg.task, cfg.data, tok, cfg)
    train_feats = runner.train_features()
    if not train_feats:
        raise DataError(f"{cfg.data}: no training examples")
    eval_sets = runner.eval_sets()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    lrs = cfg.sweep_learning_rates or [cfg.learning_rate]
    runs = []
    best = None
    for lr in lrs:
        for r in range(cfg.restarts):
            seed = cfg.seed + r
            res = train_once(cfg, runner, w, train_feats, eval_sets, lr, seed, out / f"lr{lr:g}_seed{seed}")
            runs.append({k: v for k, v in res.items() if not k.startswith("_")})
            if best is None or res["score"] > best["score"]:
                best = res
            else:
                res.pop("_state", None)
    summary = {
        "task": runner.__class__.__name__, "task_name": cfg.task, "checkpoint": cfg.checkpoint,
        "checkpoint_origin": w.origin, "main_metric": runner.main_metric,
        "train_examples": len(train_feats), "eval_examples": {es.name: len(es.context if not isinstance(es.context, tuple)
                                                                           else es.context[0]) for es in eval_sets},
        "world_size": rank_and_world()[1], "deepspeed": {"zero_stage": cfg.zero_stage} if cfg.deepspeed else None,
        "kernels": cfg.kernels, "kernel_sources": best["kernel_sources"],
        "best": {"lr": best["lr"], "seed": best["seed"], "epoch": best["epoch"], "metrics": best["metrics"],
                 "score": best["score"]},
        "runs": runs,
        "majority_baseline": {es.name: majority_baseline(runner, es) for es in eval_sets}
        if runner.kind == "classification" else None,
    }
    if rank == 0:
        _write_outputs(cfg, runner, w, best, eval_sets, out, summary)
    return summary


def _write_outputs(cfg, runner, w, best, eval_sets, out: Path, summary: dict) -> None:
    pred_dir = out / "predictions"
    for name, rows in best["_rows"].items():
        dump_json(pred_dir / f"{name}.json", rows)
        if runner.kind == "span":
            dump_json(pred_dir / "predictions.json", runner.main_rows_to_official(rows))  # official format
    state = best.get("_state")
    if state is not None and (cfg.predict_test or cfg.save_model):
        device = local_device(cfg.device)
        model = task_model(family_of(w.config).with_kernels(w.config, cfg.kernels), runner.kind, runner.num_labels,
                           device_type=device.type, **head_options(cfg, w))
        model.load_state_dict(state)
        model.to(device)
        if cfg.predict_test:
            files = []
            for es in runner.test_sets():
                path = runner.write_test(out, es, predict(model, es.features, cfg, device))
                if path is not None:
                    files.append(str(path))
            summary["test_predictions"] = files
        if cfg.save_model:
            from bertdist.finetune.export_task import write_task_model

            summary["model_dir"] = str(write_task_model(out / "model", model, runner, w, cfg))
    dump_json(out / "metrics.json", summary)
