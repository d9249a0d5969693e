"""The types of a ``kernels: auto`` plan: what it decides for, what it decides, where that holds.

``Workload`` is the shapes and dtypes a run's config implies; its ``cases`` are the decisions to
make, known up front on every rank (never read from a batch, whose padded length differs per
rank). ``Measurement``, ``Decision`` and ``KernelPlan`` are what the measurement yields, with the
JSON form that is cached, broadcast from rank 0 and copied into the run directory, and the table
that is logged. ``environment`` is what a cached decision is valid for (device, torch, our build).
The planning that fills them in is ``selection.py``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from bertdist.device_profile import DeviceProfile, for_device_type
from bertdist.ops.candidates import OPS, Candidate, Case, LayerContext

SELECTION_VERSION = 2  # part of the environment: a new version measures afresh
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- what a run will call


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shapes and dtypes a run's config implies. ``dtypes``: the compute dtypes of the
    model (bf16 under DeepSpeed bf16); ``autocast``: the model runs under torch.autocast, where
    the layer-norm ops run in fp32 (torch's CUDA policy, and our fused ops register the same).
    ``unpad``: which attention op the model calls (None: decide both). ``in_layer``: candidates
    are timed inside one encoder layer of this shape (``intermediate``: its FFN width, 0: 4 x
    hidden; ``compiled``: regionally compiled, as ``model.compile`` runs it), not as the op alone."""

    batch: int
    seq: int
    hidden: int
    heads: int
    dtypes: tuple[str, ...] = ("float32",)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    eps: float = 1e-12
    unpad: bool | None = None
    autocast: bool = False
    ops: tuple[str, ...] = OPS  # decide only these ops (the others run torch-native)
    intermediate: int = 0
    compiled: bool = False
    in_layer: bool = True

    def __post_init__(self) -> None:
        if set(self.ops) - set(OPS):
            raise ValueError(f"Workload.ops: unknown {sorted(set(self.ops) - set(OPS))}; ops are {OPS}")
        bad = [d for d in self.dtypes if d not in DTYPES]
        if bad or not self.dtypes:
            raise ValueError(f"Workload.dtypes must be some of {sorted(DTYPES)}, got {self.dtypes}")
        if min(self.batch, self.seq, self.hidden, self.heads) <= 0 or self.hidden % self.heads:
            raise ValueError(f"Workload: batch {self.batch}, seq {self.seq}, hidden {self.hidden}, heads {self.heads}: "
                             "all must be positive and hidden divisible by heads")

    @classmethod
    def for_model(cls, cfg, *, batch: int, seq: int, precision: str = "fp32", autocast: bool = False,
                  compiled: bool = False) -> "Workload":
        """From a ``BertConfig`` and the run's micro batch, sequence length and precision;
        ``compiled``: whether ``model.compile`` resolved true for the run."""
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
        return cls(batch=batch, seq=min(seq, cfg.max_position_embeddings), hidden=cfg.hidden_size,
                   heads=cfg.num_attention_heads, dtypes=(dtype,), hidden_dropout=cfg.hidden_dropout_prob,
                   attention_dropout=cfg.attention_probs_dropout_prob, eps=cfg.layer_norm_eps, unpad=cfg.unpad,
                   autocast=autocast and dtype != "float32", intermediate=cfg.intermediate_size, compiled=compiled)

    def layer(self, dtype: str, attention: str) -> LayerContext | None:
        """The layer a case at ``dtype`` is timed in (None: as the op alone); ``attention``: the
        attention op it calls."""
        if not self.in_layer:
            return None
        return LayerContext(self.intermediate or 4 * self.hidden, dtype, self.autocast, self.hidden_dropout,
                            self.attention_dropout, unpad=attention == "varlen_attention", compiled=self.compiled)

    def cases(self, device_type: str) -> list[Case]:
        out: list[Case] = []
        shape = dict(device_type=device_type, batch=self.batch, seq=self.seq, hidden=self.hidden, heads=self.heads,
                     eps=self.eps)
        attention_ops = {None: ("attention", "varlen_attention"), False: ("attention",), True: ("varlen_attention",)}
        for dtype in self.dtypes:
            norm = "float32" if self.autocast else dtype
            layer = self.layer(dtype, attention_ops[self.unpad][0])
            out.append(Case("layer_norm", norm, False, layer=layer, **shape))
            for p in sorted({self.hidden_dropout, 0.0}, reverse=True):
                out.append(Case("bias_dropout_add_layer_norm", norm, p > 0, p=p, layer=layer, **shape))
            for op in attention_ops[self.unpad]:
                for p in sorted({self.attention_dropout, 0.0}, reverse=True):
                    out.append(Case(op, dtype, p > 0, p=p, layer=self.layer(dtype, op), **shape))
        seen, unique = set(), []
        for c in out:
            if c.key not in seen and c.op in self.ops:
                seen.add(c.key)
                unique.append(c)
        return unique


# ---------------------------------------------------------------- the time budget


@dataclasses.dataclass
class Budget:
    """The seconds ``kernels: auto`` may spend measuring (``model.kernels_budget_s``), counted
    on ``clock`` from ``start``. Checked before each case: a case that has started is finished."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float | None = None

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"kernels budget: seconds must be >= 0, got {self.seconds}")
        if self.start is None:
            self.start = self.clock()

    @classmethod
    def of(cls, seconds: float | None, clock: Callable[[], float] = time.monotonic) -> "Budget | None":
        """A budget starting now, or None (no limit) for ``seconds`` None."""
        return None if seconds is None else cls(seconds, clock)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds

    def to_child(self) -> dict:
        """What a measuring child needs (its own clock: the seconds already spent, not a time)."""
        return {"seconds": self.seconds, "elapsed": self.elapsed()}

    @classmethod
    def from_child(cls, d: dict | None) -> "Budget | None":
        if d is None:
            return None
        return cls(d["seconds"], time.monotonic, time.monotonic() - d["elapsed"])

    def skipped(self, case: Case, candidates: list[Candidate]) -> "Decision":
        """The decision for a case not measured: the baseline (what ``kernels: reference`` runs)."""
        why = (f"not measured: the kernels budget ({self.seconds:g} s, model.kernels_budget_s) was spent after "
               f"{self.elapsed():.0f} s; a later run measures it (decisions are cached)")
        base = candidates[0]
        ms = [Measurement(base.name, base.family, "not measured", why)]
        ms += [Measurement(c.name, c.family, "not measured") for c in candidates[1:]]
        return Decision(case, base.name, ms, [c.name for c in candidates], "budget")


# ---------------------------------------------------------------- results


@dataclasses.dataclass
class Measurement:
    name: str
    family: str
    status: str  # "passed" | "failed" | "error" | "unsupported" | "not measured" (the budget was spent)
    reason: str = ""
    error: float | None = None  # the candidate's worst error (on ``tensor``)
    bound: float | None = None  # its bound on that tensor
    tensor: str | None = None
    ms: float | None = None  # median forward + backward
    ms_range: tuple[float, float] | None = None


@dataclasses.dataclass
class Decision:
    case: Case
    choice: str
    measurements: list[Measurement]
    candidates: list[str]  # every candidate considered (a changed list invalidates the cache)
    origin: str = "measured"  # "measured" | "cache" | "fallback" | "budget" (not measured: the baseline)

    def measurement(self, name: str) -> Measurement | None:
        return next((m for m in self.measurements if m.name == name), None)

    def to_dict(self) -> dict:
        return {"case": dataclasses.asdict(self.case), "choice": self.choice, "candidates": self.candidates,
                "measurements": [dataclasses.asdict(m) for m in self.measurements]}

    @classmethod
    def from_dict(cls, d: dict, origin: str = "cache") -> "Decision":
        ms = [Measurement(**{**m, "ms_range": tuple(m["ms_range"]) if m.get("ms_range") else None})
              for m in d["measurements"]]
        return cls(Case(**d["case"]), d["choice"], ms, list(d["candidates"]), origin)


@dataclasses.dataclass
class KernelPlan:
    """The decisions of one run: which candidate each (op, dtype, dropout) uses."""

    environment: dict
    decisions: dict[str, Decision]
    candidates: dict[str, dict]  # op -> name -> Candidate dict, of every chosen candidate
    note: str = ""

    def choice(self, op: str, dtype: str, dropout: bool) -> Candidate | None:
        for d in self.decisions.values():
            if (d.case.op, d.case.dtype, d.case.dropout) == (op, dtype, dropout):
                c = self.candidates.get(op, {}).get(d.choice)
                return Candidate.from_dict(c) if c else None
        return None

    def to_dict(self) -> dict:
        return {"environment": self.environment, "note": self.note, "candidates": self.candidates,
                "decisions": {k: {**d.to_dict(), "origin": d.origin} for k, d in self.decisions.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "KernelPlan":
        return cls(d["environment"], {k: Decision.from_dict(v, v.get("origin", "cache")) for k, v in d["decisions"].items()},
                   d["candidates"], d.get("note", ""))

    def table(self) -> str:
        return format_table(self.decisions.values(), self.environment, self.note)


def format_table(decisions: Iterable[Decision], environment: dict, note: str = "") -> str:
    decisions = list(decisions)
    from bertdist.ops.candidates import WINDOW_OPS

    what = "attention_backend" if decisions and all(d.case.op in WINDOW_OPS for d in decisions) else "kernels"
    lines = [f"{what}: auto on {environment.get('device')} (torch {environment.get('torch')}, "
             f"build {environment.get('build')}){': ' + note if note else ''}",
             f"  {'op':<28} {'dtype':<9} {'dropout':<8} {'shape':<40} {'candidate':<22} {'error':>9} {'bound':>9} "
             f"{'ms':>9}  result"]
    for d in decisions:
        c = d.case
        lines.append(f"  {c.op} {c.dtype}{' with dropout' if c.dropout else ''}: ms = forward + backward of {c.region}")
        head = [c.op, c.dtype, f"{c.p:g}" if c.dropout else "0", c.shape]
        for i, m in enumerate(d.measurements):
            cols = head if i == 0 else ["", "", "", ""]
            err = f"{m.error:.2e}" if m.error is not None else "-"
            bound = f"{m.bound:.2e}" if m.bound is not None else "-"
            ms = f"{m.ms:.3f}" if m.ms is not None else "-"
            result = "CHOSEN" if m.name == d.choice else m.status
            if m.reason and m.name != d.choice:
                result += f" ({m.reason})"
            elif d.origin != "measured" and m.name == d.choice:
                result += f" [{d.origin}{': ' + m.reason if m.reason else ''}]"
            lines.append(f"  {cols[0]:<28} {cols[1]:<9} {cols[2]:<8} {cols[3]:<40} {m.name:<22} {err:>9} {bound:>9} "
                         f"{ms:>9}  {result}")
        versus = inductor_versus_ours(d)
        if versus:
            lines.append(f"  {versus}")
    errors = [(d, m) for d in decisions for m in d.measurements if m.status == "error"]
    if errors:
        lines.append(f"  {len(errors)} candidate measurement(s) skipped after an error: " + "; ".join(
            f"{m.name} for {d.case.op} {d.case.dtype}{' with dropout' if d.case.dropout else ''}: {m.reason}"
            for d, m in errors))
    unmeasured = [d for d in decisions if d.origin == "budget"]
    if unmeasured:
        lines.append(f"  {len(unmeasured)} case(s) not measured, running the baseline (torch's kernels): "
                     + "; ".join(f"{d.case.op} {d.case.dtype}{' with dropout' if d.case.dropout else ''}"
                                 for d in unmeasured)
                     + f": {unmeasured[0].measurements[0].reason}")
    return "\n".join(lines)


def inductor_versus_ours(d: Decision) -> str | None:
    """Inductor's figure next to our fused kernel's, and which won, where Inductor was timed."""
    ind = d.measurement("inductor")
    if ind is None or ind.ms is None:
        return None
    ours = [m for m in d.measurements if m.family == "fused"]
    timed = [m for m in ours if m.ms is not None]
    if timed:
        best = min(timed, key=lambda m: m.ms)
        theirs = f"ours ({best.name}) {best.ms:.3f} ms"
    else:
        theirs = f"ours not timed ({ours[0].status}: {ours[0].reason})" if ours else "ours not a candidate"
    if d.choice == "inductor":
        verdict = "Inductor's kernel chosen"
    elif timed and d.choice == best.name:
        verdict = "ours chosen"
    else:
        verdict = f"{d.choice} chosen"
    return (f"{d.case.op} {d.case.dtype}{' with dropout' if d.case.dropout else ''}: Inductor {ind.ms:.3f} ms vs "
            f"{theirs} in {d.case.region}: {verdict}")


# ---------------------------------------------------------------- environment


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {model or 'unknown'} ({torch.get_num_threads()} threads)"


def build_id() -> str:
    """A short hash of the loaded ``bertdist._C`` (a rebuild is a new environment), or "none"."""
    import hashlib

    from bertdist.ops import _extension

    mod, _ = _extension.load()
    path = getattr(mod, "__file__", None)
    if not path or not os.path.isfile(path):
        return "none"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _cudnn_version() -> str:
    try:
        return str(torch.backends.cudnn.version())
    except Exception as e:  # noqa: BLE001 - a torch without cuDNN: the environment says so
        return f"none ({type(e).__name__})"


def environment(device: torch.device, profile: DeviceProfile | None = None) -> dict:
    """What a cached decision is valid for. On CUDA the device is ``profile``'s (default: this machine's)."""
    if device.type == "cuda":
        profile = profile or for_device_type("cuda")
        return {"device": profile.name, "torch": profile.torch_version, "cuda": profile.torch_cuda or "none",
                "cudnn": _cudnn_version(), "build": build_id(), "selection": SELECTION_VERSION}
    return {"device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "cudnn": "n/a", "build": build_id(), "selection": SELECTION_VERSION}
