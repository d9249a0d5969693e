"""Training bi-encoders (``embed``, ``sts``) and cross-encoders (``rerank``): ``run_embed(cfg)``.

* ``embed``: MNRL over (query, positive, hard negatives); the other rows' positives and negatives
  in the batch are negatives too. Under DeepSpeed data parallel the embeddings of every rank are
  gathered with their gradients (``bertdist.embed.gather``), so each query is ranked against the
  global batch. Batches never hold one text twice (a repeated positive would be its own query's
  negative). Optional Matryoshka widths; optional distillation from a teacher (``distill.py``).
* ``sts``: CoSENT (or cosine MSE against score / 5) on STS-B's scored pairs.
* ``rerank``: a cross-encoder over (query, positive) and (query, negative) pairs: listwise softmax
  over 1 positive + k negatives, or pointwise BCE.

Hard negatives: a row's listed negatives first, topped up to ``num_negatives`` from a mined set
(``hard_negatives: DIR``, or ``mine: bm25`` mined here over the distinct positives of the train
file and saved under ``OUT/negatives``). Rows listing more than ``num_negatives`` get a fresh
sample each epoch.

Evaluation on the dev file before training, after every epoch and every ``eval_every`` steps
(``evaluate.py``); the best evaluation's weights are what ``save_model`` writes, and
``early_stopping_patience`` stops after that many evaluations without a better main metric.
Outputs under ``output_dir``: ``config.yaml`` (the resolved config), ``metrics.json`` and, with
``save_model``, ``model/`` (``export.py``).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from bertdist.config import save_config
from bertdist.embed.batches import epoch_batches, epoch_rng, make_units, rank_share
from bertdist.embed.config import EmbedConfig, check_config, resolved_loss
from bertdist.embed.data import load_data
from bertdist.embed.evaluate import (MAIN_METRIC, build_rerank_dev, build_retrieval_dev, rerank_eval, retrieval_eval,
                                     sts_eval)
from bertdist.embed.model import BiEncoder, CrossEncoder, load_bi_encoder, load_cross_encoder
from bertdist.embed.negatives import row_negatives
from bertdist.embed.optim import head_learning_rate, param_groups
from bertdist.embed.step import StepLoss
from bertdist.finetune.errors import DataError
from bertdist.finetune.train import apply_update, build_optimization, seed_everything
from bertdist.train.distributed import local_device, process_group, rank_and_world, start_process_group


def build_model(cfg: EmbedConfig, device: torch.device, loss: str):
    common = dict(max_seq_length=cfg.max_seq_length, kernels=cfg.kernels, hidden_dropout_prob=cfg.hidden_dropout_prob,
                  vocab_file=cfg.vocab_file, do_lower_case=cfg.do_lower_case, device=device)
    if cfg.task == "rerank":
        return load_cross_encoder(cfg.checkpoint, activation="sigmoid" if loss == "bce" else "identity", **common)
    model = load_bi_encoder(cfg.checkpoint, pooling=None if cfg.pooling == "auto" else cfg.pooling,
                            normalize=cfg.normalize, truncate_dim=cfg.truncate_dim, **common)
    if cfg.matryoshka_dims and max(cfg.matryoshka_dims) > model.full_dim:
        raise DataError(f"matryoshka_dims {cfg.matryoshka_dims} exceed the embedding width {model.full_dim} of "
                        f"{cfg.checkpoint}")
    return model


def _dev_set(cfg: EmbedConfig, dev: list):
    if cfg.task == "sts":
        return dev
    if cfg.task == "embed":
        return build_retrieval_dev(dev)
    return build_rerank_dev(dev, cfg.rerank_candidates)


def evaluate(cfg: EmbedConfig, model, dev) -> dict:
    if cfg.task == "sts":
        return sts_eval(model, dev, cfg.eval_batch_size, cfg.max_seq_length)
    if cfg.task == "embed":
        return retrieval_eval(model, dev, cfg.eval_batch_size, cfg.max_seq_length)
    return rerank_eval(model, dev, cfg.eval_batch_size, cfg.max_seq_length)


def _broadcast(value: float, device: torch.device) -> float:
    """Rank 0's value on every rank: every rank must take the same early-stopping decision."""
    if not process_group():
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device=device if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.broadcast(t, 0)
    return float(t.item())


def run_embed(cfg: EmbedConfig) -> dict:
    """Train (see the module doc), write the outputs, return the metrics JSON as a dict."""
    check_config(cfg)
    if cfg.deepspeed:
        start_process_group(deepspeed=True)
    rank, world = rank_and_world()
    barrier = torch.distributed.barrier if process_group() else None
    if cfg.batch_size % world:
        raise DataError(f"batch_size {cfg.batch_size} is not divisible by the {world} processes")
    out = Path(cfg.output_dir)
    loss_name = resolved_loss(cfg)
    data = load_data(cfg)
    if not data.rows:
        raise DataError(f"{data.train_path}: no training rows")
    if cfg.early_stopping_patience and data.dev is None:
        raise DataError(f"early_stopping_patience={cfg.early_stopping_patience} needs a dev set, but {cfg.data} has no "
                        "dev file (dev.jsonl; sts: dev.tsv) and dev_file is not set")
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    if barrier is not None:
        barrier()
    seed_everything(cfg.seed)
    device = local_device(cfg.device)
    model = build_model(cfg, device, loss_name)

    negatives_info, pools = None, None
    if cfg.task != "sts":
        pools, negatives_info = row_negatives(cfg, data, out, rank, barrier)
    units = make_units(cfg, data, pools)
    distill, distill_info = None, None
    if cfg.distill_from:
        from bertdist.embed.distill import prepare_distillation

        units, distill, distill_info = prepare_distillation(cfg, model, units, data, out, rank, barrier, device)
    if cfg.task == "rerank" and loss_name == "listwise":
        kept = [u for u in units if u["negs"]]
        if negatives_info is not None:
            negatives_info["rows_skipped_without_negatives"] = len(units) - len(kept)
        if not kept:
            raise DataError(f"{data.train_path}: no row has a negative to rank its positive against (listwise loss); "
                            "list negatives in the rows, set mine=bm25, or use loss=bce")
        units = kept

    dev = _dev_set(cfg, data.dev) if data.dev else None
    micro = cfg.batch_size // world
    no_dup = cfg.task == "embed"
    # Batches without repeated texts can outnumber len(units) / batch_size: count epoch 0's.
    per_epoch = max(1, sum(1 for b in epoch_batches(units, cfg.batch_size, epoch_rng(cfg, 0), no_dup)
                           if rank_share(b, 0, world)))
    total = cfg.max_steps if cfg.max_steps is not None else max(1, math.ceil(per_epoch * cfg.epochs))
    engine, opt, sched = build_optimization(model, cfg, param_groups(model, cfg), cfg.learning_rate, micro, total)
    fwd = engine if engine is not None else model
    trainer = StepLoss(cfg, model, loss_name, distill)
    main_metric = MAIN_METRIC[cfg.task]

    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=f"{cfg.task} ({loss_name})", disable=not cfg.progress or rank != 0, dynamic_ncols=True)
    state = {"best": None, "bad": 0, "stop": False, "eval_seconds": 0.0, "best_state": None, "last_eval_step": -1}
    evals: list[dict] = []

    def do_eval(step: int, epoch: int, initial: bool = False) -> None:
        t = time.time()
        metrics = evaluate(cfg, model, dev) if rank == 0 else {}
        score = _broadcast(metrics.get(main_metric, 0.0), device)
        model.train()
        state["eval_seconds"] += time.time() - t
        state["last_eval_step"] = step
        record = {"step": step, "epoch": epoch, "metrics": metrics}
        evals.append(record)
        if initial:
            return
        if state["best"] is None or score > state["best"]["score"]:
            state["best"], state["bad"] = {**record, "score": score}, 0
            if cfg.save_model and rank == 0:
                state["best_state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            state["bad"] += 1
            if cfg.early_stopping_patience and state["bad"] >= cfg.early_stopping_patience:
                state["stop"] = True

    t0 = time.time()
    if dev is not None:
        do_eval(0, 0, initial=True)
    step, epoch, losses = 0, 0, []
    model.train()
    while step < total and not state["stop"]:
        rng = epoch_rng(cfg, epoch)
        for batch in epoch_batches(units, cfg.batch_size, rng, no_dup):
            mine = rank_share(batch, rank, world)
            if not mine:
                continue
            loss = trainer.step_loss(fwd, [units[i] for i in mine], rng)
            apply_update(engine, opt, sched, loss, [p for p in model.parameters() if p.requires_grad],
                         cfg.max_grad_norm)
            step += 1
            losses.append(float(loss.item()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if dev is not None and cfg.eval_every and step % cfg.eval_every == 0:
                do_eval(step, epoch + 1)
            if step >= total or state["stop"]:
                break
        epoch += 1
        if dev is not None and state["last_eval_step"] != step:
            do_eval(step, epoch)
    bar.close()
    seconds = time.time() - t0
    train_seconds = seconds - state["eval_seconds"]

    summary = {
        "task": cfg.task, "loss": loss_name, "checkpoint": cfg.checkpoint,
        "checkpoint_origin": getattr(model, "origin", None), "main_metric": main_metric,
        "train_file": str(data.train_path), "dev_file": str(data.dev_path) if data.dev_path else None,
        "train_rows": len(data.rows), "train_units": len(units), "dev_rows": len(data.dev) if data.dev else 0,
        "world_size": world, "deepspeed": {"zero_stage": cfg.zero_stage} if cfg.deepspeed else None,
        "global_batch_size": cfg.batch_size, "gathered_negatives": world > 1 and cfg.task == "embed",
        "initial": evals[0] if evals else None, "evals": evals[1:] if evals else [],
        "best": state["best"], "stopped_early": state["stop"], "steps": step, "planned_steps": total,
        "epochs_run": epoch, "seconds": round(seconds, 3), "train_seconds": round(train_seconds, 3),
        "eval_seconds": round(state["eval_seconds"], 3),
        "seconds_per_step": round(train_seconds / max(1, step), 5), "loss_curve": loss_curve(losses),
        "negatives": negatives_info, "distill": distill_info,
        "model": {"pooling": model.pooling, "normalize": model.normalize, "dim": model.dim,
                  "max_seq_length": cfg.max_seq_length} if isinstance(model, BiEncoder)
        else {"activation": model.activation, "max_seq_length": cfg.max_seq_length,
              "head_learning_rate": head_learning_rate(model, cfg)},
    }
    if rank == 0:
        if cfg.save_model:
            if state["best_state"] is not None:
                model.load_state_dict(state["best_state"])
            summary["model_dir"] = str(_export(model, out / "model", cfg))
        (out / "metrics.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def loss_curve(losses: list[float], points: int = 100) -> list[dict]:
    """The training loss averaged over up to ``points`` equal windows of steps."""
    if not losses:
        return []
    size = max(1, math.ceil(len(losses) / points))
    return [{"step": i + min(size, len(losses) - i), "loss": float(np.mean(losses[i:i + size]))}
            for i in range(0, len(losses), size)]


def _export(model, path: Path, cfg: EmbedConfig) -> Path:
    from bertdist.embed.export import write_bi_encoder, write_cross_encoder

    if isinstance(model, CrossEncoder):
        return write_cross_encoder(path, model, cfg.max_seq_length)
    return write_bi_encoder(path, model, cfg.max_seq_length)
