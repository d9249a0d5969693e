"""Fused ops backed by the ``bertdist._C`` extension (C++ on CPU, CUDA kernels on GPU).

Each op is a ``torch.library`` custom op (``torch.ops.bertdist.*``) with a fake (meta)
implementation and a registered autograd formula, so autograd and ``torch.compile`` see one
opaque, traceable op; the backward is itself a custom op. The public functions below have
the same signatures as their twins in ``reference.py`` (the fallback and test oracle).

Dropout is counter-based (Philox): the mask is a function of (seed, offset, element index),
and CPU and CUDA kernels drop the same elements for the same seed and offset. An explicit
``seed``/``offset`` is used as given. Without one, a CPU call draws a 62-bit seed from torch's
default CPU generator, and a CUDA call leaves it to the kernel, which takes the default CUDA
generator's Philox state the way torch's own dropout does: valid under CUDA-graph capture
(each replay draws a fresh pair on the device), reproduced by ``torch.manual_seed``. Each
dropout forward returns the pair it used as an int64 ``rng_state`` [2] tensor (empty when
p == 0); autograd saves it and the backward regenerates the mask from it instead of storing it.

``availability(op, device)`` says whether an op can run fused on a device (a ``DeviceProfile``
or a device type, meaning this machine's), and why not; ``bertdist.ops.dispatch`` uses it to pick kernels.

The ops are defined by ``define_ops(namespace, extension)``: here once as ``torch.ops.bertdist``
over ``bertdist._C``, and by ``bertdist.ops.emulated`` as ``torch.ops.bertdist_emu`` over
``bertdist._C_emu`` (the CUDA kernels, run on CPU tensors by the SIMT emulator).
"""
from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

from bertdist.ops import _extension

if TYPE_CHECKING:
    from bertdist.device_profile import DeviceProfile

OPS = ("layer_norm", "bias_dropout_add_layer_norm", "attention", "varlen_attention")
MIN_CUDA_CAPABILITY = (8, 0)


def _C():
    ext, why = _extension.load()
    if ext is None:
        raise RuntimeError(f"bertdist fused kernels unavailable: {why}")
    return ext


def availability(op: str, device: "str | DeviceProfile") -> tuple[bool, str]:
    """(usable, reason) for running ``op`` fused on ``device``: a ``DeviceProfile``, or a device
    type ("cpu", "cuda") meaning this machine's (``device_profile.detect()``)."""
    if op not in OPS:
        return False, f"no fused op named {op!r} (have {', '.join(OPS)})"
    if isinstance(device, str) and device not in ("cpu", "cuda"):
        return False, f"no fused kernels for device type {device!r}"
    profile = _profile(device)
    ext, why = _extension.load()
    if ext is None:
        return False, why
    if profile.type == "cpu":
        return True, f"C++ CPU kernels (kernels=fused selects them; auto keeps torch's CPU ops), {why}"
    info = ext.build_info()
    if not info["with_cuda"]:
        return False, f"{why} has no CUDA kernels ({info['note']})"
    if profile.visible_count == 0:
        return False, f"CUDA kernels built ({info['cuda_archs']}) but no CUDA device is visible"
    cap = profile.capability
    if cap < MIN_CUDA_CAPABILITY:
        return False, f"CUDA kernels need sm_80+, device {profile.name} is sm_{cap[0]}{cap[1]}"
    return True, f"CUDA kernels ({info['cuda_archs']}) on {profile.name} (sm_{cap[0]}{cap[1]}), {why}"


def _profile(device: "str | DeviceProfile") -> "DeviceProfile":
    from bertdist.device_profile import DeviceProfile, for_device_type

    return device if isinstance(device, DeviceProfile) else for_device_type(device)


@torch.compiler.disable
def _draw_seed() -> int:
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def _op_seed(t: Tensor, p: float, seed: int | None) -> int | None:
    """The seed an op call passes: the caller's; else one drawn here for non-CUDA tensors; else
    None, so that the CUDA kernel draws from the CUDA generator (graph-safe)."""
    if seed is not None:
        return int(seed)
    if p == 0 or t.device.type == "cuda":
        return None
    return _draw_seed()


def _rng_state_like(t: Tensor, p: float) -> Tensor:
    # The forward's (seed, offset) record: int64 [2] with dropout, empty without.
    return t.new_empty(2 if p > 0 else 0, dtype=torch.int64)


# Ops whose dropout may draw from the CUDA generator: the compiler must neither merge nor
# recompute them (a recomputation would draw another mask).
_SEEDED = (torch.Tag.nondeterministic_seeded,)


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _bhsd_like(q: Tensor) -> Tensor:
    # Outputs live in [B, S, H, D] memory viewed as [B, H, S, D] (what the C++ side allocates).
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, d).permute(0, 2, 1, 3)


def _unit_last_stride(t: Tensor) -> Tensor:
    # The kernels take any [B, H, S, D] strides as long as head_dim is dense (the model's
    # permuted views of its packed QKV projection qualify, so they are not copied).
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclasses.dataclass(frozen=True)
class OpSet:
    """The public functions over one registration of the custom ops."""

    layer_norm: Callable
    bias_dropout_add_layer_norm: Callable
    attention: Callable
    varlen_attention: Callable


# ---------------------------------------------------------------- layer norm


def _define_layer_norm(namespace: str, extension: Callable[[], ModuleType]) -> Callable:
    ops = getattr(torch.ops, namespace)

    @torch.library.custom_op(f"{namespace}::layer_norm_fwd", mutates_args=())
    def _layer_norm_fwd(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        y, mean, rstd = extension().layer_norm_fwd(x, weight, bias, eps)
        return y, mean, rstd

    @_layer_norm_fwd.register_fake
    def _(x, weight, bias, eps):
        rows = x.numel() // x.shape[-1]
        return torch.empty_like(x), x.new_empty(rows, dtype=_acc_dtype(x)), x.new_empty(rows, dtype=_acc_dtype(x))

    @torch.library.custom_op(f"{namespace}::layer_norm_bwd", mutates_args=())
    def _layer_norm_bwd(
        grad_out: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        dx, dw, db = extension().layer_norm_bwd(grad_out, x, mean, rstd, weight)
        return dx, dw, db

    @_layer_norm_bwd.register_fake
    def _(grad_out, x, mean, rstd, weight):
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)

    def _layer_norm_setup(ctx, inputs, output):
        x, weight, _bias, _eps = inputs
        _y, mean, rstd = output
        ctx.save_for_backward(x, weight, mean, rstd)

    def _layer_norm_backward(ctx, grad_y, _grad_mean, _grad_rstd):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = ops.layer_norm_bwd(grad_y.contiguous(), x, mean, rstd, weight)
        return dx, dw, db, None

    _layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)

    def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        """LayerNorm over the last dim, fp32 statistics; output in x's dtype."""
        y, _, _ = ops.layer_norm_fwd(x.contiguous(), weight, bias, float(eps))
        return y

    return layer_norm


# ---------------------------------------------------------------- bias + dropout + residual + layer norm


def _define_bias_dropout_add_layer_norm(namespace: str, extension: Callable[[], ModuleType]) -> Callable:
    ops = getattr(torch.ops, namespace)

    @torch.library.custom_op(f"{namespace}::bias_dropout_add_layer_norm_fwd", mutates_args=(), tags=_SEEDED)
    def _bdaln_fwd(
        x: Tensor,
        bias: Optional[Tensor],
        residual: Tensor,
        weight: Tensor,
        ln_bias: Tensor,
        p: float,
        eps: float,
        seed: Optional[int],
        offset: int,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        y, h, mean, rstd, rng_state = extension().bias_dropout_add_layer_norm_fwd(
            x, bias, residual, weight, ln_bias, p, eps, seed, offset
        )
        return y, h, mean, rstd, rng_state

    @_bdaln_fwd.register_fake
    def _(x, bias, residual, weight, ln_bias, p, eps, seed, offset):
        rows = x.numel() // x.shape[-1]
        acc = _acc_dtype(x)
        return (torch.empty_like(x), torch.empty_like(x), x.new_empty(rows, dtype=acc), x.new_empty(rows, dtype=acc),
                _rng_state_like(x, p))

    @torch.library.custom_op(f"{namespace}::bias_dropout_add_layer_norm_bwd", mutates_args=())
    def _bdaln_bwd(
        grad_out: Tensor,
        h: Tensor,
        mean: Tensor,
        rstd: Tensor,
        weight: Tensor,
        has_bias: bool,
        p: float,
        rng_state: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        dh, dx, dw, dlnb, dbias = extension().bias_dropout_add_layer_norm_bwd(grad_out, h, mean, rstd, weight, has_bias, p, rng_state)
        return dh, dx, dw, dlnb, dbias

    @_bdaln_bwd.register_fake
    def _(grad_out, h, mean, rstd, weight, has_bias, p, rng_state):
        # the dense bias's gradient: in the weights' dtype when they are h's bf16/fp16 (bf16 weights)
        acc = h.dtype if weight.dtype == h.dtype and h.dtype in (torch.bfloat16, torch.float16) else _acc_dtype(h)
        dx = torch.empty_like(h) if p > 0 else h.new_empty(0)
        dbias = h.new_empty(h.shape[-1], dtype=acc) if has_bias else h.new_empty(0, dtype=acc)
        return torch.empty_like(h), dx, torch.empty_like(weight), torch.empty_like(weight), dbias

    def _bdaln_setup(ctx, inputs, output):
        x, bias, _residual, weight, _ln_bias, p, _eps, _seed, _offset = inputs
        _y, h, mean, rstd, rng_state = output
        ctx.save_for_backward(h, weight, mean, rstd, rng_state)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.p = p

    def _bdaln_backward(ctx, grad_y, _grad_h, _grad_mean, _grad_rstd, _grad_rng_state):
        h, weight, mean, rstd, rng_state = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None
        dh, dx, dw, dlnb, dbias = ops.bias_dropout_add_layer_norm_bwd(
            grad_y.contiguous(), h, mean, rstd, weight, has_bias, ctx.p, rng_state
        )
        if ctx.p == 0:
            dx = dh  # no dropout: x and the residual get the same gradient
        return dx, (dbias.to(ctx.bias_dtype) if has_bias else None), dh, dw, dlnb, None, None, None, None

    _bdaln_fwd.register_autograd(_bdaln_backward, setup_context=_bdaln_setup)

    def bias_dropout_add_layer_norm(
        x: Tensor,
        bias: Tensor | None,
        residual: Tensor,
        weight: Tensor,
        ln_bias: Tensor,
        *,
        p: float,
        training: bool,
        eps: float,
        seed: int | None = None,
        offset: int = 0,
    ) -> Tensor:
        """``LN(residual + dropout(x + bias))`` in one kernel; statistics in fp32. ``seed=None``
        draws the dropout seed (see the module docstring)."""
        p = float(p) if training else 0.0
        y, _, _, _, _ = ops.bias_dropout_add_layer_norm_fwd(
            x.contiguous(), bias, residual.contiguous(), weight, ln_bias, p, float(eps), _op_seed(x, p, seed), int(offset)
        )
        return y

    return bias_dropout_add_layer_norm


# ---------------------------------------------------------------- attention


def _define_attention(namespace: str, extension: Callable[[], ModuleType]) -> Callable:
    ops = getattr(torch.ops, namespace)

    @torch.library.custom_op(f"{namespace}::attention_fwd", mutates_args=(), tags=_SEEDED)
    def _attention_fwd(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Optional[Tensor],
        scale: float,
        p: float,
        seed: Optional[int],
        offset: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        out, stats, rng_state = extension().attention_fwd(q, k, v, key_padding_mask, scale, p, seed, offset)
        return out, stats, rng_state

    @_attention_fwd.register_fake
    def _(q, k, v, key_padding_mask, scale, p, seed, offset):
        b, h, s, _ = q.shape
        return _bhsd_like(q), q.new_empty(2, b * h * s, dtype=_acc_dtype(q)), _rng_state_like(q, p)

    @torch.library.custom_op(f"{namespace}::attention_bwd", mutates_args=())
    def _attention_bwd(
        grad_out: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        stats: Tensor,
        key_padding_mask: Optional[Tensor],
        scale: float,
        p: float,
        rng_state: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = extension().attention_bwd(grad_out, q, k, v, out, stats, key_padding_mask, scale, p, rng_state)
        return dq, dk, dv

    @_attention_bwd.register_fake
    def _(grad_out, q, k, v, out, stats, key_padding_mask, scale, p, rng_state):
        return _bhsd_like(q), _bhsd_like(q), _bhsd_like(q)

    def _attention_setup(ctx, inputs, output):
        q, k, v, mask, scale, p, _seed, _offset = inputs
        out, stats, rng_state = output
        ctx.save_for_backward(q, k, v, out, stats, mask, rng_state)
        ctx.scale, ctx.p = scale, p

    def _attention_backward(ctx, grad_out, _grad_stats, _grad_rng_state):
        q, k, v, out, stats, mask, rng_state = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq, dk, dv = ops.attention_bwd(
            grad_out, q, k, v, out, stats, mask, ctx.scale, ctx.p, rng_state
        )
        return dq, dk, dv, None, None, None, None, None

    _attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup)

    def attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        *,
        dropout_p: float = 0.0,
        training: bool = False,
        scale: float | None = None,
        seed: int | None = None,
        offset: int = 0,
    ) -> Tensor:
        """``softmax(Q K^T * scale + mask) -> dropout -> @ V`` for ``[B, H, S, D]`` q/k/v; the
        result is a ``[B, H, S, D]`` view of ``[B, S, H, D]`` memory."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        p = float(dropout_p) if training else 0.0
        out, _, _ = ops.attention_fwd(
            _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), key_padding_mask, scale, p,
            _op_seed(q, p, seed), int(offset),
        )
        return out

    return attention


# ---------------------------------------------------------------- varlen attention


def _define_varlen_attention(namespace: str, extension: Callable[[], ModuleType]) -> Callable:
    ops = getattr(torch.ops, namespace)

    @torch.library.custom_op(f"{namespace}::varlen_attention_fwd", mutates_args=(), tags=_SEEDED)
    def _varlen_fwd(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        scale: float,
        p: float,
        seed: Optional[int],
        offset: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        out, stats, rng_state = extension().varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, scale, p, seed, offset)
        return out, stats, rng_state

    @_varlen_fwd.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, scale, p, seed, offset):
        t, h, _ = q.shape
        return (torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(2, t * h, dtype=_acc_dtype(q)),
                _rng_state_like(q, p))

    @torch.library.custom_op(f"{namespace}::varlen_attention_bwd", mutates_args=())
    def _varlen_bwd(
        grad_out: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        stats: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        scale: float,
        p: float,
        rng_state: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = extension().varlen_attention_bwd(grad_out, q, k, v, out, stats, cu_seqlens, max_seqlen, scale, p, rng_state)
        return dq, dk, dv

    @_varlen_bwd.register_fake
    def _(grad_out, q, k, v, out, stats, cu_seqlens, max_seqlen, scale, p, rng_state):
        return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))

    def _varlen_setup(ctx, inputs, output):
        q, k, v, cu, max_seqlen, scale, p, _seed, _offset = inputs
        out, stats, rng_state = output
        ctx.save_for_backward(q, k, v, out, stats, cu, rng_state)
        ctx.max_seqlen, ctx.scale, ctx.p = max_seqlen, scale, p

    def _varlen_backward(ctx, grad_out, _grad_stats, _grad_rng_state):
        q, k, v, out, stats, cu, rng_state = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq, dk, dv = ops.varlen_attention_bwd(
            grad_out, q, k, v, out, stats, cu, ctx.max_seqlen, ctx.scale, ctx.p, rng_state
        )
        return dq, dk, dv, None, None, None, None, None, None

    _varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)

    def varlen_attention(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        *,
        dropout_p: float = 0.0,
        training: bool = False,
        scale: float | None = None,
        seed: int | None = None,
        offset: int = 0,
    ) -> Tensor:
        """Unpadded attention over packed ``[total_tokens, heads, head_dim]`` q/k/v; sequence b is
        tokens ``cu_seqlens[b]:cu_seqlens[b+1]`` (int32) and attends only to itself."""
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        p = float(dropout_p) if training else 0.0
        out, _, _ = ops.varlen_attention_fwd(
            _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), cu_seqlens, int(max_seqlen), scale, p,
            _op_seed(q, p, seed), int(offset),
        )
        return out

    return varlen_attention


def define_ops(namespace: str, extension: Callable[[], ModuleType]) -> OpSet:
    """Registers the custom ops ``torch.ops.<namespace>.*`` (forward, backward, fake and autograd
    formula of each) over ``extension()``, a module with ``bertdist._C``'s entry points, and
    returns the public functions (the signatures of their twins in ``reference.py``)."""
    ops = OpSet(
        layer_norm=_define_layer_norm(namespace, extension),
        bias_dropout_add_layer_norm=_define_bias_dropout_add_layer_norm(namespace, extension),
        attention=_define_attention(namespace, extension),
        varlen_attention=_define_varlen_attention(namespace, extension),
    )
    # Under torch.autocast the layer norms run in fp32, as torch's own layer_norm does on CUDA: the
    # inputs arrive in mixed dtypes there (a bf16 GEMM output beside an fp32 residual), which the
    # kernels would otherwise reject.
    for name in (f"{namespace}::layer_norm_fwd", f"{namespace}::bias_dropout_add_layer_norm_fwd"):
        for device_type in ("cpu", "cuda"):
            torch.library.register_autocast(name, device_type, torch.float32)
    return ops


_OPS = define_ops("bertdist", _C)
layer_norm = _OPS.layer_norm
bias_dropout_add_layer_norm = _OPS.bias_dropout_add_layer_norm
attention = _OPS.attention
varlen_attention = _OPS.varlen_attention
