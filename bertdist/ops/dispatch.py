"""The kernel seam: which implementation of each op the model gets.

The model never imports a kernel directly. It asks ``resolve_kernels(mode,
device_type)`` once at construction for a ``KernelSet`` and calls its three
functions. ``mode`` is the config's ``kernels`` value:

- ``reference``: the pure-PyTorch ops in ``reference.py``;
- ``fused``: the compiled extension (``bertdist.ops.fused``); an error if it
  is not usable, with the reason;
- ``auto``: fused where the extension is built and supports the device and
  the device type is one where fused is the faster choice (``AUTO_FUSED_DEVICE_TYPES``:
  CUDA), reference otherwise. The C++ CPU kernels exist so that the binding, dispatch
  and autograd path is built and tested without a GPU; torch's own CPU ops (oneDNN/MKL
  GEMMs) are faster on CPU (see benchmarks/kernels.py), so ``auto`` keeps them there and
  ``fused`` selects the C++ kernels explicitly;
- ``emulated``: the CUDA kernels' own code, run on CPU tensors by the SIMT emulator
  (``bertdist.ops.emulated``): to test them without a GPU, orders of magnitude slower than
  any other choice; an error, with the reason, if it is not built or the device is not CPU.

``kernel_status()`` reports, per op, whether the fused version is usable and
why not, for ``bertdist info``.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Literal

from bertdist.ops import reference

KernelMode = Literal["reference", "fused", "auto", "emulated"]
OP_NAMES = ("layer_norm", "bias_dropout_add_layer_norm", "attention", "varlen_attention")
AUTO_FUSED_DEVICE_TYPES = ("cuda",)


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The functions the model calls, and where each came from."""

    layer_norm: Callable
    bias_dropout_add_layer_norm: Callable
    attention: Callable
    varlen_attention: Callable  # unpadded: packed tokens + cumulative sequence lengths
    sources: dict  # op name -> "reference" | "fused" | "emulated"


REFERENCE = KernelSet(
    layer_norm=reference.reference_layer_norm,
    bias_dropout_add_layer_norm=reference.reference_bias_dropout_add_layer_norm,
    attention=reference.reference_attention,
    varlen_attention=reference.reference_varlen_attention,
    sources={name: "reference" for name in OP_NAMES},
)


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


def kernel_status(device_type: str = "cpu") -> list[OpStatus]:
    """Per op: can the fused kernel run on ``device_type``, and if not, why."""
    mod, why = _fused_module()
    if mod is None:
        return [OpStatus(op, False, why) for op in OP_NAMES]
    out = []
    for op in OP_NAMES:
        ok, reason = mod.availability(op, device_type)
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


def resolve_kernels(mode: KernelMode, device_type: str = "cpu") -> KernelSet:
    if mode == "reference":
        return REFERENCE
    if mode == "emulated":
        return _resolve_emulated(device_type)
    if mode not in ("fused", "auto"):
        raise ValueError(f"kernels must be one of reference|fused|auto|emulated, got {mode!r}")
    if mode == "auto" and device_type not in AUTO_FUSED_DEVICE_TYPES:
        return REFERENCE  # without loading (or JIT-building) the extension
    status = {s.op: s for s in kernel_status(device_type)}
    if mode == "fused":
        bad = [f"{s.op}: {s.reason}" for s in status.values() if not s.usable]
        if bad:
            raise RuntimeError(f"kernels=fused requested on {device_type} but: " + "; ".join(bad))
    mod, _ = _fused_module()
    funcs, sources = {}, {}
    for op in OP_NAMES:
        if status[op].usable:
            funcs[op], sources[op] = getattr(mod, op), "fused"
        else:
            funcs[op], sources[op] = getattr(REFERENCE, op), "reference"
    return KernelSet(**funcs, sources=sources)
