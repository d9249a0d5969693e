"""``kernels: auto`` as a measured choice: numerics first, then time, per op and case.

For each ``Case`` (op, dtype, dropout on/off, the run's batch x seq and model width) every
candidate of ``candidates.py`` is run on the device:

1. **Numerics** (dropout off): the forward output and the gradient of every input, on inputs
   drawn for the case, against the fp32 math reference (``reference.py``'s ``*_math`` twins) on
   the same rounded inputs. A candidate passes when, for every tensor, its error is at most
   twice the baseline's own error in the same dtype plus a floor (``FLOORS``), as in
   ``tests/ops``. Error: max |a - e| / max(max |e|, 1e-2). Attention outputs are compared at
   real query positions (padded positions are never read by the model). With dropout the
   candidate must also apply it (the output changes) and stay finite, forward and backward.
2. **Time**: forward + backward with the case's dropout, after a warm-up, as the median of
   ``repeats`` timings (CUDA events on a GPU), each over enough calls to last ~1 ms.
3. **Choice**: the fastest candidate that passed, if it beats the baseline (what
   ``kernels: reference`` runs) by at least ``MIN_GAIN``; else the baseline. These timings
   make the choice and are not evidence for it: whole training steps with ``auto`` against
   ``reference`` are timed afresh, interleaved and repeated, by ``bertdist bench``
   (benchmarks/acceptance.py).

A candidate that fails numerics or raises is disabled for that case with a warning naming
the op, the error and the bound. Decisions are cached per environment (device name, torch,
our build: ``decision_cache.py``) and logged once as a table. On CUDA the measurement runs in
a child process (``isolate``): a kernel that corrupts the CUDA context or kills the process
costs only that candidate, which is excluded, and the measurement is repeated without it.

Ranks: ``agree_plan`` decides on rank 0 and broadcasts the plan, so every rank runs the same
kernels whatever its batch looks like. Decisions are made up front, for the shapes the run's
config implies (``Workload``), never lazily inside a forward, where ranks see different
padded lengths. At call time an op picks by dtype and by whether dropout is active, both the
same on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch

from bertdist.device_profile import DeviceProfile, for_device_type
from bertdist.ops import reference
from bertdist.ops.candidates import BASELINE, OPS, Candidate, Case, candidates_for

SELECTION_VERSION = 1
# Additive error floors per dtype (tests/ops: 1e-6 for bf16/fp16; fp32 kernels match to 1e-5).
FLOORS = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 1e-6, "float16": 1e-6}
SCALE_FLOOR = 1e-2  # a tensor that is ~0 in exact arithmetic is judged by absolute error
MIN_GAIN = 0.03  # a candidate must be this much faster than the baseline to replace it
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT_SEQ_PROB = 0.1  # BERT's create_pretraining_data: a tenth of the rows are short


# ---------------------------------------------------------------- what a run will call


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shapes and dtypes a run's config implies. ``dtypes``: the compute dtypes of the
    model (bf16 under DeepSpeed bf16); ``autocast``: the model runs under torch.autocast, where
    the layer-norm ops run in fp32 (torch's CUDA policy, and our fused ops register the same).
    ``unpad``: which attention op the model calls (None: decide both)."""

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
    def for_model(cls, cfg, *, batch: int, seq: int, precision: str = "fp32", autocast: bool = False) -> "Workload":
        """From a ``BertConfig`` and the run's micro batch, sequence length and precision."""
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
        return cls(batch=batch, seq=min(seq, cfg.max_position_embeddings), hidden=cfg.hidden_size,
                   heads=cfg.num_attention_heads, dtypes=(dtype,), hidden_dropout=cfg.hidden_dropout_prob,
                   attention_dropout=cfg.attention_probs_dropout_prob, eps=cfg.layer_norm_eps, unpad=cfg.unpad,
                   autocast=autocast and dtype != "float32")

    def cases(self, device_type: str) -> list[Case]:
        out: list[Case] = []
        shape = dict(device_type=device_type, batch=self.batch, seq=self.seq, hidden=self.hidden, heads=self.heads,
                     eps=self.eps)
        attention_ops = {None: ("attention", "varlen_attention"), False: ("attention",), True: ("varlen_attention",)}
        for dtype in self.dtypes:
            norm = "float32" if self.autocast else dtype
            out.append(Case("layer_norm", norm, False, **shape))
            for p in sorted({self.hidden_dropout, 0.0}, reverse=True):
                out.append(Case("bias_dropout_add_layer_norm", norm, p > 0, p=p, **shape))
            for op in attention_ops[self.unpad]:
                for p in sorted({self.attention_dropout, 0.0}, reverse=True):
                    out.append(Case(op, dtype, p > 0, p=p, **shape))
        seen, unique = set(), []
        for c in out:
            if c.key not in seen and c.op in self.ops:
                seen.add(c.key)
                unique.append(c)
        return unique


# ---------------------------------------------------------------- results


@dataclasses.dataclass
class Measurement:
    name: str
    family: str
    status: str  # "passed" | "failed" | "error" | "unsupported"
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
    origin: str = "measured"  # "measured" | "cache" | "fallback"

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
    lines = [f"kernels: auto on {environment.get('device')} (torch {environment.get('torch')}, "
             f"build {environment.get('build')}){': ' + note if note else ''}",
             f"  {'op':<28} {'dtype':<9} {'dropout':<8} {'shape':<40} {'candidate':<22} {'error':>9} {'bound':>9} "
             f"{'ms':>9}  result"]
    for d in decisions:
        c = d.case
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
                result += f" [{d.origin}]"
            lines.append(f"  {cols[0]:<28} {cols[1]:<9} {cols[2]:<8} {cols[3]:<40} {m.name:<22} {err:>9} {bound:>9} "
                         f"{ms:>9}  {result}")
    return "\n".join(lines)


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


# ---------------------------------------------------------------- problems


def case_lengths(case: Case) -> torch.Tensor:
    """Row lengths like BERT's pretraining data: most rows full, some a little short, a tenth
    short (uniform in [2, seq]); the first row full so that max_seqlen == seq."""
    g = torch.Generator().manual_seed(case.lengths_seed)
    n, s = case.batch, case.seq
    u = torch.rand(n, generator=g)
    short = torch.randint(min(2, s), s + 1, (n,), generator=g)
    gap = torch.randint(1, max(2, s // 8 + 1), (n,), generator=g)
    nearly = torch.where(torch.rand(n, generator=g) < 0.9, torch.full((n,), s), (s - gap).clamp(min=1))
    lengths = torch.where(u < SHORT_SEQ_PROB, short, nearly)
    lengths[0] = s
    return lengths


@dataclasses.dataclass
class Problem:
    """Inputs of one case, as fp32 masters on the device; ``call`` runs a candidate on them."""

    case: Case
    masters: dict[str, torch.Tensor]  # differentiable inputs (fp32)
    extra: dict  # mask, cu_seqlens, max_seqlen
    out_mask: torch.Tensor | None  # [B, 1, S, 1] bool: outputs compared at real queries only
    grad_out: torch.Tensor  # fp32

    def leaves(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype).detach().requires_grad_(True) for k, v in self.masters.items()}

    def call(self, fn: Callable, leaves: dict, *, dropout: bool, bias_in_kernel: bool = True) -> torch.Tensor:
        c, e = self.case, self.extra
        p = c.p if dropout else 0.0
        if c.op == "layer_norm":
            return fn(leaves["x"], leaves["weight"], leaves["bias"], c.eps)
        if c.op == "bias_dropout_add_layer_norm":
            # Kernels that do not take the bias get none: the model adds it in the GEMM (free in cuBLAS).
            bias = leaves["dense_bias"] if bias_in_kernel else None
            return fn(leaves["x"], bias, leaves["residual"], leaves["weight"], leaves["ln_bias"], p=p, training=dropout, eps=c.eps)
        if c.op == "attention":
            qkv = leaves["qkv"].permute(2, 0, 3, 1, 4)  # [3, B, H, S, D] views, as the model makes them
            return fn(qkv[0], qkv[1], qkv[2], e["mask"], dropout_p=p, training=dropout)
        q, k, v = leaves["qkv"].unbind(1)  # [T, H, D] views of [T, 3, H, D]
        return fn(q, k, v, e["cu_seqlens"], e["max_seqlen"], dropout_p=p, training=dropout)

    def run(self, fn: Callable, dtype: torch.dtype, *, dropout: bool = False, bias_in_kernel: bool = True,
            masters_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Output and input gradients of one call (fp32 copies), keyed "out", "d<input>"."""
        leaves = self.leaves(dtype)
        if masters_dtype is not None:  # the oracle: inputs rounded to the case dtype, computed wider
            leaves = {k: v.detach().to(masters_dtype).requires_grad_(True) for k, v in leaves.items()}
        out = self.call(fn, leaves, dropout=dropout, bias_in_kernel=bias_in_kernel)
        go = self.grad_out.to(out.dtype)
        if self.out_mask is not None:
            go = go * self.out_mask
        names = list(leaves)
        grads = torch.autograd.grad(out, [leaves[n] for n in names], go, allow_unused=True)
        res = {"out": (out * self.out_mask if self.out_mask is not None else out).detach().float()}
        for n, g in zip(names, grads):
            res[f"d{n}"] = torch.zeros_like(leaves[n], dtype=torch.float32) if g is None else g.float()
        return res


def make_problem(case: Case, device: torch.device) -> Problem:
    g = torch.Generator().manual_seed(1234 + case.lengths_seed)
    rows, h = case.batch * case.seq, case.hidden

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    lengths = case_lengths(case)
    if case.op in ("layer_norm", "bias_dropout_add_layer_norm"):
        masters = {"x": randn(rows, h), "weight": 1 + randn(h, scale=0.1), "bias": randn(h, scale=0.1)}
        if case.op == "bias_dropout_add_layer_norm":
            masters = {"x": masters["x"], "dense_bias": randn(h, scale=0.1), "residual": randn(rows, h),
                       "weight": masters["weight"], "ln_bias": masters["bias"]}
        return Problem(case, masters, {}, None, randn(rows, h))
    b, s, heads, d = case.batch, case.seq, case.heads, case.head_dim
    mask = (torch.arange(s)[None, :] < lengths[:, None]).to(device)
    if case.op == "attention":
        masters = {"qkv": randn(b, s, 3, heads, d)}
        return Problem(case, masters, {"mask": mask}, mask[:, None, :, None], randn(b, heads, s, d))
    total = int(lengths.sum())
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(device=device, dtype=torch.int32)
    masters = {"qkv": randn(total, 3, heads, d)}
    return Problem(case, masters, {"cu_seqlens": cu, "max_seqlen": int(lengths.max())}, None, randn(total, heads, d))


def _oracle(op: str) -> Callable:
    if op == "layer_norm":
        return reference.reference_layer_norm_math
    if op == "bias_dropout_add_layer_norm":
        def bdaln_math(x, bias, residual, weight, ln_bias, *, p, training, eps):
            h = x.float() + (0 if bias is None else bias.float())
            return reference.reference_layer_norm_math(residual.float() + h, weight, ln_bias, eps)
        return bdaln_math
    if op == "attention":
        return reference.reference_attention_math
    return reference.reference_varlen_attention


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item() / max(e.abs().max().item(), SCALE_FLOOR)


# ---------------------------------------------------------------- timing


def time_call(call: Callable[[], None], device: torch.device, *, warmup: int = 3, repeats: int = 7,
              target_ms: float = 1.0) -> list[float]:
    """Milliseconds per call, ``repeats`` samples, each averaged over enough calls to last
    ``target_ms`` (CUDA events on a GPU, perf_counter elsewhere), after ``warmup`` calls."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize(device)
    inner = int(min(50, max(1, math.ceil(target_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))))
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t = time.perf_counter()
            for _ in range(inner):
                call()
            samples.append((time.perf_counter() - t) * 1e3 / inner)
    return samples


Timer = Callable[[Candidate, Case, Callable[[], None], torch.device], list[float]]


def default_timer(candidate: Candidate, case: Case, call: Callable[[], None], device: torch.device) -> list[float]:
    return time_call(call, device)


# ---------------------------------------------------------------- one case


class DeviceUnusable(RuntimeError):
    """A candidate left the device unusable (a sticky CUDA error): nothing more can run here."""

    def __init__(self, candidate: str, error: str):
        super().__init__(f"{candidate}: {error}")
        self.candidate, self.error = candidate, error


def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        (torch.ones(1, device=device) + 1).item()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def decide_case(case: Case, candidates: list[Candidate], device: torch.device, *, timer: Timer = default_timer,
                on_start: Callable[[Candidate], None] | None = None, profile: DeviceProfile | None = None) -> Decision:
    """Measure every candidate of ``case`` (the baseline first) on ``device`` (described by
    ``profile``; default: this machine's) and choose."""
    if candidates[0].name != BASELINE:
        raise ValueError(f"the first candidate must be the baseline {BASELINE!r}, got {candidates[0].name!r}")
    dtype = DTYPES[case.dtype]
    problem = make_problem(case, device)
    oracle = problem.run(_oracle(case.op), dtype, masters_dtype=torch.float32)
    floor = FLOORS[case.dtype]
    base_err: dict[str, float] | None = None
    results: list[Measurement] = []
    for cand in candidates:
        if on_start is not None:
            on_start(cand)
        m = Measurement(cand.name, cand.family, "passed")
        results.append(m)
        why = cand.unsupported(case, profile)
        if why:
            m.status, m.reason = "unsupported", why
            continue
        try:
            fn = cand.load()
            got = problem.run(fn, dtype)
            errs = {k: rel_err(v, oracle[k]) for k, v in got.items()}
            if base_err is None:  # the baseline: its own error sets the bounds
                base_err = errs
            worst = max(errs, key=lambda k: errs[k] / (2 * base_err[k] + floor))
            m.error, m.bound, m.tensor = errs[worst], 2 * base_err[worst] + floor, worst
            if not all(math.isfinite(v) for v in errs.values()) or m.error > m.bound:
                m.status = "failed"
                m.reason = (f"error {m.error:.3e} on {worst} > bound {m.bound:.3e} (2 x torch's own "
                            f"{base_err[worst]:.3e} + {floor:g})")
                continue
            if case.dropout:
                bad = _dropout_problem(problem, fn, dtype, got["out"])
                if bad:
                    m.status, m.reason = "failed", bad
                    continue
            leaves = problem.leaves(dtype)
            go = problem.grad_out.to(dtype)

            def step(fn=fn, leaves=leaves, go=go, bik=cand.bias_in_kernel):
                out = problem.call(fn, leaves, dropout=case.dropout, bias_in_kernel=bik)
                torch.autograd.grad(out, list(leaves.values()), go.to(out.dtype), allow_unused=True)

            samples = timer(cand, case, step, device)
            m.ms, m.ms_range = statistics.median(samples), (min(samples), max(samples))
        except Exception as e:  # noqa: BLE001 - a failing candidate is disabled, never fatal
            m.status, m.reason = "error", _first_line(e)
            if not _device_ok(device):
                raise DeviceUnusable(cand.name, m.reason) from e
            if cand.name == BASELINE:
                raise RuntimeError(f"kernels=auto: the torch-native baseline failed on {case.key}: {m.reason}") from e
    choice = choose(results)
    for m in results:
        if m.status in ("failed", "error"):
            warnings.warn(f"kernels=auto: {case.op} candidate {m.name!r} disabled for {case.dtype}"
                          f"{' with dropout' if case.dropout else ''} on {device.type}: {m.reason}",
                          RuntimeWarning, stacklevel=2)
    return Decision(case, choice, results, [c.name for c in candidates])


# The dropout check: a keep rate outside p +- DROPOUT_SIGMAS binomial standard deviations fails
# (a correct kernel fails about once in 10^9 checks); the forward and backward must use one mask,
# judged against the fp32 math with that mask within DROPOUT_TOL (a different mask changes
# whole elements: errors of order 1).
DROPOUT_SIGMAS = 6.0
DROPOUT_TOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 4e-2, "float16": 5e-3}


def _dropout_problem(problem: Problem, fn, dtype, out_plain: torch.Tensor) -> str | None:
    """With the case's dropout the output must change (dropout applied) and stay finite, the
    fraction dropped must be p (a binomial bound), and the backward must regenerate the
    forward's mask."""
    got = problem.run(fn, dtype, dropout=True)
    if not all(bool(torch.isfinite(v).all()) for v in got.values()):
        return "non-finite output or gradient with dropout"
    changed = (got["out"] != out_plain).float().mean().item()
    if changed == 0.0:
        return f"dropout p={problem.case.p:g} changed no output: dropout not applied"
    if problem.case.op == "bias_dropout_add_layer_norm":
        return _bdaln_mask_problem(problem, fn, dtype)
    if problem.case.op in ("attention", "varlen_attention"):
        return _attention_mask_problem(problem.case, fn, dtype, problem.grad_out.device)
    return None


def keep_rate_problem(n: int, dropped: int, p: float) -> str | None:
    """Why ``dropped`` of ``n`` elements is not a binomial(n, p) count, or None."""
    if n == 0:
        return None
    sigma = math.sqrt(n * p * (1 - p))
    if abs(dropped - n * p) > DROPOUT_SIGMAS * sigma + 1:
        return (f"dropout p={p:g} dropped {dropped} of {n} elements ({dropped / n:.2%}); a binomial({n}, {p:g}) "
                f"count lies within {n * p:.0f} +- {DROPOUT_SIGMAS:g} x {sigma:.1f}")
    return None


def _mask_mismatch(got: dict, ref: dict, dtype: str, which: str) -> str | None:
    tol = DROPOUT_TOL[dtype]
    errs = {k: rel_err(got[k], ref[k]) for k in got}
    worst = max(errs, key=errs.get)
    if not errs[worst] <= tol:
        return (f"{which}: error {errs[worst]:.3e} on {worst} > {tol:g} against the fp32 math with that mask "
                "(the forward and backward do not use one dropout mask)")
    return None


def _bdaln_mask_problem(problem: Problem, fn, dtype) -> str | None:
    """The backward's mask is where d(x) is exactly 0; the forward output must be the one that mask gives."""
    case = problem.case
    got = problem.run(fn, dtype, dropout=True)
    keep = got["dx"] != 0
    bad = keep_rate_problem(keep.numel(), int((~keep).sum()), case.p)
    if bad:
        return bad

    def with_mask(x, bias, residual, weight, ln_bias, *, p, training, eps):
        h = (x if bias is None else x + bias) * keep / (1 - p)
        return reference.reference_layer_norm_math(residual + h, weight, ln_bias, eps)

    ref = problem.run(with_mask, DTYPES[case.dtype], dropout=True, masters_dtype=torch.float32)
    return _mask_mismatch(got, ref, case.dtype, "the forward output is not the one the backward's mask gives")


def _attention_probe(case: Case, device: torch.device) -> tuple[Problem, torch.Tensor, torch.Tensor]:
    """A problem whose output shows the dropped attention probabilities: sequences of at most
    head_dim tokens, v[key j] = e_j, so out[query i][j] = keep[i, j] * P[i, j] / (1 - p). Also
    the [B, S] key mask and, for varlen, each packed token's flat padded position."""
    seq = min(case.seq, case.head_dim)
    probe = make_problem(dataclasses.replace(case, seq=seq), device)
    qkv = probe.masters["qkv"]
    if case.op == "attention":  # [B, S, 3, H, D]
        qkv[:, :, :2] *= 0.5  # flatter probabilities: every kept one well above zero in fp16
        v = qkv[:, :, 2]
        v.zero_()
        j = torch.arange(seq, device=device)
        v[:, j, :, j] = 1.0
        return probe, probe.extra["mask"], None
    from bertdist.ops import torch_native

    cu = probe.extra["cu_seqlens"]
    total = qkv.shape[0]
    index = torch_native.packed_index(cu, total, seq)  # [T] -> b * seq + position
    qkv[:, :2] *= 0.5
    v = qkv[:, 2]  # [T, H, D]
    v.zero_()
    v[torch.arange(total, device=device), :, index % seq] = 1.0
    return probe, torch_native.lengths_mask(cu, seq), index


def _attention_mask_problem(case: Case, fn, dtype, device: torch.device) -> str | None:
    """The forward's mask is read from the probe's output; the gradients must be the ones that mask gives."""
    from bertdist.ops import torch_native

    probe, key_mask, index = _attention_probe(case, device)
    got = probe.run(fn, dtype, dropout=True)
    b, seq = key_mask.shape
    out = got["out"]
    if index is not None:  # packed [T, H, D] -> [B, H, S, D]
        out = torch_native.repad(out, index, b, seq)
    probs = out[..., :seq]  # [B, H, S(query), S(key)]
    real = key_mask[:, None, :, None] & key_mask[:, None, None, :]
    keep = probs != 0
    bad = keep_rate_problem(int(real.expand_as(probs).sum()), int((real & ~keep).sum()), case.p)
    if bad:
        return bad
    scale = 1.0 / math.sqrt(case.head_dim)

    def padded_with_mask(q, k, v, kpm, *, dropout_p, training, scale=scale):
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~kpm[:, None, None, :], float("-inf"))
        return (torch.softmax(scores, dim=-1) * keep / (1 - dropout_p)) @ v

    def varlen_with_mask(q, k, v, cu_seqlens, max_seqlen, *, dropout_p, training):
        padded = [torch_native.repad(t, index, b, seq) for t in (q, k, v)]
        return torch_native.unpad(padded_with_mask(*padded, key_mask, dropout_p=dropout_p, training=training), index)

    ref = probe.run(padded_with_mask if index is None else varlen_with_mask, DTYPES[case.dtype], dropout=True,
                    masters_dtype=torch.float32)
    return _mask_mismatch(got, ref, case.dtype, "the gradients are not the ones the forward's mask gives")


def choose(results: list[Measurement]) -> str:
    """The fastest passing candidate if it beats the baseline by MIN_GAIN, else the baseline."""
    base = results[0]
    timed = [m for m in results if m.status == "passed" and m.ms is not None]
    if base.ms is None or not timed:
        return base.name
    best = min(timed, key=lambda m: m.ms)
    return best.name if best.ms < base.ms * (1 - MIN_GAIN) else base.name


# ---------------------------------------------------------------- many cases, isolated or not


def measure(cases: list[tuple[Case, list[Candidate]]], device: torch.device, *, timer: Timer = default_timer,
            on_start: Callable[[Case, Candidate], None] | None = None,
            on_done: Callable[[Decision], None] | None = None, profile: DeviceProfile | None = None) -> list[Decision]:
    out = []
    for case, cands in cases:
        d = decide_case(case, cands, device, timer=timer, profile=profile,
                        on_start=(lambda c, case=case: on_start(case, c)) if on_start else None)
        out.append(d)
        if on_done is not None:
            on_done(d)
    return out


def _child_main(spec_path: str, out_path: str) -> int:
    """The isolated measurement: cases from ``spec_path``; a progress/result JSON line per event to ``out_path``."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    p = spec.get("profile")
    profile = DeviceProfile(**{**p, "capability": tuple(p["capability"]) if p["capability"] else None}) if p else None
    cases = [(Case(**c["case"]), [Candidate.from_dict(x) for x in c["candidates"]]) for c in spec["cases"]]
    with open(out_path, "a", buffering=1) as f:
        def emit(obj):
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

        try:
            measure(cases, device, on_start=lambda case, c: emit({"start": case.key, "candidate": c.name}),
                    on_done=lambda d: emit({"decision": d.to_dict()}), profile=profile)
        except DeviceUnusable as e:
            emit({"unusable": e.candidate, "error": e.error})
            return 3
    return 0


def measure_isolated(cases: list[tuple[Case, list[Candidate]]], device: torch.device, *,
                     timeout_s: float = 900.0, profile: DeviceProfile | None = None) -> list[Decision]:
    """``measure`` in child processes: a candidate that kills the child or the CUDA context is
    recorded as an error and excluded, and the remaining cases are measured again without it."""
    done: dict[str, Decision] = {}
    excluded: dict[str, dict[str, str]] = {}  # case key -> candidate -> reason
    for _attempt in range(1 + sum(len(c) for _, c in cases)):
        todo = [(case, [c for c in cands if c.name not in excluded.get(case.key, {})])
                for case, cands in cases if case.key not in done]
        if not todo:
            break
        with tempfile.TemporaryDirectory(prefix="bertdist_select_") as tmp:
            spec, out = Path(tmp) / "spec.json", Path(tmp) / "events.jsonl"
            spec.write_text(json.dumps({"device": str(device), "sys_path": sys.path,
                                        "profile": profile.to_dict() if profile else None, "cases": [
                {"case": dataclasses.asdict(case), "candidates": [c.to_dict() for c in cands]} for case, cands in todo]}))
            cmd = [sys.executable, "-c", "import sys; from bertdist.ops.selection import _child_main; "
                   "sys.exit(_child_main(sys.argv[1], sys.argv[2]))", str(spec), str(out)]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
                rc, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1][:200]
            except subprocess.TimeoutExpired:
                rc, tail = -1, f"timed out after {timeout_s:.0f} s"
            last_start, unusable = None, None
            for line in (out.read_text().splitlines() if out.exists() else []):
                ev = json.loads(line)
                if "start" in ev:
                    last_start = (ev["start"], ev["candidate"])
                elif "decision" in ev:
                    d = Decision.from_dict(ev["decision"], "measured")
                    done[d.case.key] = d
                    last_start = None
                elif "unusable" in ev:
                    unusable = ev
            if rc == 0:
                continue
            if last_start is None:
                raise RuntimeError(f"kernel measurement process failed (exit {rc}) before any candidate ran: {tail}")
            key, name = last_start
            if name == BASELINE:
                raise RuntimeError(f"kernel measurement: the torch-native baseline failed on {key} (exit {rc}): {tail}")
            why = (f"left the CUDA device unusable: {unusable['error']}" if unusable
                   else f"killed the measuring process (exit {rc}): {tail}")
            excluded.setdefault(key, {})[name] = why
            warnings.warn(f"kernels=auto: candidate {name!r} {why}; measuring again without it", RuntimeWarning,
                          stacklevel=2)
    decisions = []
    for case, cands in cases:
        d = done[case.key]
        for name, why in excluded.get(case.key, {}).items():  # crashed candidates appear in the table too
            fam = next(c.family for c in cands if c.name == name)
            d.measurements.append(Measurement(name, fam, "error", why))
        d.candidates = [c.name for c in cands]
        decisions.append(d)
    return decisions


# ---------------------------------------------------------------- plans


# (cases with their candidates, device, profile) -> one Decision per case: how ``decide`` measures.
Measurer = Callable[[list[tuple[Case, list[Candidate]]], torch.device, DeviceProfile], list[Decision]]


def survey(workload: Workload, profile: DeviceProfile, *, extra: Iterable[Candidate] = (),
           include_test_only: bool = False) -> list[tuple[Case, list[tuple[Candidate, str | None]]]]:
    """The cases ``auto`` decides for ``workload`` on ``profile``, each with its candidates and
    why one cannot run there (None: it will be measured). Measures nothing."""
    extra = list(extra)
    return [(case, [(c, c.unsupported(case, profile))
                    for c in candidates_for(case.op, profile.type, include_test_only=include_test_only, extra=extra)])
            for case in workload.cases(profile.type)]


def _warn_without_fused_cuda(profile: DeviceProfile, cands: Iterable[Candidate]) -> None:
    """On CUDA, one warning when our fused kernels cannot take part (e.g. a build without CUDA kernels)."""
    if profile.type != "cuda" or not any(c.family == "fused" for c in cands):
        return
    from bertdist.ops import fused

    ok, why = fused.availability("layer_norm", profile)
    if not ok:
        warnings.warn(f"kernels=auto: bertdist's fused CUDA kernels cannot run on {profile.name}: {why}; "
                      "choosing among torch's kernels", RuntimeWarning, stacklevel=3)


def decide(workload: Workload, device: torch.device, *, cache=None, timer: Timer | None = None,
           isolate: bool | None = None, extra: Iterable[Candidate] = (), include_test_only: bool = False,
           profile: DeviceProfile | None = None, measurer: Measurer | None = None) -> KernelPlan:
    """The plan for ``workload`` on ``device`` (described by ``profile``; default: this
    machine's): cached decisions where the cache holds them for this environment and the same
    candidates, measured ones otherwise (then cached). ``measurer`` replaces the measurement
    (default: in child processes on CUDA, ``isolate``; in this process with ``timer`` otherwise)."""
    profile = profile or for_device_type(device.type)
    if profile.type != device.type:
        raise ValueError(f"device {device} is {device.type} but the profile {profile.name!r} is {profile.type}")
    env = environment(device, profile)
    extra = list(extra)
    wanted = [(case, candidates_for(case.op, device.type, include_test_only=include_test_only, extra=extra))
              for case in workload.cases(device.type)]
    _warn_without_fused_cuda(profile, (c for _, cands in wanted for c in cands))
    cached = cache.load(env) if cache is not None else {}
    decisions: dict[str, Decision] = {}
    todo = []
    for case, cands in wanted:
        hit = cached.get(case.key)
        if hit is not None and hit["candidates"] == [c.name for c in cands]:
            decisions[case.key] = Decision.from_dict(hit, "cache")
        else:
            todo.append((case, cands))
    if todo:
        isolate = device.type == "cuda" if isolate is None else isolate
        if measurer is not None:
            if timer is not None:
                raise ValueError("give a measurer or a timer, not both")
            measured = measurer(todo, device, profile)
        elif timer is not None and isolate:
            raise ValueError("a custom timer runs in this process only (isolate=False)")
        else:
            measured = (measure_isolated(todo, device, profile=profile) if isolate else
                        measure(todo, device, timer=timer or default_timer, profile=profile))
        for d in measured:
            decisions[d.case.key] = d
        missing = [case.key for case, _ in todo if case.key not in decisions]
        if missing:
            raise RuntimeError(f"kernel measurement decided {len(todo) - len(missing)} of {len(todo)} cases; "
                               f"undecided: {'; '.join(missing)}")
        if cache is not None:
            cache.store(env, {d.case.key: d.to_dict() for d in measured})
    chosen: dict[str, dict] = {}
    for case, cands in wanted:
        d = decisions[case.key]
        c = next(c for c in cands if c.name == d.choice)
        chosen.setdefault(case.op, {})[c.name] = c.to_dict()
    origin = "measured" if todo and len(todo) == len(wanted) else ("cached" if not todo else "partly cached")
    where = f" ({cache.path})" if cache is not None else ""
    return KernelPlan(env, {case.key: decisions[case.key] for case, _ in wanted}, chosen, f"{origin}{where}")


def agree_plan(make_plan: Callable[[], KernelPlan], device: torch.device) -> KernelPlan:
    """Rank 0 runs ``make_plan`` and broadcasts the result: every rank gets the same plan (a
    failure on rank 0 is broadcast too and raised on every rank, so no rank waits forever)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return make_plan()
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = {"plan": make_plan().to_dict()}
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = {"error": _first_line(e)}
    dist.broadcast_object_list(payload, src=0, device=device if dist.get_backend() == "nccl" else None)
    if "error" in payload[0]:
        raise RuntimeError(f"kernels=auto: rank 0 could not decide the kernels: {payload[0]['error']}")
    return KernelPlan.from_dict(payload[0]["plan"])


_logged: set[str] = set()


def log_once(plan: KernelPlan, write: Callable[[str], None] | None = None) -> None:
    """Print the plan's table once per process (``write``: a logger's message function)."""
    text = plan.table()
    if text in _logged:
        return
    _logged.add(text)
    (write or (lambda s: print(s, file=sys.stderr, flush=True)))(text)


def plan_copy(plan: KernelPlan, run_dir: str | os.PathLike) -> Path:
    """Write the plan into the run directory (``kernel_decisions.json``) and return the path."""
    path = Path(run_dir) / "kernel_decisions.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    return path


__all__ = ["OPS", "Workload", "Measurement", "Decision", "KernelPlan", "Measurer", "decide", "decide_case", "survey",
           "agree_plan", "measure", "measure_isolated", "log_once", "plan_copy", "environment", "choose", "MIN_GAIN"]
