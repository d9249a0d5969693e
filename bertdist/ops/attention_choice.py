"""``attention_backend: auto``: ModernBERT's windowed attention backend as a measured choice.

The same planning as ``kernels: auto`` (``selection.decide``: numerics gate, timing, decision
cache, rank 0 decides and broadcasts, the logged table), over the ops ``WINDOW_OPS`` whose
candidates are the backend names of ``windowed_attention.py``:

- the cases: the run's layer kinds, a global layer (no window) and a local one (its window),
  on the op the model calls (packed, or padded with ``unpad`` off), at the run's head size
  and compute dtype, with its attention dropout when training, on a small batch (at most
  ``GATE_BATCH`` sequences of at most ``GATE_SEQ`` tokens, BERT-like lengths); training
  gates and times forward + backward, inference the forward alone;
- every candidate is gated against the reference twin (``reference_window_attention`` /
  ``reference_varlen_window_attention``) and the ones that pass are timed; ``flex`` is
  excluded where it cannot run the pass (dropout; a backward on CPU);
- the choice is one backend for the whole model: among those that passed every case, the
  least time summed over the layers (each case's time x its number of layers). The reference
  twin is there to set the error bounds: it is chosen only when nothing else passed.

A model built outside a decision (``ModernBertForMaskedLM(config)`` with ``auto``) runs
``UNMEASURED`` until ``set_attention_backend`` gives it the decided one.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Callable, Iterable

import torch

from bertdist.ops.candidates import WINDOW_BASELINE, Candidate, Case
from bertdist.ops.kernel_plan import KernelPlan
from bertdist.ops.timing import Timer

GATE_BATCH = 4
GATE_SEQ = 1024
UNMEASURED = "sdpa"  # what ``auto`` runs undecided: every device, dropout and a backward
DECISIONS_FILE = "attention_decisions.json"
_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class AttentionWorkload:
    """What a ModernBERT run asks of its attention: one case per layer kind (``layers``: half
    window or None for global -> how many layers of that kind)."""

    batch: int
    seq: int
    hidden: int
    heads: int
    layers: tuple[tuple[int | None, int], ...]
    dtype: str = "float32"
    dropout: float = 0.0
    training: bool = True
    packed: bool = True

    @classmethod
    def for_model(cls, cfg, *, batch: int, seq: int, precision: str = "fp32",
                  training: bool = True) -> "AttentionWorkload":
        """From a ``ModernBertConfig`` and the run's micro batch, sequence length and precision."""
        n_global = sum(cfg.is_global(i) for i in range(cfg.num_hidden_layers))
        kinds = ((None, n_global), (cfg.half_window, cfg.num_hidden_layers - n_global))
        return cls(batch=max(1, min(batch, GATE_BATCH)),
                   seq=max(2, min(seq, cfg.max_position_embeddings, GATE_SEQ)), hidden=cfg.hidden_size,
                   heads=cfg.num_attention_heads, layers=tuple((w, n) for w, n in kinds if n),
                   dtype=_PRECISION_DTYPES[precision], dropout=cfg.attention_dropout if training else 0.0,
                   training=training, packed=cfg.unpad)

    @property
    def op(self) -> str:
        return "varlen_window_attention" if self.packed else "window_attention"

    def cases(self, device_type: str) -> list[Case]:
        return [Case(self.op, self.dtype, self.dropout > 0, device_type, self.batch, self.seq, self.hidden, self.heads,
                     p=self.dropout, half_window=w, backward=self.training)
                for w, _ in self.layers]


@dataclasses.dataclass
class AttentionChoice:
    backend: str
    plan: KernelPlan | None
    summary: str


def combine(plan: KernelPlan, workload: AttentionWorkload) -> tuple[str, str]:
    """One backend for every layer, and the line that says why: among the candidates that
    passed every case, the least time summed over the layers; the reference twin when none."""
    by_case = {d.case.half_window: d for d in plan.decisions.values()}
    totals: dict[str, float] = {}
    why: dict[str, str] = {}
    names = [m.name for m in next(iter(by_case.values())).measurements]
    for name in names:
        total = 0.0
        for window, count in workload.layers:
            m = by_case[window].measurement(name)
            if m is None or m.status != "passed" or m.ms is None:
                why.setdefault(name, f"{m.status if m else 'absent'} on {by_case[window].case.window}"
                               + (f": {m.reason}" if m and m.reason else ""))
                break
            total += m.ms * count
        else:
            totals[name] = total
    others = {n: t for n, t in totals.items() if n != WINDOW_BASELINE}
    chosen = min(others, key=others.get) if others else WINDOW_BASELINE
    layer_text = " + ".join(f"{n} {'global' if w is None else f'local (+-{w})'}" for w, n in workload.layers)
    figures = [f"{n} {t:.3f} ms" + (" (reference twin)" if n == WINDOW_BASELINE else "") for n, t in totals.items()]
    figures += [f"{n} {w}" for n, w in why.items()]
    mode = "forward + backward" if workload.training else "forward"
    summary = (f"attention_backend: auto chose {chosen}: {mode} of {layer_text} layers at batch {workload.batch} x "
               f"seq {workload.seq}, {workload.heads} heads x {workload.hidden // workload.heads}, {workload.dtype}"
               f"{f', dropout {workload.dropout:g}' if workload.dropout else ''}; summed over the layers: "
               + "; ".join(figures))
    return chosen, summary


def _with_choice(plan: KernelPlan, chosen: str) -> KernelPlan:
    """The plan with every case's choice the combined one (the table shows what the run runs)."""
    decisions = {k: dataclasses.replace(d, choice=chosen) for k, d in plan.decisions.items()}
    return dataclasses.replace(plan, decisions=decisions)


def decide_attention_backend(model_cfg, device: torch.device, *, batch: int, seq: int, precision: str = "fp32",
                             training: bool = True, cache=None, timer: Timer | None = None, measurer=None,
                             extra: Iterable[Candidate] = (), include_test_only: bool = False, agree: bool = True,
                             profile=None, log: Callable[[str], None] | None = None,
                             run_dir: str | None = None) -> AttentionChoice:
    """The backend ``attention_backend: auto`` runs for ``model_cfg`` (a ``ModernBertConfig``)
    on ``device``: decided on rank 0 (``agree``) and broadcast, logged once with its table and
    figures (``log``; default stderr), copied to ``run_dir/attention_decisions.json``. A decision
    that fails warns and runs ``UNMEASURED``."""
    from bertdist.ops import selection
    from bertdist.ops.decision_cache import DecisionCache

    workload = AttentionWorkload.for_model(model_cfg, batch=batch, seq=seq, precision=precision, training=training)
    cache = DecisionCache() if cache is None else cache

    def make() -> KernelPlan:
        return selection.decide(workload, device, cache=cache or None, timer=timer, measurer=measurer, extra=extra,
                                include_test_only=include_test_only, profile=profile)

    try:
        plan = selection.agree_plan(make, device) if agree else make()
    except Exception as e:  # noqa: BLE001 - a backend that runs everywhere, said loudly
        warnings.warn(f"attention_backend=auto: could not decide on {device} ({type(e).__name__}: {e}); "
                      f"running {UNMEASURED}", RuntimeWarning, stacklevel=2)
        return AttentionChoice(UNMEASURED, None, f"attention_backend: auto undecided ({e}); running {UNMEASURED}")
    chosen, summary = combine(plan, workload)
    plan = _with_choice(plan, chosen)
    if _rank() == 0:
        selection.log_once(plan, log)
        (log or (lambda s: print(s, file=sys.stderr, flush=True)))(summary)
        if run_dir is not None:
            selection.plan_copy(plan, run_dir, DECISIONS_FILE)
    return AttentionChoice(chosen, plan, summary)


def decide_for_run(cfg, device: torch.device, run_dir) -> AttentionChoice | None:
    """A pretraining run's ``attention_backend: auto`` (``cfg`` a TrainConfig): the backend rank 0
    measured for the run's shapes (every rank runs it), logged on rank 0 and copied to
    ``run_dir``; None when the config names a backend."""
    if cfg.model_config.attention_backend != "auto":
        return None
    return decide_attention_backend(cfg.model_config, device, batch=cfg.data.micro_batch_size,
                                    seq=cfg.data.max_seq_length, precision=cfg.deepspeed.precision,
                                    run_dir=str(run_dir))


def apply_choice(model: torch.nn.Module, choice: AttentionChoice) -> None:
    set_attention_backend(model, choice.backend)


def set_attention_backend(model: torch.nn.Module, backend: str) -> int:
    """Make every ModernBERT attention module of ``model`` run ``backend``; returns how many."""
    from bertdist.model.modernbert import ModernBertAttention
    from bertdist.ops.windowed_attention import VARLEN_BACKENDS

    if backend not in VARLEN_BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {sorted(VARLEN_BACKENDS)}")
    n = 0
    for m in model.modules():
        if isinstance(m, ModernBertAttention):
            m.backend = backend
            n += 1
    return n


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
