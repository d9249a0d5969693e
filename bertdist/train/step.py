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

from bertdist.model import BertConfig
from bertdist.model.families import family_of
from bertdist.train import cuda_graphs as graphs
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
# An objective (bertdist/train/objective.py) fills the loss parts and counts it has.
STEP_FIELDS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count",
               "real_tokens", "padded_tokens", "sequences", "flops", "nonfinite", "stop", "mlm_kl", "hidden_cos",
               "disc_loss", "disc_correct", "disc_count", "replaced_count", "grad_norm")
# The parts of a distillation objective's loss (train/distill_objective.py), logged when it has them.
DISTILL_FIELDS = ("mlm_kl", "hidden_cos")
EVAL_FIELDS = ("mlm_loss_sum", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "nsp_loss_sum",
               "disc_loss_sum", "disc_correct", "disc_count", "replaced_count")


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
    # the objective (bertdist/train/objective.py): the model's output -> the loss, its parts and counts;
    # None: masked LM (+ NSP)
    objective: Any = None
    # With own_grad_norm: the max norm we clip to (DeepSpeed's gradient_clipping is 0 then; ds_config.py)
    clip: float = 0.0
    # The optimizer computes the norm and clips inside its step (flat_optim): its norm is logged
    optimizer_norm: bool = False
    # The compiled regions run as CUDA graphs (bertdist/train/cuda_graphs.py): each micro-batch is
    # marked as a new step of the graphs, and gradients accumulate in buffers of their own
    cuda_graphs: bool = False

    @classmethod
    def for_run(cls, engine, cfg, device: torch.device, grad_accum: int, objective=None,
                cuda_graphs: bool = False) -> "StepRunner":
        """The runner of a TrainConfig's run: who computes the gradient norm and clips
        (``precision.trainer_clips``) follows from its precision and ZeRO stage. ``cuda_graphs``:
        the run's ``cuda_graphs.decide_cuda_graphs`` decision."""
        from bertdist.train.precision import trainer_clips

        by_optimizer = cfg.optimizer.clips_itself
        own = trainer_clips(cfg.deepspeed.precision, cfg.deepspeed.zero_stage) and not by_optimizer
        if objective is None:
            from bertdist.train.objective import MaskedLM

            objective = MaskedLM(cfg)
        return cls(engine, device, grad_accum, cfg.deepspeed.precision, cfg.model_config, own_grad_norm=own,
                   objective=objective, clip=cfg.deepspeed.gradient_clipping if own else 0.0,
                   optimizer_norm=by_optimizer, cuda_graphs=cuda_graphs)

    def __post_init__(self):
        self.params = list({id(p): p for p in self.engine.module.parameters()}.values())
        self.family = family_of(self.model)
        if self.objective is None:
            from bertdist.train.objective import MaskedLM

            self.objective = MaskedLM(_ModelOnly(self.model))

    def forward(self, mb: dict[str, torch.Tensor]):
        """The objective's output for one micro-batch already on the device."""
        return self.objective(self.engine(**self.family.model_inputs(mb)), mb)

    def flops(self, mb: dict[str, torch.Tensor], mlm_count) -> torch.Tensor | float:
        """The micro-batch's training FLOPs, the family's count (bertdist/model/families.py)."""
        return self.family.train_flops_of_batch(self.model, mb, mlm_count)


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


@dataclasses.dataclass(frozen=True)
class _ModelOnly:
    """What ``MaskedLM`` reads of a config, for a runner built from a model config alone."""

    model_config: Any


def _accumulate(r: StepRunner, sums: DeviceSums, res, mb: dict[str, torch.Tensor]) -> None:
    """Add one micro-batch's ``ObjectiveOutput`` (its loss, parts and counts) and the batch's sizes."""
    lv = res.loss.detach().float()
    values = {"loss": lv / r.grad_accum}
    values.update({name: part.detach().float() / r.grad_accum for name, part in res.parts.items()})
    values.update(res.counts)
    n_seq, width = mb["input_ids"].shape
    values.update(real_tokens=mb["attention_mask"].sum(), padded_tokens=n_seq * width, sequences=n_seq,
                  flops=r.flops(mb, res.counts["mlm_count"]), nonfinite=~torch.isfinite(lv))
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


def launch_step(r: StepRunner, micro_batches: list[dict[str, torch.Tensor]], stop_requested: bool,
                step: int | None = None) -> PendingStep:
    """Forward, backward and optimizer step over ``grad_accum`` micro-batches, queued without
    reading the device (``settle`` reads the result). ``step``: its number, for messages."""
    engine = r.engine
    skipped_before = engine.skipped_steps
    lr = engine.get_lr()[0]  # the scheduler moves on inside engine.step
    sums = DeviceSums(STEP_FIELDS, r.device)
    if r.cuda_graphs and r.grad_accum > 1 and not r.optimizer_norm:
        graphs.stable_grads(r.params)  # not graph outputs, which the next micro-batch overwrites
    for i, mb in enumerate(micro_batches):
        try:
            _micro_step(r, sums, mb, last=i == r.grad_accum - 1)
        except Exception as e:
            if not (r.cuda_graphs and graphs.is_graph_failure(e)):
                raise
            graphs.raise_graph_failure(e, f"step {step if step is not None else '?'}, micro-batch {i + 1} "
                                               f"of {r.grad_accum}")
    sums.add("stop", 1.0 if stop_requested else 0.0)
    gn = None if r.own_grad_norm or r.optimizer_norm else engine.get_global_grad_norm()
    return PendingStep(sums, lr, engine.skipped_steps - skipped_before,
                       None if gn is None else float(gn))


def _micro_step(r: StepRunner, sums: DeviceSums, mb: dict[str, torch.Tensor], last: bool) -> None:
    """One micro-batch's forward, sums and backward, and after the last the optimizer step."""
    engine = r.engine
    mb = batch_to_device(mb, r.device)
    if r.cuda_graphs:  # a new generation of the graphs: this micro-batch's outputs may reuse the last one's memory
        graphs.mark_step()
    with record_function(REGIONS[0]):
        res = r.forward(mb)
    with torch.no_grad(), record_function(REGIONS[1]):
        _accumulate(r, sums, res, mb)
    with record_function(REGIONS[2]):
        engine.backward(res.loss)
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
    return settle([launch_step(r, micro_batches, stop_requested, step)], step, r.precision)[0]


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
def evaluate(engine, batches: list[dict[str, torch.Tensor]], device: torch.device, objective=None,
             model=None, cuda_graphs: bool = False) -> dict[str, float]:
    """Held-out MLM loss / accuracy and NSP (or SOP) accuracy and loss, summed over all ranks; for
    ELECTRA the generator's MLM and the discriminator's loss, accuracy and replaced-token rate, with
    replacements drawn inside ``objective.evaluation()`` (a fixed seed per evaluation). The sums
    are the objective's (``eval_sums``; None: masked LM); ``model``: the model config, whose family
    says how the model takes a batch (None: the module's ``config``, else as it is).
    ``cuda_graphs``: each batch is a new step of the graphs, as a training micro-batch is."""
    import contextlib

    from bertdist.train.objective import mlm_eval_sums

    module = getattr(engine, "module", engine)
    config = model if model is not None else getattr(module, "config", None)
    inputs = family_of(config).model_inputs if config is not None else (lambda mb: mb)
    eval_sums = getattr(objective, "eval_sums", mlm_eval_sums)
    engine.eval()
    sums = DeviceSums(EVAL_FIELDS, device)
    with getattr(objective, "evaluation", contextlib.nullcontext)():
        for i, mb in enumerate(batches):
            mb = batch_to_device(mb, device)
            try:
                if cuda_graphs:
                    graphs.mark_step()
                sums.add_all(eval_sums(engine(**inputs(mb)), mb))
            except Exception as e:
                if not (cuda_graphs and graphs.is_graph_failure(e)):
                    raise
                graphs.raise_graph_failure(e, f"evaluation batch {i + 1} of {len(batches)}")
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
