"""Which implementation of the flat-buffer optimizer ops an optimizer gets.

``mode`` takes the model's ``kernels`` values (``dispatch.py``):

- ``fused``: the compiled kernels for the parameters' device (``fused_optim``): the CUDA kernels on
  a GPU, the C++ CPU twin on the CPU; an error naming the cause where they are not usable.
- ``emulated``: the CUDA kernels run by the SIMT emulator (CPU tensors; for tests, very slow).
- ``reference``: the pure-PyTorch twins of ``reference.py`` (on CUDA they read the segment
  offsets on the host: one sync per op).
- ``auto``: ``fused`` where usable, else ``reference`` (with a warning on CUDA, where the
  fallback costs host syncs). Unlike the model's ops, ``auto`` takes the C++ twin on the CPU
  too: there is no oneDNN optimizer to beat, and it makes one pass where the reference makes
  about twenty plus a Python loop over the tensors.
"""
from __future__ import annotations

import warnings

from bertdist.ops import reference
from bertdist.ops.fused_optim import FlatOptimOps

MODES = ("auto", "fused", "reference", "emulated")

REFERENCE = FlatOptimOps(
    grad_norm=reference.reference_flat_grad_norm,
    lamb_step_=reference.reference_flat_lamb_step_,
    adamw_step_=reference.reference_flat_adamw_step_,
)


def resolve_optim_ops(mode: str, device_type: str) -> tuple[FlatOptimOps, str]:
    """(the ops, where they come from: "fused" | "emulated" | "reference") for tensors on ``device_type``."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "reference":
        return REFERENCE, "reference"
    if mode == "emulated":
        from bertdist.ops import emulated

        ok, why = emulated.availability("flat_lamb_step", device_type)
        if not ok:
            raise RuntimeError(f"kernels=emulated for the flat optimizer: {why}")
        return emulated.OPTIM, "emulated"
    from bertdist.ops import fused_optim

    ok, why = fused_optim.availability(device_type)
    if ok:
        return fused_optim._OPS, "fused"
    if mode == "fused":
        raise RuntimeError(f"kernels=fused for the flat optimizer on {device_type}: {why}")
    if device_type == "cuda":
        warnings.warn(f"flat optimizer on CUDA: compiled kernels unusable ({why}); the reference ops instead "
                      "(a host sync per op)", RuntimeWarning, stacklevel=3)
    return REFERENCE, "reference"
