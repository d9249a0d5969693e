"""One optimizer step and one evaluation pass, with the statistics they log.

Everything logged is summed on the device in named slots of one float64 tensor per step
(``DeviceSums``): no host read per micro-batch. ``launch_step`` queues a step's work and returns
it unread (``PendingStep``); ``settle`` stacks the sums of any number of queued steps, all-reduces
them in one collective (NCCL reduces only device tensors) and reads them in one host sync. The
trainer settles once per logging window (``logging.every_steps``), so the steps in between never
wait for the device. The sums also carry the non-finite and SIGTERM flags, so every rank takes
the same decision at the same step. Nothing else in a step reads the device: the batches carry
their packing (``loader.batch_to_device``), the gradient norm stays a device tensor, and at ZeRO 0
the gradients are clipped here with torch's multi-tensor norm (``clip_gradients``), in place of
DeepSpeed's per-parameter loop and its extra all-reduce.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch.profiler import record_function

from bertdist.model import IGNORE_INDEX, BertConfig, ElectraConfig, train_flops_per_sequence
from bertdist.train.loader import batch_to_device


# The parts of a step, as torch.profiler regions (bertdist/train/profiling.py sums each).
REGIONS = ("bertdist/forward", "bertdist/metrics", "bertdist/backward", "bertdist/optimizer_step")


class NonFiniteLossError(RuntimeError):
    """Training produced non-finite losses that the run cannot recover from."""


# (fields, names added together, device) -> the names' positions, on the device
_POSITIONS: dict[tuple, torch.Tensor] = {}


class DeviceSums:
    """Named float64 sums, all-reduced together. Device values are added in one ``index_add_``
    per call of ``add_all`` (not one indexed add per name); host numbers are summed on the host
    and join the device values when they are read."""

    def __init__(self, fields: Sequence[str], device: torch.device):
        self.fields = tuple(fields)
        self._index = {f: i for i, f in enumerate(self.fields)}
        self.device = device
        self.values = torch.zeros(len(self.fields), dtype=torch.float64, device=device)
        self.host = [0.0] * len(self.fields)

    def add(self, name: str, value) -> None:
        self.add_all({name: value})

    def add_all(self, values: dict[str, "torch.Tensor | float"]) -> None:
        device = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
        for k, v in values.items():
            if not isinstance(v, torch.Tensor):
                self.host[self._index[k]] += float(v)
        if not device:
            return
        key = (self.fields, tuple(device), self.device)
        if key not in _POSITIONS:  # the same names every micro-batch: one blocking index copy per run
            _POSITIONS[key] = torch.tensor([self._index[k] for k in key[1]], device=self.device)
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in device.values()])
        self.values.index_add_(0, _POSITIONS[key], stacked)

    def combined(self) -> torch.Tensor:
        """Device and host sums in one device vector (a host-to-device copy, no wait)."""
        if not any(self.host):
            return self.values
        return self.values + torch.tensor(self.host, dtype=torch.float64).to(self.device, non_blocking=True)

    def all_reduce(self) -> dict[str, float]:
        import torch.distributed as dist

        total = self.combined()
        if dist.get_world_size() > 1:
            dist.all_reduce(total)
        return dict(zip(self.fields, total.tolist()))


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` (fp32, on the device, never read here),
    and, with ``max_norm`` > 0, the gradients scaled by min(1, max_norm / (norm + 1e-6)) in place:
    DeepSpeed's clipping rule, in torch's multi-tensor kernels (a few launches for all tensors)."""
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True).float()
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True).float()


# Per-step sums: losses are averaged over the accumulation steps on each rank, everything else counts.
STEP_FIELDS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count",
               "real_tokens", "padded_tokens", "sequences", "flops", "nonfinite", "stop", "mlm_kl", "hidden_cos",
               "disc_loss", "disc_correct", "disc_count", "replaced_count", "grad_norm")
# The parts of a distillation objective's loss (train/distill_objective.py), logged when it has them.
DISTILL_FIELDS = ("mlm_kl", "hidden_cos")
EVAL_FIELDS = ("mlm_loss_sum", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "nsp_loss_sum",
               "disc_loss_sum", "disc_correct", "disc_count", "replaced_count")


def batch_stats(out, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MLM and NSP (or SOP) correct/count of one micro-batch, as device tensors (no sync). ELECTRA
    (bertdist/model/electra.py): MLM is the generator's; no NSP; the discriminator's correct,
    count (real tokens) and replaced tokens."""
    labels = out.mlm_labels
    keep = labels != IGNORE_INDEX
    stats = {"mlm_correct": ((out.prediction_logits.argmax(-1) == labels) & keep).sum(), "mlm_count": keep.sum()}
    if "next_sentence_label" in mb and out.seq_relationship_logits is not None:
        stats["nsp_correct"] = (out.seq_relationship_logits.argmax(-1) == mb["next_sentence_label"]).sum()
        stats["nsp_count"] = mb["next_sentence_label"].numel()
    if getattr(out, "discriminator_logits", None) is not None:
        stats["disc_correct"] = (((out.discriminator_logits > 0) == out.replaced) & out.real).sum()
        stats["disc_count"] = out.real.sum()
        stats["replaced_count"] = out.replaced.sum()
    return stats


@dataclasses.dataclass
class StepRunner:
    """What every step of a run shares."""

    engine: Any  # deepspeed.DeepSpeedEngine
    device: torch.device
    grad_accum: int
    precision: str
    model: BertConfig
    # DeepSpeed computes no global gradient norm for fp32 without ZeRO: then we do, and clip with it.
    own_grad_norm: bool
    # (output, batch) -> output with the loss to train on, from outside the model (general distillation)
    objective: Any = None
    # With own_grad_norm: the max norm we clip to (DeepSpeed's gradient_clipping is 0 then; ds_config.py)
    clip: float = 0.0
    # The optimizer computes the norm and clips inside its step (flat_optim): its norm is logged
    optimizer_norm: bool = False

    @classmethod
    def for_run(cls, engine, cfg, device: torch.device, grad_accum: int, objective=None) -> "StepRunner":
        """The runner of a TrainConfig's run: who computes the gradient norm and clips
        (``precision.trainer_clips``) follows from its precision and ZeRO stage."""
        from bertdist.train.precision import trainer_clips

        by_optimizer = cfg.optimizer.clips_itself
        own = trainer_clips(cfg.deepspeed.precision, cfg.deepspeed.zero_stage) and not by_optimizer
        return cls(engine, device, grad_accum, cfg.deepspeed.precision, cfg.model_config, own_grad_norm=own,
                   objective=objective, clip=cfg.deepspeed.gradient_clipping if own else 0.0,
                   optimizer_norm=by_optimizer)

    def __post_init__(self):
        self.params = list({id(p): p for p in self.engine.module.parameters()}.values())
        d, v = self.model.hidden_size, self.model.vocab_size
        self.head_flops = 3 * 2 * (d * d + d * v)  # training FLOPs of the MLM head per predicted position
        if isinstance(self.model, ElectraConfig):  # the generator's head: its hidden size to the embeddings, then V
            e, h = self.model.embedding_width, self.model.generator_hidden_size
            self.head_flops = 3 * 2 * (h * e + e * v)

    def flops(self, mb: dict[str, torch.Tensor], mlm_count) -> torch.Tensor | float:
        n_seq, width = mb["input_ids"].shape
        if self.model.sparse_mlm_head:  # FLOPs are linear in the number of predicted positions
            return n_seq * train_flops_per_sequence(self.model, width, 0) + self.head_flops * mlm_count.double()
        return n_seq * train_flops_per_sequence(self.model, width)


@dataclasses.dataclass
class StepResult:
    sums: dict[str, float]  # STEP_FIELDS, summed over ranks
    lr: float  # the lr this step used
    grad_norm: float
    skipped: int  # optimizer steps DeepSpeed skipped in this step (fp16 overflow)


@dataclasses.dataclass
class PendingStep:
    """A step whose work is queued on the device and whose sums are not read yet."""

    sums: DeviceSums  # this rank's, not yet all-reduced
    lr: float
    skipped: int
    engine_grad_norm: float | None  # DeepSpeed's own (fp16, ZeRO), already on the host; else in sums


def _accumulate(r: StepRunner, sums: DeviceSums, out, mb: dict[str, torch.Tensor]) -> None:
    lv = out.loss.detach().float()
    values = {"loss": lv / r.grad_accum, "mlm_loss": out.mlm_loss.detach().float() / r.grad_accum}
    if out.nsp_loss is not None:
        values["nsp_loss"] = out.nsp_loss.detach().float() / r.grad_accum
    if getattr(out, "disc_loss", None) is not None:
        values["disc_loss"] = out.disc_loss.detach().float() / r.grad_accum
    for name in DISTILL_FIELDS:
        if getattr(out, name, None) is not None:
            values[name] = getattr(out, name).detach().double() / r.grad_accum
    stats = batch_stats(out, mb)
    values.update(stats)
    n_seq, width = mb["input_ids"].shape
    values.update(real_tokens=mb["attention_mask"].sum(), padded_tokens=n_seq * width, sequences=n_seq,
                  flops=r.flops(mb, stats["mlm_count"]), nonfinite=~torch.isfinite(lv))
    sums.add_all(values)


def _refuse_nonfinite(totals: dict[str, float], step: int, precision: str) -> None:
    """Without a loss scaler nothing undoes a NaN update. The flag is read with the logging
    window's sums (reading it before the update would stall the device once more per step), every
    rank raises at the same step, and the trainer settles before every checkpoint, so a NaN update
    is never saved."""
    if totals["nonfinite"] > 0:
        raise NonFiniteLossError(
            f"non-finite loss at step {step} ({precision}); the update was not saved. Try a lower "
            f"optimizer.lr or a longer warmup, a smaller deepspeed.gradient_clipping, fp32 instead of bf16, "
            f"and check the records; then restart from the last good checkpoint with --resume auto")


def launch_step(r: StepRunner, micro_batches: list[dict[str, torch.Tensor]], stop_requested: bool) -> PendingStep:
    """Forward, backward and optimizer step over ``grad_accum`` micro-batches, queued without
    reading the device (``settle`` reads the result)."""
    engine = r.engine
    skipped_before = engine.skipped_steps
    lr = engine.get_lr()[0]  # the scheduler moves on inside engine.step
    sums = DeviceSums(STEP_FIELDS, r.device)
    for i, mb in enumerate(micro_batches):
        last = i == r.grad_accum - 1
        mb = batch_to_device(mb, r.device)
        with record_function(REGIONS[0]):
            out = engine(**mb)
            if r.objective is not None:
                out = r.objective(out, mb)
        with torch.no_grad(), record_function(REGIONS[1]):
            _accumulate(r, sums, out, mb)
        with record_function(REGIONS[2]):
            engine.backward(out.loss)
            if r.optimizer_norm and not last:  # bf16 weights: this micro-batch's gradients into the fp32 sum
                engine.optimizer.accumulate_grads()
        with record_function(REGIONS[3]):
            if last and r.own_grad_norm:  # gradients are reduced by now
                sums.add("grad_norm", clip_gradients(r.params, r.clip).double())
            engine.step()
            if last and r.optimizer_norm:
                sums.add("grad_norm", engine.optimizer.grad_norm)
                # DeepSpeed dropped every .grad after its step: the flat optimizer's views of its
                # gradient buffer come back, zeroed in one fill, before the next backward
                engine.optimizer.zero_grad()
    sums.add("stop", 1.0 if stop_requested else 0.0)
    gn = None if r.own_grad_norm or r.optimizer_norm else engine.get_global_grad_norm()
    return PendingStep(sums, lr, engine.skipped_steps - skipped_before,
                       None if gn is None else float(gn))


def settle(pending: list[PendingStep], first_step: int, precision: str) -> list[StepResult]:
    """The results of queued steps ``first_step``, ``first_step + 1``, ...: their sums
    all-reduced in one collective and read in one host sync. The gradient norm is the same on
    every rank, so its sum is divided by the world size. Raises at the first non-finite step
    (fp32, bf16)."""
    import torch.distributed as dist

    if not pending:
        return []
    stacked = torch.stack([p.sums.combined() for p in pending])
    world = dist.get_world_size()
    if world > 1:
        dist.all_reduce(stacked)
    results = []
    for k, (p, row) in enumerate(zip(pending, stacked.tolist())):
        totals = dict(zip(STEP_FIELDS, row))
        if precision != "fp16":
            _refuse_nonfinite(totals, first_step + k, precision)
        gn = totals["grad_norm"] / world if p.engine_grad_norm is None else p.engine_grad_norm
        results.append(StepResult(totals, p.lr, gn, p.skipped))
    return results


def train_step(r: StepRunner, micro_batches: list[dict[str, torch.Tensor]], step: int, stop_requested: bool
               ) -> StepResult:
    """One step, launched and settled at once; ``step`` is its number (1-based, for messages)."""
    return settle([launch_step(r, micro_batches, stop_requested)], step, r.precision)[0]


def step_metrics(res: StepResult, seconds: float, world_size: int, peak_flops: float, loss_scale: float,
                 skipped_total: int, epoch: int) -> dict[str, float]:
    """The per-step row of metrics.jsonl (and TensorBoard)."""
    s = res.sums
    m = {
        "loss": s["loss"] / world_size, "mlm_loss": s["mlm_loss"] / world_size,
        "mlm_acc": s["mlm_correct"] / max(1.0, s["mlm_count"]), "lr": res.lr, "grad_norm": res.grad_norm,
        "loss_scale": loss_scale, "skipped_steps": skipped_total,
        "seq_per_s": s["sequences"] / seconds, "tokens_per_s": s["real_tokens"] / seconds,
        "padded_tokens_per_s": s["padded_tokens"] / seconds, "tflops": s["flops"] / seconds / 1e12,
        "mfu": s["flops"] / seconds / world_size / peak_flops if peak_flops else float("nan"),
        "epoch": epoch, "step_time_s": seconds,
    }
    if s["nsp_count"] > 0:
        m["nsp_loss"] = s["nsp_loss"] / world_size
        m["nsp_acc"] = s["nsp_correct"] / s["nsp_count"]
    m.update({name: s[name] / world_size for name in DISTILL_FIELDS if s[name] != 0.0})
    if s["disc_count"] > 0:  # ELECTRA: mlm_* are the generator's
        m.update(disc_loss=s["disc_loss"] / world_size, disc_acc=s["disc_correct"] / s["disc_count"],
                 replaced_rate=s["replaced_count"] / s["disc_count"])
    return m


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]], device: torch.device,
             objective=None) -> dict[str, float]:
    """Held-out MLM loss / accuracy and NSP (or SOP) accuracy and loss, summed over all ranks; for
    ELECTRA the generator's MLM and the discriminator's loss, accuracy and replaced-token rate, with
    replacements drawn inside ``objective.evaluation()`` (a fixed seed per evaluation)."""
    import contextlib

    import torch.nn.functional as F

    engine.eval()
    sums = DeviceSums(EVAL_FIELDS, device)
    with getattr(objective, "evaluation", contextlib.nullcontext)():
        for mb in batches:
            mb = batch_to_device(mb, device)
            out = engine(**mb)
            logits = out.prediction_logits.float()
            sums.add("mlm_loss_sum", F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     out.mlm_labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                                     reduction="sum").double())
            for name, value in batch_stats(out, mb).items():
                sums.add(name, value)
            if "next_sentence_label" in mb and out.seq_relationship_logits is not None:
                sums.add("nsp_loss_sum", F.cross_entropy(out.seq_relationship_logits.float(),
                                                         mb["next_sentence_label"], reduction="sum").double())
            if getattr(out, "discriminator_logits", None) is not None:
                bce = F.binary_cross_entropy_with_logits(out.discriminator_logits.float(), out.replaced.float(),
                                                         reduction="none")
                sums.add("disc_loss_sum", (bce * out.real).sum().double())
    engine.train()
    s = sums.all_reduce()
    res = {"mlm_loss": s["mlm_loss_sum"] / max(1.0, s["mlm_count"]),
           "mlm_acc": s["mlm_correct"] / max(1.0, s["mlm_count"]), "masked_tokens": s["mlm_count"]}
    if s["nsp_count"] > 0:
        res.update(nsp_acc=s["nsp_correct"] / s["nsp_count"], nsp_loss=s["nsp_loss_sum"] / s["nsp_count"],
                   sequences=s["nsp_count"])
    if s["disc_count"] > 0:
        res.update(disc_loss=s["disc_loss_sum"] / s["disc_count"], disc_acc=s["disc_correct"] / s["disc_count"],
                   replaced_rate=s["replaced_count"] / s["disc_count"])
    return res


def balanced_eval(batches: list, device: torch.device) -> list:
    """Every rank must run the same number of forwards (ZeRO-3 gathers weights collectively)."""
    import torch.distributed as dist

    n = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return batches[: int(n.item())]
