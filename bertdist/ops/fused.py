"""Fused ops backed by the ``bertdist._C`` extension (C++ on CPU, CUDA kernels on GPU).

Each op is a dispatcher op (``torch.ops.bertdist.*``) with a fake (meta) implementation and an
autograd formula, so autograd and ``torch.compile`` see one opaque, traceable op; the backward is
itself an op. The layer-norm family is registered from C++ by the extension when it loads
(csrc/bindings.cpp: schema, CPU/CUDA, Meta, autocast and autograd kernels), so that a call runs no
Python past the public function here; attention is a Python ``torch.library`` custom op. The
public functions below have the same signatures as their twins in ``reference.py`` (the fallback
and test oracle).

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
``bertdist._C_emu`` (the CUDA kernels, run on CPU tensors by the SIMT emulator; the C++
registrations take their namespace from the build's BERTDIST_EMU macro).
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


# ---------------------------------------------------------------- the layer-norm family (registered from C++)


class _CppOps:
    """``torch.ops.<namespace>``, whose layer-norm ops ``extension()`` registers from C++ when it
    loads: the public functions load it on their first eager call (raising why it cannot). A trace
    skips that (it runs after the kernels were resolved, which loads the extension): loading is no
    op torch.compile could trace."""

    def __init__(self, namespace: str, extension: Callable[[], ModuleType]):
        self.ops = getattr(torch.ops, namespace)
        self.loaded = False
        self._extension = extension

    def load(self) -> None:
        self._extension()
        self.loaded = True


def _define_layer_norm(cpp: _CppOps) -> Callable:
    ops = cpp.ops

    def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        """LayerNorm over the last dim, fp32 statistics; output in x's dtype."""
        if not cpp.loaded and not torch.compiler.is_compiling():
            cpp.load()
        y, _, _ = ops.layer_norm_fwd(x.contiguous(), weight, bias, float(eps))
        return y

    return layer_norm


def _define_bias_dropout_add_layer_norm(cpp: _CppOps) -> Callable:
    ops = cpp.ops

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
        if not cpp.loaded and not torch.compiler.is_compiling():
            cpp.load()
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
    """The public functions (the signatures of their twins in ``reference.py``) over the ops
    ``torch.ops.<namespace>.*`` of ``extension()``, a module with ``bertdist._C``'s entry points.

    The layer-norm family is registered by the module itself, from C++, when it loads (schemas,
    backend, Meta, autocast and autograd kernels: csrc/bindings.cpp), so that a call runs no Python
    past the public function; the extension is loaded on the first call. The attention ops are
    registered here as Python custom ops (forward, backward, fake and autograd formula of each)."""
    cpp = _CppOps(namespace, extension)
    return OpSet(
        layer_norm=_define_layer_norm(cpp),
        bias_dropout_add_layer_norm=_define_bias_dropout_add_layer_norm(cpp),
        attention=_define_attention(namespace, extension),
        varlen_attention=_define_varlen_attention(namespace, extension),
    )


_OPS = define_ops("bertdist", _C)
layer_norm = _OPS.layer_norm
bias_dropout_add_layer_norm = _OPS.bias_dropout_add_layer_norm
attention = _OPS.attention
varlen_attention = _OPS.varlen_attention
