"""One optimizer step and one evaluation pass, with the statistics they log.

Everything logged is summed on the device in named slots of one float64 tensor (``DeviceSums``)
and all-reduced once per step: no host sync per micro-batch, one collective, and NCCL reduces
only device tensors. The step's sums also carry the non-finite and SIGTERM flags, so every rank
takes the same decision at the same step. That all-reduce is the step's only host sync: the
batches carry their packing (``loader.batch_to_device``), so the model reads no data-dependent
size from the device, and the non-finite check waits for the step's sums.
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


class DeviceSums:
    """Named float64 sums on one device, all-reduced together."""

    def __init__(self, fields: Sequence[str], device: torch.device):
        self.fields = tuple(fields)
        self._index = {f: i for i, f in enumerate(self.fields)}
        self.values = torch.zeros(len(self.fields), dtype=torch.float64, device=device)

    def add(self, name: str, value) -> None:
        self.values[self._index[name]] += value

    def all_reduce(self) -> dict[str, float]:
        import torch.distributed as dist

        dist.all_reduce(self.values)
        return dict(zip(self.fields, self.values.tolist()))


# Per-step sums: losses are averaged over the accumulation steps on each rank, everything else counts.
STEP_FIELDS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count",
               "real_tokens", "padded_tokens", "sequences", "flops", "nonfinite", "stop", "mlm_kl", "hidden_cos",
               "disc_loss", "disc_correct", "disc_count", "replaced_count")
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
    # DeepSpeed computes no global gradient norm for fp32 without ZeRO: then we do.
    own_grad_norm: bool
    # (output, batch) -> output with the loss to train on, from outside the model (general distillation)
    objective: Any = None

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


def _accumulate(r: StepRunner, sums: DeviceSums, out, mb: dict[str, torch.Tensor]) -> None:
    lv = out.loss.detach().float().double()
    sums.add("loss", lv / r.grad_accum)
    sums.add("mlm_loss", out.mlm_loss.detach().float().double() / r.grad_accum)
    if out.nsp_loss is not None:
        sums.add("nsp_loss", out.nsp_loss.detach().float().double() / r.grad_accum)
    if getattr(out, "disc_loss", None) is not None:
        sums.add("disc_loss", out.disc_loss.detach().float().double() / r.grad_accum)
    for name in DISTILL_FIELDS:
        if getattr(out, name, None) is not None:
            sums.add(name, getattr(out, name).detach().double() / r.grad_accum)
    stats = batch_stats(out, mb)
    for name, value in stats.items():
        sums.add(name, value)
    n_seq, width = mb["input_ids"].shape
    sums.add("real_tokens", mb["attention_mask"].sum())
    sums.add("padded_tokens", n_seq * width)
    sums.add("sequences", n_seq)
    sums.add("flops", r.flops(mb, stats["mlm_count"]))
    sums.add("nonfinite", (~torch.isfinite(lv)).double())


def _refuse_nonfinite(totals: dict[str, float], step: int, precision: str) -> None:
    """Without a loss scaler nothing undoes a NaN update. The flag is read from the step's one
    all-reduce (reading it before the update would stall the device once more per step), and
    every rank raises at the same step, before the update is logged or saved."""
    if totals["nonfinite"] > 0:
        raise NonFiniteLossError(
            f"non-finite loss at step {step} ({precision}); the update was not saved. Try a lower "
            f"optimizer.lr or a longer warmup, a smaller deepspeed.gradient_clipping, fp32 instead of bf16, "
            f"and check the records; then restart from the last good checkpoint with --resume auto")


def train_step(r: StepRunner, micro_batches: list[dict[str, torch.Tensor]], step: int, stop_requested: bool
               ) -> StepResult:
    """Forward, backward and optimizer step over ``grad_accum`` micro-batches; ``step`` is the
    number of the step being taken (1-based, for messages)."""
    engine = r.engine
    skipped_before = engine.skipped_steps
    lr = engine.get_lr()[0]  # the scheduler moves on inside engine.step
    sums = DeviceSums(STEP_FIELDS, r.device)
    own_gn = float("nan")
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
        with record_function(REGIONS[3]):
            if last and r.own_grad_norm:  # gradients are reduced by now
                own_gn = torch.sqrt(sum((p.grad.detach().float() ** 2).sum() for p in r.params if p.grad is not None))
            engine.step()
    sums.add("stop", 1.0 if stop_requested else 0.0)
    totals = sums.all_reduce()
    if r.precision != "fp16":
        _refuse_nonfinite(totals, step, r.precision)
    gn = engine.get_global_grad_norm()
    return StepResult(totals, lr, float(gn) if gn is not None else float(own_gn),
                      engine.skipped_steps - skipped_before)


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
