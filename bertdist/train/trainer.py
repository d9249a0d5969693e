"""`run_pretraining(cfg)`: BERT pretraining with DeepSpeed, from the pipeline's records.

One function runs a whole phase on every rank: set up the process group,
open and verify the records, build model / optimizer / schedule / DeepSpeed
engine, restore a checkpoint (``resume``) or start a phase from a previous
phase's checkpoint (``checkpoint.init_from``), then train, evaluate, log and
checkpoint until ``schedule.total_steps`` (or ``max_steps``), a SIGTERM, or a
fault.

Per optimizer step each rank runs ``accum`` micro-batches; a single all-reduce
after the step carries the logged metrics, the SIGTERM flag and the
non-finite flag, so every rank takes the same decision at the same step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bertdist.config import ConfigError, save_config, to_dict
from bertdist.train.checkpoint import (
    CheckpointManager,
    ensure_universal,
    read_checkpoint_state,
    resolve_checkpoint,
    set_rng_state,
)
from bertdist.train.config import TrainConfig, check_batch_sizes
from bertdist.train.distributed import init_distributed

STATE_FORMAT = 1
# Model fields that change the weights' shapes; a resume with any of them changed is refused.
ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings", "type_vocab_size")


class NonFiniteLossError(RuntimeError):
    """Training produced non-finite losses that the run cannot recover from."""


@dataclasses.dataclass
class TrainResult:
    step: int
    stopped_by: str  # "end" | "max_steps" | "sigterm"
    last_checkpoint: str | None
    run_dir: str
    final_eval: dict[str, float] | None


class _Stop:
    """SIGTERM (SLURM's pre-emption notice) -> finish the step, checkpoint, exit 0."""

    def __init__(self):
        self.requested = False
        self._old = None

    def install(self) -> None:
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _check_compatible(saved: dict[str, Any], cfg: TrainConfig, what: str) -> None:
    problems = []
    for k in ARCH_FIELDS:
        a, b = saved["model"].get(k), getattr(cfg.model, k)
        if a != b:
            problems.append(f"model.{k}: checkpoint {a}, config {b}")
    if what == "resume":
        for key, ours in (("optimizer", cfg.optimizer.name), ("zero_stage", cfg.deepspeed.zero_stage),
                          ("precision", cfg.deepspeed.precision), ("phase", cfg.phase)):
            if saved.get(key) != ours:
                problems.append(f"{key}: checkpoint {saved.get(key)!r}, config {ours!r}")
        # The LR schedule and peak lr are restored from the checkpoint, so a changed one would be ignored.
        sched = {"lr": cfg.optimizer.lr, **to_dict(cfg.schedule)}
        for key, ours in sched.items():
            theirs = saved.get("schedule", {}).get(key, ours)
            if theirs != ours:
                problems.append(f"{'optimizer' if key == 'lr' else 'schedule'}.{key}: checkpoint {theirs!r}, "
                                f"config {ours!r}")
    if problems:
        raise ConfigError(
            f"cannot {what} from this checkpoint, the config is incompatible:\n  " + "\n  ".join(problems)
            + ("\n(to change these, start a new phase from the checkpoint with checkpoint.init_from instead of "
               "--resume)" if what == "resume" else "")
        )


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _batch_stats(out, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[mlm_correct, mlm_count, nsp_correct, nsp_count] as a float64 tensor on the batch's device (no sync)."""
    labels = out.mlm_labels
    keep = labels != -100
    mlm_correct = ((out.prediction_logits.argmax(-1) == labels) & keep).sum()
    zero = torch.zeros((), dtype=torch.int64, device=labels.device)
    nsp_correct = nsp_count = zero
    if "next_sentence_label" in mb:
        nsp_correct = (out.seq_relationship_logits.argmax(-1) == mb["next_sentence_label"]).sum()
        nsp_count = zero + mb["next_sentence_label"].numel()
    return torch.stack([mlm_correct, keep.sum(), nsp_correct, nsp_count]).double()


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]], device: torch.device) -> dict[str, float]:
    """Held-out MLM loss / accuracy and NSP (or SOP) accuracy, summed over all ranks."""
    import torch.distributed as dist
    import torch.nn.functional as F

    engine.eval()
    sums = torch.zeros(6, dtype=torch.float64, device=device)  # on device: NCCL reduces only GPU tensors
    for mb in batches:
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        out = engine(**mb)
        labels = out.mlm_labels
        sums[0] += F.cross_entropy(out.prediction_logits.float().reshape(-1, out.prediction_logits.shape[-1]),
                                   labels.reshape(-1), ignore_index=-100, reduction="sum").double()
        sums[1:5] += _batch_stats(out, mb)
        if "next_sentence_label" in mb:
            sums[5] += F.cross_entropy(out.seq_relationship_logits.float(), mb["next_sentence_label"],
                                       reduction="sum").double()
    engine.train()
    dist.all_reduce(sums)
    sums = sums.tolist()
    res = {"mlm_loss": sums[0] / max(1.0, sums[2]), "mlm_acc": sums[1] / max(1.0, sums[2]), "masked_tokens": sums[2]}
    if sums[4] > 0:
        res.update(nsp_acc=sums[3] / sums[4], nsp_loss=sums[5] / sums[4], sequences=sums[4])
    return res


def _balanced_eval(batches: list, device: torch.device) -> list:
    """Every rank must run the same number of forwards (ZeRO-3 gathers weights collectively)."""
    import torch.distributed as dist

    n = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return batches[: int(n.item())]


def run_pretraining(cfg: TrainConfig, resume: str | None = None) -> TrainResult:
    """Train one phase. ``resume``: None (fresh), "auto" (latest checkpoint if any) or a checkpoint path."""
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    info = init_distributed(cfg.deepspeed.dist_backend)
    import deepspeed
    import torch.distributed as dist

    from bertdist.data import continuation_mask, load_vocab
    from bertdist.model import BertForPreTraining, train_flops_per_sequence
    from bertdist.ops import kernels_for_run
    from bertdist.train.ds_config import build_ds_config
    from bertdist.train.loader import LoaderState, PretrainingLoader, eval_batches, open_training_records, pin_batches
    from bertdist.train.metrics import RunLogger, device_peak_flops
    from bertdist.train.optim import build_optimizer, build_scheduler

    rank, world, device = info.rank, info.world_size, info.device
    grad_accum = check_batch_sizes(cfg.data, world)
    if cfg.deepspeed.precision == "fp16" and device.type != "cuda":
        raise ConfigError("deepspeed.precision=fp16 needs CUDA (DeepSpeed's CPU accelerator has no fp16); "
                          "use bf16 or fp32 on CPU")
    if cfg.deterministic:
        # Exact on CPU (tested); on CUDA an op without a deterministic kernel warns instead of failing.
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")

    # ---- data ------------------------------------------------------------------------------
    if not cfg.data.train_manifest or not cfg.data.vocab_file:
        raise ConfigError("data.train_manifest and data.vocab_file are required")
    records = open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length)
    vocab = load_vocab(cfg.data.vocab_file)
    if len(vocab) != int(records.manifest["vocab"]["size"]):
        raise ConfigError(f"{cfg.data.vocab_file} has {len(vocab)} tokens, the records' vocab "
                          f"{records.manifest['vocab']['size']}")
    cfg = dataclasses.replace(cfg, model=cfg.model.with_vocab(len(vocab)))
    continuation = continuation_mask(cfg.data.vocab_file)

    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    ckpt = CheckpointManager(cfg.checkpoint_dir, cfg.checkpoint.keep_last_n, rank, world)

    # ---- what to restore (decided before deepspeed.initialize: universal loading is a config flag)
    load_dir, load_tag, saved, mode = None, None, None, "fresh"
    if resume:
        if resume == "auto":
            tag = ckpt.latest_tag()
            if tag is not None:
                load_dir, load_tag = ckpt.dir, tag
        else:
            load_dir, load_tag = resolve_checkpoint(resume)
        if load_tag is not None:
            saved = read_checkpoint_state(load_dir, load_tag)
            _check_compatible(saved, cfg, "resume")
            mode = "resume"
    if mode == "fresh" and cfg.checkpoint.init_from:
        load_dir, load_tag = resolve_checkpoint(cfg.checkpoint.init_from)
        saved = read_checkpoint_state(load_dir, load_tag)
        _check_compatible(saved, cfg, "start a new phase")
        mode = "init"
    universal = False
    if saved is not None and saved["world_size"] != world and (mode == "resume" or cfg.checkpoint.init_load_optimizer):
        stage, prec = saved["zero_stage"], saved["precision"]
        universal = stage > 0 or prec == "bf16"  # per-rank optimizer shards must be re-partitioned
        if universal:
            load_dir = ensure_universal(load_dir, load_tag, rank)

    # ---- model, optimizer, engine ----------------------------------------------------------
    # kernels: auto on CUDA: rank 0 measures (or reads its cache) for this run's shapes and broadcasts
    # the plan, so every rank runs the same kernels; a copy goes to run_dir. Before seeding: it may use the RNG.
    kernels = kernels_for_run(cfg.model.kernels, cfg.model, device, micro_batch=cfg.data.micro_batch_size,
                              seq=cfg.data.max_seq_length, precision=cfg.deepspeed.precision, run_dir=str(run_dir))
    _seed_all(cfg.seed)  # identical initial weights on every rank
    model = BertForPreTraining(cfg.model, device_type=device.type, kernels=kernels)
    if cfg.deepspeed.activation_checkpointing == "torch":
        from torch.utils.checkpoint import checkpoint

        model.bert.encoder.checkpoint_fn = lambda layer, *a: checkpoint(layer, *a, use_reentrant=False)
    optimizer = build_optimizer(model, cfg.optimizer, device.type)
    scheduler = build_scheduler(optimizer, cfg.schedule)
    ds_config = build_ds_config(cfg, world, grad_accum)
    if universal:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    if cfg.deepspeed.activation_checkpointing == "deepspeed":
        deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
        model.bert.encoder.checkpoint_fn = deepspeed.checkpointing.checkpoint
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if rank == 0:
        with open(run_dir / "ds_config.json", "w") as f:
            json.dump(ds_config, f, indent=2)

    step, loader_state = 0, LoaderState()
    phases = [{"phase": cfg.phase, "init_from": None, "init_step": None}]
    if mode == "resume":
        path, client = engine.load_checkpoint(str(load_dir), load_tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"DeepSpeed could not load checkpoint {load_dir}/{load_tag}")
        step = int(saved["step"])
        loader_state = LoaderState.from_dict(saved["loader"])
        phases = saved["phases"]
        rng_file = Path(load_dir) / load_tag / f"rng_state_rank{rank}.pt"  # (absent in a universal copy)
        if saved["world_size"] == world and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            _seed_all(cfg.seed + 7919 * (rank + 1) + step)
    else:
        _seed_all(cfg.seed + 7919 * (rank + 1))  # per-rank dropout streams
        if mode == "init":
            engine.load_checkpoint(str(load_dir), load_tag, load_optimizer_states=cfg.checkpoint.init_load_optimizer,
                                   load_lr_scheduler_states=False,
                                   load_module_only=not cfg.checkpoint.init_load_optimizer)
            # A fresh phase: fresh step count and warmup; the lr the first step uses is the new schedule's.
            engine.global_steps, engine.global_samples, engine.skipped_steps = 0, 0, 0
            lam = scheduler.lr_lambdas[0]
            for g, base in zip(engine.optimizer.param_groups, scheduler.base_lrs):
                g["lr"] = base * lam(0)
            phases = saved["phases"] + [{"phase": cfg.phase, "init_from": f"{load_dir}/{load_tag}",
                                         "init_step": saved["step"]}]
    engine.train()

    loader = PretrainingLoader(records, cfg.data, rank=rank, world_size=world, grad_accum=grad_accum,
                               continuation=continuation, pin_device=device)
    eval_set = None
    if cfg.data.eval_split:
        held = open_training_records(cfg.data.train_manifest, cfg.data.vocab_file, cfg.data.max_seq_length,
                                     split=cfg.data.eval_split)
        if held.num_rows:
            eval_set = _balanced_eval(eval_batches(held, cfg.data, continuation, rank=rank, world_size=world,
                                                   micro_batch_size=cfg.eval.micro_batch_size,
                                                   max_sequences=cfg.eval.max_sequences, seed=cfg.eval.seed), device)
            if device.type == "cuda":
                eval_set = pin_batches(eval_set)  # held for the run: copied asynchronously at every evaluation

    total = cfg.steps_to_run
    log = RunLogger(str(run_dir), rank == 0, cfg.logging.tensorboard, cfg.logging.progress, total, step)
    peak, peak_note = device_peak_flops(device, cfg.deepspeed.precision, cfg.logging.device_peak_tflops)
    log.message(f"bertdist pretrain: phase {cfg.phase}, {mode} at step {step}/{total}, world {world} "
                f"({info.backend}, {device.type}), global batch {cfg.data.global_batch_size} = micro "
                f"{cfg.data.micro_batch_size} x accum {grad_accum} x world {world}; {records.num_rows} train "
                f"sequences, {loader.steps_per_epoch} steps/epoch ({loader.dropped_per_epoch} left over per epoch); "
                f"MFU peak: {peak_note}")
    log.record("run", step, {"mode": mode, "world_size": world, "grad_accum": grad_accum, "peak_flops": peak,
                             "peak_note": peak_note, "steps_per_epoch": loader.steps_per_epoch,
                             "dropped_per_epoch": loader.dropped_per_epoch, "loader": loader_state.to_dict()},
               tensorboard=False)

    def trainer_state() -> dict[str, Any]:
        return {"format": STATE_FORMAT, "step": step, "phase": cfg.phase, "phases": phases,
                "loader": loader_state.to_dict(), "world_size": world, "micro_batch_size": cfg.data.micro_batch_size,
                "global_batch_size": cfg.data.global_batch_size, "grad_accum": grad_accum,
                "model": to_dict(cfg.model), "optimizer": cfg.optimizer.name,
                "zero_stage": cfg.deepspeed.zero_stage, "precision": cfg.deepspeed.precision,
                "skipped_steps": int(engine.skipped_steps), "seed": cfg.seed,
                "schedule": {"lr": cfg.optimizer.lr, **to_dict(cfg.schedule)}}

    last_ckpt = None

    def save() -> str:
        t = time.time()
        tag = ckpt.save(engine, step, trainer_state(), cfg)
        log.message(f"checkpoint {ckpt.dir / tag} saved in {time.time() - t:.1f}s")
        log.record("checkpoint", step, {"tag": tag, "seconds": time.time() - t}, tensorboard=False)
        return tag

    def run_eval() -> dict[str, float] | None:
        if eval_set is None:
            return None
        t = time.time()
        res = evaluate(engine, eval_set, device)
        res["seconds"] = time.time() - t
        log.record("eval", step, res)
        log.message(f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()))
        return res

    stop = _Stop()
    if cfg.checkpoint.save_on_sigterm:
        stop.install()
    fp16 = cfg.deepspeed.precision == "fp16"
    need_own_grad_norm = cfg.deepspeed.zero_stage == 0 and cfg.deepspeed.precision == "fp32"
    unique_params = list({id(p): p for p in engine.module.parameters()}.values())
    own_gn = float("nan")
    d, v = cfg.model.hidden_size, cfg.model.vocab_size
    head_flops = 3 * 2 * (d * d + d * v)  # training FLOPs of the MLM head per predicted position
    consecutive_bad = 0
    final_eval = None
    stopped_by = "end" if total == cfg.schedule.total_steps else "max_steps"
    if cfg.eval.at_start and mode != "resume" and step < total:
        run_eval()
    steps = loader.steps(loader_state)
    try:
        while step < total:
            t0 = time.time()
            micro_batches, next_state = next(steps)
            skipped_before = engine.skipped_steps
            lr = engine.get_lr()[0]  # the lr this step uses (the scheduler moves on inside engine.step)
            # Everything logged is accumulated on the device and reduced once per step: no host sync per
            # micro-batch, and NCCL needs device tensors.
            acc = torch.zeros(14, dtype=torch.float64, device=device)
            for i, mb in enumerate(micro_batches):
                mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
                out = engine(**mb)
                loss = out.loss
                with torch.no_grad():
                    lv = loss.detach().float().double()
                    acc[0] += lv / grad_accum
                    acc[1] += out.mlm_loss.detach().float().double() / grad_accum
                    if out.nsp_loss is not None:
                        acc[2] += out.nsp_loss.detach().float().double() / grad_accum
                    stats = _batch_stats(out, mb)
                    acc[3:7] += stats
                    width, n_seq = mb["input_ids"].shape[1], mb["input_ids"].shape[0]
                    acc[7] += mb["attention_mask"].sum()
                    acc[8] += n_seq * width
                    acc[9] += n_seq
                    if cfg.model.sparse_mlm_head:  # FLOPs are linear in the number of predicted positions
                        acc[10] += n_seq * train_flops_per_sequence(cfg.model, width, 0) + head_flops * stats[1]
                    else:
                        acc[10] += n_seq * train_flops_per_sequence(cfg.model, width)
                    acc[11] += (~torch.isfinite(lv)).double()
                if not fp16 and i == grad_accum - 1:
                    # Without a loss scaler nothing undoes a NaN update: decide before the step is applied.
                    flag = acc[11:12].clone()
                    dist.all_reduce(flag)
                    if flag.item() > 0:
                        raise NonFiniteLossError(
                            f"non-finite loss at step {step + 1} ({cfg.deepspeed.precision}); the update was not "
                            f"applied. Try a lower optimizer.lr or a longer warmup, a smaller "
                            f"deepspeed.gradient_clipping, fp32 instead of bf16, and check the records; then "
                            f"restart from the last good checkpoint with --resume auto")
                engine.backward(loss)
                if i == grad_accum - 1 and need_own_grad_norm:
                    # DeepSpeed computes no global norm for fp32 without ZeRO; gradients are reduced by now.
                    own_gn = torch.sqrt(sum((p.grad.detach().float() ** 2).sum() for p in unique_params
                                            if p.grad is not None))
                engine.step()
            step += 1
            loader_state = next_state
            acc[12] = 1.0 if stop.requested else 0.0
            dist.all_reduce(acc)
            acc = acc.tolist()
            dt = time.time() - t0
            skipped = engine.skipped_steps - skipped_before
            nonfinite = acc[11] > 0 or skipped > 0
            consecutive_bad = consecutive_bad + 1 if nonfinite else 0
            gn = engine.get_global_grad_norm()
            gn = float(gn) if gn is not None else float(own_gn)
            scale = float(engine.optimizer.cur_scale) if fp16 and hasattr(engine.optimizer, "cur_scale") else 1.0
            seqs, tokens, flops = acc[9], acc[7], acc[10]
            m = {
                "loss": acc[0] / world, "mlm_loss": acc[1] / world,
                "mlm_acc": acc[3] / max(1.0, acc[4]), "lr": lr, "grad_norm": gn,
                "loss_scale": scale, "skipped_steps": int(engine.skipped_steps),
                "seq_per_s": seqs / dt, "tokens_per_s": tokens / dt, "padded_tokens_per_s": acc[8] / dt,
                "tflops": flops / dt / 1e12, "mfu": flops / dt / world / peak if peak else float("nan"),
                "epoch": loader_state.epoch, "step_time_s": dt,
            }
            if acc[6] > 0:
                m["nsp_loss"] = acc[2] / world
                m["nsp_acc"] = acc[5] / acc[6]
            log_now = step % cfg.logging.every_steps == 0 or step == total
            log.record("train", step, m, tensorboard=log_now)
            if log_now:
                log.progress(step, {"loss": m["loss"], "lr": lr, "seq/s": round(m["seq_per_s"], 1)})
            if consecutive_bad >= cfg.max_consecutive_nonfinite:
                raise NonFiniteLossError(
                    f"{consecutive_bad} consecutive steps with non-finite loss or gradient overflow (fp16 loss "
                    f"scale now {scale}) at step {step}. Try bf16 instead of fp16, a lower optimizer.lr or a "
                    f"longer warmup, a lower deepspeed.min_loss_scale or initial_scale_power, and check the "
                    f"records; restart from the last good checkpoint with --resume auto")
            if acc[12] > 0:
                stopped_by = "sigterm"
                log.message(f"SIGTERM: stopping after step {step}")
                break
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total:
                run_eval()
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                last_ckpt = save()
        if stopped_by == "sigterm":
            last_ckpt = save() if last_ckpt != f"step_{step:08d}" else last_ckpt
        else:
            if cfg.eval.at_end:
                final_eval = run_eval()
            if cfg.checkpoint.save_at_end and last_ckpt != f"step_{step:08d}":
                last_ckpt = save()
    finally:
        steps.close()  # stops the loader's prefetch thread
        stop.uninstall()
        log.close()
    return TrainResult(step, stopped_by, None if last_ckpt is None else str(ckpt.dir / last_ckpt), str(run_dir),
                       final_eval)
