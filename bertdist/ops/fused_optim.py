"""Flat-buffer LAMB and AdamW backed by the ``bertdist._C`` extension (C++ on CPU, CUDA on GPU).

Three ``torch.library`` custom ops with fake (meta) kernels, over the flat buffers and segment
table of ``flat_layout``:

- ``flat_grad_norm(grads, table, num_chunks, chunk_size, max_norm) -> (seg_norm2, stats)``: the
  per-segment sums of g^2, and ``stats`` = [global norm, clip coefficient
  ``min(1, max_norm / (norm + 1e-6))``] (coefficient 1 when ``max_norm <= 0``). Two launches on CUDA.
- ``flat_lamb_step_(params, grads, exp_avg, exp_avg_sq, table, num_chunks, chunk_size,
  weight_decay, stats, *, step, lr, beta1, beta2, eps, bias_correction, max_coeff, min_coeff)``:
  ``bertdist.train.lamb.Lamb``'s step for every tensor at once, the gradient scaled by
  ``stats[1]``; ``weight_decay`` is fp32 [segments]. Two launches on CUDA.
- ``flat_adamw_step_(...)``: ``torch.optim.AdamW``'s step (decoupled weight decay), one launch.

Both steps take ``params_bf16``: a flat bf16 buffer that receives the updated params rounded to
nearest even in the same pass (for a bf16 copy of the model), or None.

They update params, exp_avg and exp_avg_sq in place and never read a device value on the host:
``step`` and ``lr`` are host scalars, the clip coefficient stays on the device. The public
functions have the signatures of their twins in ``reference.py`` (``reference_flat_*``).
``define_optim_ops`` registers them for an extension module: here as ``torch.ops.bertdist`` over
``bertdist._C``; ``emulated`` registers ``torch.ops.bertdist_emu`` over ``bertdist._C_emu``.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from bertdist.ops import fused

OPTIM_OPS = ("flat_grad_norm", "flat_lamb_step", "flat_adamw_step")


@dataclasses.dataclass(frozen=True)
class FlatOptimOps:
    """The flat-buffer optimizer functions of one implementation."""

    grad_norm: Callable
    lamb_step_: Callable
    adamw_step_: Callable


def _bf16_or_empty(params: Tensor, params_bf16: Tensor | None) -> Tensor:
    # The ops take an empty tensor for "no bf16 copy" (a mutable Optional[Tensor] is not needed then).
    return params.new_empty(0, dtype=torch.bfloat16) if params_bf16 is None else params_bf16


def define_optim_ops(namespace: str, extension: Callable[[], ModuleType]) -> FlatOptimOps:
    """Registers ``torch.ops.<namespace>.flat_*`` over ``extension()`` and returns the public functions."""
    ops = getattr(torch.ops, namespace)
    state = ("params", "exp_avg", "exp_avg_sq", "params_bf16")

    @torch.library.custom_op(f"{namespace}::flat_grad_norm", mutates_args=())
    def _grad_norm(grads: Tensor, table: Tensor, num_chunks: int, chunk_size: int,
                   max_norm: float) -> tuple[Tensor, Tensor]:
        seg_norm2, stats = extension().flat_grad_norm(grads, table, num_chunks, chunk_size, max_norm)
        return seg_norm2, stats

    @_grad_norm.register_fake
    def _(grads, table, num_chunks, chunk_size, max_norm):
        return grads.new_empty(table.shape[1] - 1, dtype=torch.float32), grads.new_empty(2, dtype=torch.float32)

    @torch.library.custom_op(f"{namespace}::flat_lamb_step", mutates_args=state)
    def _lamb(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, table: Tensor, num_chunks: int,
              chunk_size: int, weight_decay: Tensor, stats: Tensor, step: int, lr: float, beta1: float, beta2: float,
              eps: float, bias_correction: bool, max_coeff: float, min_coeff: float, params_bf16: Tensor) -> None:
        extension().flat_lamb_step(params, grads, exp_avg, exp_avg_sq, table, num_chunks, chunk_size, weight_decay,
                                   stats, step, lr, beta1, beta2, eps, bias_correction, max_coeff, min_coeff,
                                   params_bf16)

    @_lamb.register_fake
    def _(*args):
        return None

    @torch.library.custom_op(f"{namespace}::flat_adamw_step", mutates_args=state)
    def _adamw(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, table: Tensor, num_chunks: int,
               chunk_size: int, weight_decay: Tensor, stats: Tensor, step: int, lr: float, beta1: float,
               beta2: float, eps: float, params_bf16: Tensor) -> None:
        extension().flat_adamw_step(params, grads, exp_avg, exp_avg_sq, table, num_chunks, chunk_size, weight_decay,
                                    stats, step, lr, beta1, beta2, eps, params_bf16)

    @_adamw.register_fake
    def _(*args):
        return None

    def flat_grad_norm(grads: Tensor, table: Tensor, num_chunks: int, chunk_size: int,
                       max_norm: float) -> tuple[Tensor, Tensor]:
        """(per-segment sums of g^2, [global norm, clip coefficient]), fp32, on grads' device."""
        return ops.flat_grad_norm(grads, table, int(num_chunks), int(chunk_size), float(max_norm))

    def flat_lamb_step_(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, table: Tensor,
                        num_chunks: int, chunk_size: int, weight_decay: Tensor, stats: Tensor, *, step: int,
                        lr: float, beta1: float, beta2: float, eps: float, bias_correction: bool = True,
                        max_coeff: float = 10.0, min_coeff: float = 0.01, params_bf16: Tensor | None = None) -> None:
        """One LAMB step of every segment, in place; ``params_bf16`` (flat bf16) receives the new params."""
        ops.flat_lamb_step(params, grads, exp_avg, exp_avg_sq, table, int(num_chunks), int(chunk_size), weight_decay,
                           stats, int(step), float(lr), float(beta1), float(beta2), float(eps), bool(bias_correction),
                           float(max_coeff), float(min_coeff), _bf16_or_empty(params, params_bf16))

    def flat_adamw_step_(params: Tensor, grads: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, table: Tensor,
                         num_chunks: int, chunk_size: int, weight_decay: Tensor, stats: Tensor, *, step: int,
                         lr: float, beta1: float, beta2: float, eps: float, params_bf16: Tensor | None = None) -> None:
        """One AdamW step of every segment, in place; ``params_bf16`` as LAMB's."""
        ops.flat_adamw_step(params, grads, exp_avg, exp_avg_sq, table, int(num_chunks), int(chunk_size),
                            weight_decay, stats, int(step), float(lr), float(beta1), float(beta2), float(eps),
                            _bf16_or_empty(params, params_bf16))

    return FlatOptimOps(flat_grad_norm, flat_lamb_step_, flat_adamw_step_)


def availability(device_type: str) -> tuple[bool, str]:
    """(usable, reason) for the compiled flat optimizer kernels on this machine's ``device_type``
    device: the C++ CPU twin on "cpu", the CUDA kernels on "cuda" (any GPU: they use no sm_80 feature)."""
    if device_type not in ("cpu", "cuda"):
        return False, f"no compiled flat optimizer kernels for device type {device_type!r}"
    ext, why = fused._extension.load()
    if ext is None:
        return False, why
    if not hasattr(ext, "flat_lamb_step"):
        return False, f"{why} predates the flat optimizer kernels: rebuild it (pip install -e .)"
    if device_type == "cpu":
        return True, f"C++ CPU twin, {why}"
    info = ext.build_info()
    if not info["with_cuda"]:
        return False, f"{why} has no CUDA kernels ({info['note']})"
    if not torch.cuda.is_available():
        return False, f"CUDA kernels built ({info['cuda_archs']}) but no CUDA device is visible"
    return True, f"CUDA kernels ({info['cuda_archs']}), {why}"


_OPS = define_optim_ops("bertdist", fused._C)
flat_grad_norm = _OPS.grad_norm
flat_lamb_step_ = _OPS.lamb_step_
flat_adamw_step_ = _OPS.adamw_step_
