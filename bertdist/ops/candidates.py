"""The registry of kernel candidates that ``kernels: auto`` chooses among, per op.

A ``Candidate`` names an implementation of one op by import path (``"module:attr"``), so a
fresh process (the isolated measurement, a test) can load it, plus an optional support check
(``"module:attr"``, ``check(case, profile) -> reason or None``; ``profile``: the
``DeviceProfile`` the case runs on, so the CUDA branch is decided for a named device without one). ``Case`` is one decision: an op, a
dtype, dropout on or off, and the shape it is measured at.

Every op's first candidate is its *baseline*: what ``kernels: reference`` runs on that device
type (``baseline_target``). It is always measured and wins unless another candidate passes
the numerics check and is measurably faster, so ``auto`` cannot be slower than ``reference``.

Built in (``BUILTIN``): torch's ops (``torch_native``), our fused kernels (``fused``) and, for
the layer-norm family on CUDA, Inductor's fused kernel compiled from our twin (``inductor``).

ModernBERT's windowed attention (``WINDOW_OPS``, ``bertdist/ops/windowed_attention.py``) is
decided the same way, among the ``attention_backend`` names: its baseline is the reference
twin (``reference``), which sets the error bounds and is chosen only when nothing else passes
(``attention_choice.py``).
Others register with ``register_candidate`` (e.g. emulated CUDA kernels, ``test_only=True``:
tests only, never ``kernels: auto`` in a run). Registration order is measurement order.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from bertdist.device_profile import DeviceProfile

OPS = ("layer_norm", "bias_dropout_add_layer_norm", "attention", "varlen_attention")
BASELINE = "torch"
# ModernBERT's attention with an optional sliding window, padded and packed: one decision picks
# its ``attention_backend``, so the candidates carry the backend names and the baseline is the oracle.
WINDOW_OPS = ("window_attention", "varlen_window_attention")
WINDOW_BASELINE = "reference"
ALL_OPS = OPS + WINDOW_OPS


def baseline_name(op: str) -> str:
    """The name of ``op``'s first candidate: torch's op, or for the windowed ops the reference twin."""
    return WINDOW_BASELINE if op in WINDOW_OPS else BASELINE


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """The encoder layer a case's candidates are timed in (``layer_timing.py``), as the run builds
    it: FFN width, the layer's compute dtype (autocast's under ``autocast``, else the weights'),
    the dropout of the ops not being decided, padded or unpadded attention, eager or compiled."""

    intermediate: int
    dtype: str
    autocast: bool
    hidden_dropout: float
    attention_dropout: float
    unpad: bool = False
    compiled: bool = False

    @property
    def key(self) -> str:
        return (f"layer i{self.intermediate} {self.dtype}{' autocast' if self.autocast else ''} "
                f"hd{self.hidden_dropout:g} ad{self.attention_dropout:g}{' unpad' if self.unpad else ''} "
                f"{'compiled' if self.compiled else 'eager'}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One decision: ``op`` at ``dtype`` (torch dtype name), with dropout or without
    (``dropout``: a training call with p > 0), measured at batch x seq (lengths drawn from
    ``lengths_seed``) with the model's hidden size and heads. The windowed ops also name the
    window (``half_window``; None: a global layer) and whether the run needs gradients
    (``backward``; False: inference, gated and timed on the forward alone)."""

    op: str
    dtype: str
    dropout: bool
    device_type: str
    batch: int
    seq: int
    hidden: int
    heads: int
    p: float = 0.1
    eps: float = 1e-12
    lengths_seed: int = 0
    half_window: int | None = None
    backward: bool = True
    layer: LayerContext | None = None  # None: timed as the op alone

    def __post_init__(self) -> None:
        if isinstance(self.layer, dict):  # from JSON (the cache, the isolated measurement)
            object.__setattr__(self, "layer", LayerContext(**self.layer))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def shape(self) -> str:
        if self.op in ("attention", "varlen_attention"):
            return f"batch {self.batch} x seq {self.seq}, {self.heads} heads x {self.head_dim}"
        if self.op in WINDOW_OPS:
            return f"b{self.batch} x s{self.seq}, {self.heads} x {self.head_dim}, {self.window}"
        return f"{self.batch * self.seq} rows x {self.hidden}"

    @property
    def region(self) -> str:
        """What a candidate of this case is timed in (``layer_timing.py``)."""
        if self.layer is None:
            return "the op alone"
        where = "the embeddings' layer norm + dropout" if self.op == "layer_norm" else "one encoder layer"
        return f"{where}, {'compiled' if self.layer.compiled else 'eager'}"

    @property
    def key(self) -> str:
        mode = f"dropout {self.p:g}" if self.dropout else "no dropout"
        key = (f"{self.op} | {self.dtype} | {mode} | b{self.batch} s{self.seq} h{self.hidden} "
               f"n{self.heads} eps{self.eps:g} seed{self.lengths_seed}")
        if self.op in WINDOW_OPS:
            key += f" | {self.window} | {'forward + backward' if self.backward else 'forward only'}"
        return key + (f" | {self.layer.key}" if self.layer is not None else "")

    @property
    def window(self) -> str:
        return "global" if self.half_window is None else f"window +-{self.half_window}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    op: str
    name: str  # unique per op: "torch", "torch:sdpa-cudnn", "fused", ...
    target: str  # "module:attr" of the function (the op's signature in reference.py)
    family: str  # "torch" | "fused" | "emulated" | another label (reports, bias placement)
    check: str | None = None  # "module:attr" of check(case) -> reason it cannot run, or None
    test_only: bool = False
    bias_in_kernel: bool = False  # bias_dropout_add_layer_norm: the dense bias is added inside

    def load(self) -> Callable:
        return _resolve(self.target)

    def unsupported(self, case: Case, profile: "DeviceProfile | None" = None) -> str | None:
        """Why this candidate cannot run ``case`` on ``profile`` (None: it can; default: this machine)."""
        return _resolve(self.check)(case, profile_for(case, profile)) if self.check else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        return cls(**d)


def _resolve(ref: str):
    module, _, attr = ref.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------- support checks (by import path)


def profile_for(case: Case, profile: "DeviceProfile | None" = None) -> "DeviceProfile":
    """``profile``, or this machine's for the case's device type when None."""
    from bertdist.device_profile import for_device_type

    return profile if profile is not None else for_device_type(case.device_type)


def _cuda_only(case: Case, profile: "DeviceProfile | None" = None) -> str | None:
    return None if case.device_type == "cuda" else f"CUDA only (this is {case.device_type})"


def fused_unsupported(case: Case, profile: "DeviceProfile | None" = None) -> str | None:
    from bertdist.ops import fused

    ok, why = fused.availability(case.op, profile_for(case, profile))
    if not ok:
        return why
    if case.device_type == "cuda" and case.op in ("attention", "varlen_attention") and case.head_dim not in (32, 64, 128):
        return f"the CUDA attention kernels take head_dim 32, 64 or 128, not {case.head_dim}"
    if case.dtype == "float64" and case.device_type != "cpu":
        return "float64 runs on CPU only"
    return None


def emulated_unsupported(case: Case, profile: "DeviceProfile | None" = None) -> str | None:
    """The emulated CUDA kernels: CPU tensors, and the CUDA kernels' own limits."""
    from bertdist.ops import emulated

    ok, why = emulated.availability(case.op, case.device_type)
    if not ok:
        return why
    if case.op in ("attention", "varlen_attention") and case.head_dim not in (32, 64, 128):
        return f"the CUDA attention kernels take head_dim 32, 64 or 128, not {case.head_dim}"
    if case.dtype == "float64":
        return "the CUDA kernels take float32, float16 and bfloat16"
    return None


def sdpa_backend_unsupported(case: Case, profile: "DeviceProfile | None" = None) -> str | None:
    return _cuda_only(case)


def varlen_attn_case_unsupported(case: Case, profile: "DeviceProfile | None" = None) -> str | None:
    from bertdist.ops import torch_native

    if case.dropout:
        return "varlen_attn has no dropout (torch hard-codes dropout_p=0)"
    if case.device_type != "cuda":
        return f"varlen_attn needs CUDA, this is {case.device_type}"
    if case.dtype not in ("float16", "bfloat16"):
        return f"varlen_attn takes float16/bfloat16, not {case.dtype}"
    if case.head_dim % 8 or case.head_dim > torch_native.VARLEN_ATTN_MAX_HEAD_DIM:
        return f"varlen_attn needs head_dim a multiple of 8 and <= 256, not {case.head_dim}"
    return None


def flex_unsupported(case: Case, profile: "DeviceProfile | None" = None) -> str | None:
    """torch's FlexAttention (the packed windowed backend ``flex``): no dropout, no CPU backward."""
    import torch

    if case.dropout:
        return f"FlexAttention has no attention dropout (this run trains with p={case.p:g})"
    if case.device_type == "cpu" and case.backward:
        return f"FlexAttention has no backward on CPU (torch {torch.__version__}); training needs one"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no FlexAttention ({e})"
    return None


# ---------------------------------------------------------------- the registry

_NATIVE = "bertdist.ops.torch_native"
_CHECKS = "bertdist.ops.candidates"


# The torch-native function of each op (dispatch.TORCH_NATIVE holds the same ones).
_NATIVE_BASELINES = {"layer_norm": "layer_norm", "bias_dropout_add_layer_norm": "bias_dropout_add_layer_norm",
                     "attention": "sdpa_attention", "varlen_attention": "varlen_attention"}


_WINDOWED = "bertdist.ops.windowed_attention"


def baseline_target(op: str, device_type: str) -> str:
    """What ``kernels: reference`` runs for ``op`` on ``device_type``: torch-native on CUDA; on
    CPU the functions of reference.py (SDPA with an additive mask, the per-sequence varlen loop).
    The windowed ops: their reference twin on every device."""
    if op not in ALL_OPS:
        raise ValueError(f"unknown op {op!r}; ops are {', '.join(ALL_OPS)}")
    if op in WINDOW_OPS:
        return f"{_WINDOWED}:reference_{op}"
    if device_type == "cuda":
        return f"{_NATIVE}:{_NATIVE_BASELINES[op]}"
    return f"bertdist.ops.reference:reference_{op}"


def _builtin() -> list[Candidate]:
    out = []
    for op in OPS:
        if op in ("attention",):
            out += [
                Candidate(op, "torch:sdpa-efficient", f"{_NATIVE}:SDPA_EFFICIENT", "torch", f"{_CHECKS}:sdpa_backend_unsupported"),
                Candidate(op, "torch:sdpa-cudnn", f"{_NATIVE}:SDPA_CUDNN", "torch", f"{_CHECKS}:sdpa_backend_unsupported"),
                Candidate(op, "torch:varlen_attn", f"{_NATIVE}:attention_via_varlen", "torch",
                          f"{_CHECKS}:varlen_attn_case_unsupported"),
            ]
        if op == "varlen_attention":
            out += [
                Candidate(op, "torch:sdpa-repadded", f"{_NATIVE}:varlen_attention_sdpa", "torch"),
                Candidate(op, "torch:varlen_attn", f"{_NATIVE}:varlen_attention_flash", "torch",
                          f"{_CHECKS}:varlen_attn_case_unsupported"),
            ]
        out.append(Candidate(op, "fused", f"bertdist.ops.fused:{op}", "fused", f"{_CHECKS}:fused_unsupported",
                             bias_in_kernel=op == "bias_dropout_add_layer_norm"))
        if op in ("layer_norm", "bias_dropout_add_layer_norm"):  # torch.compile of our twin: Inductor's fused kernel
            out.append(Candidate(op, "inductor", f"bertdist.ops.inductor:{op}", "inductor",
                                 "bertdist.ops.inductor:unsupported", bias_in_kernel=op == "bias_dropout_add_layer_norm"))
        # The CUDA kernels' own code run on the CPU (slow): judged like any other, in tests only.
        out.append(Candidate(op, "emulated", f"bertdist.ops.emulated:{op}", "emulated",
                             f"{_CHECKS}:emulated_unsupported", test_only=True,
                             bias_in_kernel=op == "bias_dropout_add_layer_norm"))
    # The attention_backend names (windowed_attention.py); padded batches take SDPA under flex too.
    out.append(Candidate("window_attention", "sdpa", f"{_WINDOWED}:sdpa_window_attention", "torch"))
    out.append(Candidate("varlen_window_attention", "sdpa", f"{_WINDOWED}:sdpa_varlen_window_attention", "torch"))
    out.append(Candidate("varlen_window_attention", "flex", f"{_WINDOWED}:flex_varlen_window_attention", "torch",
                         f"{_CHECKS}:flex_unsupported"))
    return out


_EXTRA: list[Candidate] = []


def register_candidate(candidate: Candidate) -> None:
    """Add a candidate (replacing one of the same op and name)."""
    if candidate.op not in ALL_OPS:
        raise ValueError(f"unknown op {candidate.op!r}; ops are {', '.join(ALL_OPS)}")
    if candidate.name == baseline_name(candidate.op):
        raise ValueError(f"{candidate.name!r} is the baseline's name and cannot be registered")
    _EXTRA[:] = [c for c in _EXTRA if (c.op, c.name) != (candidate.op, candidate.name)] + [candidate]


def unregister_candidate(op: str, name: str) -> None:
    _EXTRA[:] = [c for c in _EXTRA if (c.op, c.name) != (op, name)]


def candidates_for(op: str, device_type: str, *, include_test_only: bool = False,
                   extra: list[Candidate] = ()) -> list[Candidate]:
    """The baseline first, then the built-in and registered candidates for ``op``."""
    base = Candidate(op, baseline_name(op), baseline_target(op, device_type), "torch")
    rest = [c for c in (*_builtin(), *_EXTRA, *extra) if c.op == op and (include_test_only or not c.test_only)]
    seen, out = set(), [base]
    for c in reversed(rest):  # later registrations replace earlier ones of the same name
        if c.name not in seen:
            seen.add(c.name)
            out.insert(1, c)
    return out
