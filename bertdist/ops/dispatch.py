"""The kernel seam: which implementation of each op the model gets.

The model never imports a kernel directly. It is given (or asks ``resolve_kernels`` once at
construction for) a ``KernelSet`` and calls its four functions. ``mode`` is the config's
``kernels`` value:

- ``reference``: torch's own ops. On CUDA the torch-native fast paths (``torch_native.py``:
  SDPA with a boolean mask, ``varlen_attn`` for unpadded attention where it applies); on CPU
  the functions of ``reference.py``, as before.
- ``fused``: our compiled kernels (``bertdist.ops.fused``) for every op, forced; an error if they
  are not usable, with the reason. A test and comparison mode, not a training choice on GPU:
  our CUDA attention computes in fp32 on the SIMT cores, where torch's SDPA backends use the
  tensor cores in bf16/fp16, and ``fused`` does not measure. It stays forced so that tests and
  benchmarks run our kernels and nothing else; training takes ``auto``, which uses our kernels
  exactly where they measure faster. On CUDA it says so once (a warning).
- ``auto``: on CUDA a measured choice (``selection.py``): per op, dtype and dropout on/off,
  the fastest candidate that passed a numerics check on this device, and torch-native unless
  another candidate is measurably faster in that measurement. Whether whole training steps
  under ``auto`` are slower than under ``reference`` is measured afresh, in interleaved
  repeated runs, by ``bertdist bench`` (benchmarks/acceptance.py). The trainer
  decides on rank 0 for the shapes of its config and passes the agreed ``KernelPlan``
  (``kernels_for_run``); a model built without one decides for ``default_workload`` in a
  single process, and runs torch-native in a multi-process job (ranks would not agree
  otherwise). On CPU ``auto`` keeps torch's CPU ops without measuring: the C++ CPU kernels
  exist to test the binding path and are slower than oneDNN/MKL there (benchmarks/kernels.py);
  tests exercise the measured mechanism on CPU explicitly, with the C++ kernels as candidates.
- ``emulated``: the CUDA kernels' own code, run on CPU tensors by the SIMT emulator
  (``bertdist.ops.emulated``): to test them without a GPU, orders of magnitude slower than
  any other choice; an error, with the reason, if it is not built or the device is not CPU.

``kernel_status()`` reports, per op, whether the fused version is usable and why not, for
``bertdist info``.

Every device decision here takes a ``DeviceProfile`` (``bertdist.device_profile``; default:
``detect()``, this machine's), so the CUDA branch runs, and is tested, for a named GPU on a
machine without one.
"""
from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import TYPE_CHECKING, Callable, Literal

import torch

from bertdist.ops import reference, torch_native

if TYPE_CHECKING:
    from bertdist.device_profile import DeviceProfile

KernelMode = Literal["reference", "fused", "auto", "emulated"]
OP_NAMES = ("layer_norm", "bias_dropout_add_layer_norm", "attention", "varlen_attention")
MEASURED_DEVICE_TYPES = ("cuda",)
# The bias_dropout_add_layer_norm implementations the model hands the dense bias to (``sources``
# names): they add it in their fused pass; torch's ops are faster with it inside the GEMM.
BIAS_IN_KERNEL = ("fused", "emulated", "inductor")


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The functions the model calls, and where each came from."""

    layer_norm: Callable
    bias_dropout_add_layer_norm: Callable
    attention: Callable
    varlen_attention: Callable  # unpadded: packed tokens + cumulative sequence lengths
    sources: dict  # op name -> "reference" | "fused" | "emulated" | the chosen candidate's name under auto
    plan: object = None  # the kernel_plan.KernelPlan behind an auto set


REFERENCE = KernelSet(
    layer_norm=reference.reference_layer_norm,
    bias_dropout_add_layer_norm=reference.reference_bias_dropout_add_layer_norm,
    attention=reference.reference_attention,
    varlen_attention=reference.reference_varlen_attention,
    sources={name: "reference" for name in OP_NAMES},
)

TORCH_NATIVE = KernelSet(
    layer_norm=torch_native.layer_norm,
    bias_dropout_add_layer_norm=torch_native.bias_dropout_add_layer_norm,
    attention=torch_native.sdpa_attention,
    varlen_attention=torch_native.varlen_attention,
    sources={name: "reference" for name in OP_NAMES},
)


def reference_set(device_type: str) -> KernelSet:
    """What ``kernels: reference`` runs on ``device_type``."""
    return TORCH_NATIVE if device_type == "cuda" else REFERENCE


@dataclasses.dataclass(frozen=True)
class OpStatus:
    op: str
    usable: bool
    reason: str


def _fused_module():
    """Import the fused-op module, or return the reason it can't be used."""
    try:
        return importlib.import_module("bertdist.ops.fused"), ""
    except Exception as e:  # ImportError, or the extension failing to load
        return None, f"bertdist.ops.fused unavailable: {type(e).__name__}: {e}"


def kernel_status(device_type: str = "cpu", profile: "DeviceProfile | None" = None) -> list[OpStatus]:
    """Per op: can the fused kernel run on ``device_type`` (on ``profile`` when given), and if not, why."""
    mod, why = _fused_module()
    if mod is None:
        return [OpStatus(op, False, why) for op in OP_NAMES]
    out = []
    for op in OP_NAMES:
        ok, reason = mod.availability(op, profile if profile is not None else device_type)
        out.append(OpStatus(op, ok, reason))
    return out


def _emulated_module():
    """Import the emulated-op module, or return the reason it can't be used."""
    try:
        return importlib.import_module("bertdist.ops.emulated"), ""
    except Exception as e:
        return None, f"bertdist.ops.emulated unavailable: {type(e).__name__}: {e}"


def emulated_status(device_type: str = "cpu") -> list[OpStatus]:
    """Per op: can the emulated CUDA kernel run on ``device_type``, and if not, why."""
    mod, why = _emulated_module()
    if mod is None:
        return [OpStatus(op, False, why) for op in OP_NAMES]
    return [OpStatus(op, *mod.availability(op, device_type)) for op in OP_NAMES]


def _resolve_emulated(device_type: str) -> KernelSet:
    bad = [f"{s.op}: {s.reason}" for s in emulated_status(device_type) if not s.usable]
    if bad:
        raise RuntimeError(f"kernels=emulated requested on {device_type} but: " + "; ".join(bad))
    mod, _ = _emulated_module()
    return KernelSet(**{op: getattr(mod, op) for op in OP_NAMES}, sources={op: "emulated" for op in OP_NAMES})


# ---------------------------------------------------------------- auto: routing by a plan


_NORM_OPS = ("layer_norm", "bias_dropout_add_layer_norm")


def call_dtype(op: str, args: tuple) -> str:
    """The dtype an op call computes in: q's for attention; for the layer norms the promoted
    dtype of x and the residual, and fp32 under autocast (torch's CUDA policy for layer_norm,
    and the one our fused ops register)."""
    x = args[0]
    if op in _NORM_OPS:
        if torch.is_autocast_enabled(x.device.type):
            return "float32"
        if op == "bias_dropout_add_layer_norm":
            return str(torch.promote_types(x.dtype, args[2].dtype)).removeprefix("torch.")
    return str(x.dtype).removeprefix("torch.")


def dropout_active(kwargs: dict) -> bool:
    return bool(kwargs.get("training")) and float(kwargs.get("p", kwargs.get("dropout_p", 0.0)) or 0.0) > 0


class RoutedOp:
    """One op under ``kernels: auto``: the decided candidate per (dtype, dropout active), the
    torch-native op for a call the plan did not decide. Neither key depends on the batch, so
    every rank takes the same route."""

    def __init__(self, op: str, routes: dict[tuple[str, bool], Callable], fallback: Callable, names: dict):
        self.op, self.routes, self.fallback, self.names = op, routes, fallback, names
        self.__name__ = f"auto_{op}"

    def __call__(self, *args, **kwargs):
        return self.routes.get((call_dtype(self.op, args), dropout_active(kwargs)), self.fallback)(*args, **kwargs)

    def __repr__(self) -> str:
        routes = ", ".join(f"{d}{'+dropout' if p else ''}: {n}" for (d, p), n in self.names.items())
        return f"RoutedOp({self.op}: {routes or 'torch-native only'})"


def kernel_set_from_plan(plan, device_type: str = "cuda") -> KernelSet:
    """The KernelSet that runs ``plan``'s choices (a ``kernel_plan.KernelPlan``)."""
    from bertdist.ops.candidates import Candidate

    base = reference_set(device_type)
    funcs, sources = {}, {}
    for op in OP_NAMES:
        routes, names, primary = {}, {}, None
        for d in plan.decisions.values():
            if d.case.op != op:
                continue
            cand = Candidate.from_dict(plan.candidates[op][d.choice])
            routes[(d.case.dtype, d.case.dropout)] = cand.load()
            names[(d.case.dtype, d.case.dropout)] = cand.name
            if primary is None or d.case.dropout:  # the training call (with dropout) names the op
                primary = cand
        funcs[op] = RoutedOp(op, routes, getattr(base, op), names) if routes else getattr(base, op)
        # The name of the training call's choice; the model hands the dense bias to the kernel
        # only when it is ours, "fused" (every kernel also runs correctly without it).
        sources[op] = primary.name if primary is not None else "reference"
    return KernelSet(**funcs, sources=sources, plan=plan)


def default_workload(model_config, device_type: str, profile: "DeviceProfile | None" = None):
    """What a model built without a plan decides for: batch 32 x seq 128 (or its max
    positions), the device's low-precision dtype and fp32, the model's dropout."""
    from bertdist.device_profile import for_device_type
    from bertdist.ops.kernel_plan import Workload

    profile = profile or for_device_type(device_type)
    low = "bfloat16" if profile.type == "cuda" and profile.bf16_supported else "float16"
    return Workload(batch=32, seq=min(128, model_config.max_position_embeddings), hidden=model_config.hidden_size,
                    heads=model_config.num_attention_heads, dtypes=(low, "float32"),
                    hidden_dropout=model_config.hidden_dropout_prob,
                    attention_dropout=model_config.attention_probs_dropout_prob, eps=model_config.layer_norm_eps,
                    unpad=model_config.unpad, intermediate=model_config.intermediate_size)


def _distributed_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def auto_kernels(workload, device: torch.device, *, cache=None, log: Callable[[str], None] | None = None,
                 agree: bool = True, profile: "DeviceProfile | None" = None, measurer=None,
                 budget_s: float | None = None) -> KernelSet:
    """``kernels: auto`` for ``workload`` on ``device`` (described by ``profile``): the agreed,
    measured plan (rank 0 decides and broadcasts), or torch-native with a warning when the
    decision fails. ``measurer``, ``budget_s`` (seconds the measuring may take): see
    ``selection.decide``."""
    from bertdist.ops import selection
    from bertdist.ops.decision_cache import DecisionCache

    cache = DecisionCache() if cache is None else cache

    def make():
        return selection.decide(workload, device, cache=cache or None, profile=profile, measurer=measurer,
                                budget_s=budget_s)

    try:
        plan = selection.agree_plan(make, device) if agree else make()
    except Exception as e:  # noqa: BLE001 - the safe choice is torch's own ops, said loudly
        warnings.warn(f"kernels=auto: could not decide the kernels on {device} ({type(e).__name__}: {e}); "
                      "running torch-native kernels (kernels=reference)", RuntimeWarning, stacklevel=2)
        return reference_set(device.type)
    try:
        kernels = kernel_set_from_plan(plan, device.type)
    except Exception as e:  # noqa: BLE001 - a chosen kernel that does not load: same on every rank
        warnings.warn(f"kernels=auto: a chosen kernel could not be loaded on {device} ({type(e).__name__}: {e}); "
                      "running torch-native kernels (kernels=reference)", RuntimeWarning, stacklevel=2)
        return reference_set(device.type)
    if _rank() == 0:
        selection.log_once(plan, log)
    return kernels


def resolve_kernels(mode: KernelMode, device_type: str = "cpu", *, model_config=None,
                    profile: "DeviceProfile | None" = None) -> KernelSet:
    """The KernelSet for ``mode`` on ``device_type`` (described by ``profile``; default: this
    machine's). ``model_config`` (a BertConfig) lets ``auto`` on CUDA decide for
    ``default_workload``; without it, or in a multi-process job (use the trainer's agreed plan
    there), ``auto`` runs torch-native."""
    if mode == "reference":
        return reference_set(device_type)
    if mode == "emulated":
        return _resolve_emulated(device_type)
    if mode not in ("fused", "auto"):
        raise ValueError(f"kernels must be one of reference|fused|auto|emulated, got {mode!r}")
    if mode == "auto":
        if device_type not in MEASURED_DEVICE_TYPES or model_config is None:
            return reference_set(device_type)  # without loading (or JIT-building) the extension
        if _distributed_world() > 1:
            warnings.warn("kernels=auto in a multi-process job without an agreed plan: torch-native kernels "
                          "(the trainer passes the plan rank 0 decided; see bertdist.ops.kernels_for_run)",
                          RuntimeWarning, stacklevel=2)
            return reference_set(device_type)
        device = torch.device("cuda", torch.cuda.current_device())
        return auto_kernels(default_workload(model_config, device_type, profile), device, agree=False,
                            profile=profile, budget_s=getattr(model_config, "kernels_budget_s", None))
    status = {s.op: s for s in kernel_status(device_type, profile)}
    bad = [f"{s.op}: {s.reason}" for s in status.values() if not s.usable]
    if bad:
        raise RuntimeError(f"kernels=fused requested on {device_type} but: " + "; ".join(bad))
    if device_type == "cuda":
        _warn_fused_is_a_test_mode()
    mod, _ = _fused_module()
    return KernelSet(**{op: getattr(mod, op) for op in OP_NAMES}, sources={op: "fused" for op in OP_NAMES})


_FUSED_NOTE = ("kernels=fused forces bertdist's kernels for every op, attention included: our CUDA attention is fp32 "
               "SIMT without tensor cores (torch's SDPA uses them). fused is a test and comparison mode; for training "
               "use kernels=auto, which takes our kernels where they measure faster")
_fused_warned = False


def _warn_fused_is_a_test_mode() -> None:
    global _fused_warned
    if not _fused_warned:
        _fused_warned = True
        warnings.warn(_FUSED_NOTE, RuntimeWarning, stacklevel=3)


def kernels_for_run(mode: KernelMode, model_config, device: torch.device, *, micro_batch: int, seq: int,
                    precision: str, autocast: bool = False, log: Callable[[str], None] | None = None,
                    run_dir: str | None = None, cache=None, profile: "DeviceProfile | None" = None,
                    measurer=None, compiled: bool = False, budget_s: float | None = None) -> KernelSet:
    """The KernelSet of a training run, the same on every rank. ``auto`` on CUDA: decided on
    rank 0 for this run's micro batch, sequence length and precision, broadcast, logged once,
    and copied to ``run_dir/kernel_decisions.json`` (rank 0). ``profile``: the device
    (default: this machine's); ``measurer``: see ``selection.decide``; ``compiled``: the run
    compiles its layers (candidates are timed in a compiled layer); ``budget_s``: seconds the
    measuring may take before the first step (``model.kernels_budget_s``; None: no limit)."""
    if mode != "auto" or device.type not in MEASURED_DEVICE_TYPES:
        return resolve_kernels(mode, device.type, profile=profile)
    from bertdist.ops import selection

    workload = selection.Workload.for_model(model_config, batch=micro_batch, seq=seq, precision=precision,
                                            autocast=autocast, compiled=compiled)
    kernels = auto_kernels(workload, device, cache=cache, log=log, profile=profile, measurer=measurer,
                           budget_s=budget_s)
    if run_dir is not None and kernels.plan is not None and _rank() == 0:
        selection.plan_copy(kernels.plan, run_dir)
    return kernels


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
