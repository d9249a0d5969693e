"""Torch-native versions of the model's ops: torch's own kernels behind the seam's signatures.

These are what ``kernels: reference`` runs on CUDA and the baselines every other candidate
must beat under ``kernels: auto`` (``bertdist.ops.selection``):

- layer norm: ``F.layer_norm`` (fp32 statistics);
- bias + dropout + residual + layer norm: torch eager (torch has no fused op for it; the bias
  stays in the GEMM, where cuBLAS adds it for free);
- padded attention: ``F.scaled_dot_product_attention`` with a *boolean* key-padding mask
  ``[B, 1, 1, S]``. Of SDPA's backends only memory-efficient and cuDNN take a mask (flash does
  not); torch picks among them unless a backend is forced (``sdpa_attention(backends=...)``);
- unpadded (varlen) attention: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention or
  cuDNN over ``cu_seqlens``) where it can do what the call needs, else SDPA on the sequences
  re-padded to ``max_seqlen`` (``varlen_attention_sdpa``).

``varlen_attn`` limits (torch 2.14, ``torch/nn/attention/varlen.py``): CUDA only; fp16/bf16;
head_dim a multiple of 8 and at most 256 (FlashAttention's); **no dropout** (``dropout_p`` is
hard-coded to 0). BERT pretraining uses attention dropout 0.1, so while training with attention
dropout the varlen call is never made; evaluation, inference and dropout-free fine-tuning get it.

Packing helpers: the model packs real tokens as ``[T, heads, head_dim]`` plus ``cu_seqlens``
(int32 ``[B + 1]``). ``packed_index`` maps each packed token to its flat position in
``[B * S]`` without a host sync, ``repad`` / ``unpad`` move q/k/v/outputs between the two
layouts; tests check both directions against the padded path on CPU.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from bertdist.ops import reference

VARLEN_ATTN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_ATTN_MAX_HEAD_DIM = 256


# ---------------------------------------------------------------- layer norm


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, *, p: float, training: bool, eps: float):
    """``LN(residual + dropout(x + bias))`` in torch eager (three element-wise passes and the LN)."""
    return reference.reference_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p=p,
                                                           training=training, eps=eps)


# ---------------------------------------------------------------- padded attention


def _sdpa_context(backends):
    if not backends:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(list(backends))


def sdpa_attention(q, k, v, key_padding_mask, *, dropout_p: float = 0.0, training: bool = False,
                   scale: float | None = None, backends=None):
    """SDPA over ``[B, H, S, D]`` with the boolean mask ``[B, 1, 1, S]`` (True = real key).

    ``backends``: a list of ``torch.nn.attention.SDPBackend`` to restrict torch's choice to
    (``None``: torch's own priority order)."""
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :].to(torch.bool)
    with _sdpa_context(backends):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0,
                                              scale=scale)


def sdpa_with(*backend_names: str):
    """``sdpa_attention`` pinned to the named backends ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION", ...)."""
    from torch.nn.attention import SDPBackend

    backends = [getattr(SDPBackend, n) for n in backend_names]

    def attention(q, k, v, key_padding_mask, *, dropout_p=0.0, training=False, scale=None):
        return sdpa_attention(q, k, v, key_padding_mask, dropout_p=dropout_p, training=training, scale=scale,
                              backends=backends)

    attention.__name__ = "sdpa_" + "_".join(n.lower() for n in backend_names)
    return attention


# ---------------------------------------------------------------- packing


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sequence of each of the ``total`` packed tokens, its position in that sequence), int64,
    no host sync."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    batch = torch.arange(len(lengths), device=cu.device)
    seq_of_token = torch.repeat_interleave(batch, lengths, output_size=total)
    token = torch.arange(total, device=cu.device)
    return seq_of_token, token - cu[seq_of_token]


def packed_index(cu_seqlens: torch.Tensor, total: int, seq: int) -> torch.Tensor:
    """Flat position in ``[B * seq]`` of each of the ``total`` packed tokens (int64, no host sync)."""
    seq_of_token, position = packed_positions(cu_seqlens, total)
    return seq_of_token * seq + position


def lengths_mask(cu_seqlens: torch.Tensor, seq: int) -> torch.Tensor:
    """``[B, seq]`` bool, True at the real tokens of each packed sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.arange(seq, device=cu_seqlens.device)[None, :] < lengths[:, None]


def repad(x: torch.Tensor, index: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Packed ``[T, H, D]`` -> ``[B, H, seq, D]``, zeros at padding."""
    out = x.new_zeros(batch * seq, *x.shape[1:])
    out = out.index_copy(0, index, x)
    return out.view(batch, seq, *x.shape[1:]).transpose(1, 2)


def unpad(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> packed ``[T, H, D]`` (the rows at ``index``)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d).index_select(0, index)


def padded_index(key_padding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(flat index of the real tokens, cu_seqlens int32, max_seqlen) of a right-padded ``[B, S]`` mask.
    The max length is read on the host (varlen kernels take it as an int): one sync."""
    lengths = key_padding_mask.sum(dim=1, dtype=torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    index = key_padding_mask.reshape(-1).nonzero(as_tuple=False).squeeze(1)
    return index, cu, int(lengths.max()) if lengths.numel() else 0


# ---------------------------------------------------------------- unpadded attention


def varlen_attn_unsupported(q: torch.Tensor, dropout_active: bool) -> str | None:
    """Why ``varlen_attn`` cannot run this call (None when it can)."""
    if dropout_active:
        return "varlen_attn has no dropout (torch hard-codes dropout_p=0), and this call trains with attention dropout"
    if q.device.type != "cuda":
        return f"varlen_attn needs CUDA (FlashAttention/cuDNN), got {q.device.type}"
    if q.dtype not in VARLEN_ATTN_DTYPES:
        return f"varlen_attn takes float16/bfloat16, got {str(q.dtype).replace('torch.', '')}"
    d = q.shape[-1]
    if d % 8 or d > VARLEN_ATTN_MAX_HEAD_DIM:
        return f"varlen_attn needs head_dim a multiple of 8 and at most {VARLEN_ATTN_MAX_HEAD_DIM}, got {d}"
    return None


def varlen_attention_flash(q, k, v, cu_seqlens, max_seqlen: int, *, dropout_p: float = 0.0, training: bool = False,
                           scale: float | None = None):
    """``varlen_attn`` on packed ``[T, H, D]`` q/k/v; an error where it cannot run the call."""
    why = varlen_attn_unsupported(q, training and dropout_p > 0)
    if why:
        raise ValueError(why)
    from torch.nn.attention.varlen import varlen_attn

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), scale=scale)


def varlen_attention_sdpa(q, k, v, cu_seqlens, max_seqlen: int, *, dropout_p: float = 0.0, training: bool = False,
                          scale: float | None = None, attention=sdpa_attention):
    """Unpadded attention through a padded kernel: re-pad to ``[B, H, max_seqlen, D]``, run
    ``attention`` (SDPA by default) with the key-padding mask, pack the result again. Supports
    dropout; costs two copies of q/k/v/out and the padding's FLOPs up to ``max_seqlen``."""
    total, batch, seq = q.shape[0], cu_seqlens.numel() - 1, int(max_seqlen)
    if total == 0 or seq == 0:
        return q.new_zeros(q.shape)
    index = packed_index(cu_seqlens, total, seq)
    qp, kp, vp = (repad(t, index, batch, seq) for t in (q, k, v))
    out = attention(qp, kp, vp, lengths_mask(cu_seqlens, seq), dropout_p=dropout_p, training=training, scale=scale)
    return unpad(out, index)


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, *, dropout_p: float = 0.0, training: bool = False,
                     scale: float | None = None):
    """Torch-native unpadded attention: ``varlen_attn`` where it can run the call (see the module
    docstring), SDPA on the re-padded sequences otherwise. The rule depends only on the device,
    dtype, head_dim and whether dropout is active, so every rank takes the same branch."""
    if varlen_attn_unsupported(q, training and dropout_p > 0) is None:
        return varlen_attention_flash(q, k, v, cu_seqlens, max_seqlen, dropout_p=dropout_p, training=training,
                                      scale=scale)
    return varlen_attention_sdpa(q, k, v, cu_seqlens, max_seqlen, dropout_p=dropout_p, training=training, scale=scale)


def padded_cu_seqlens(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32 ``[2B + 1]``) over all ``B * S`` rows of a right-padded batch: each row's
    real tokens, then its padding, as two sequences (one may be empty). Computed on the device,
    with no host sync: nothing is packed, and the longest sequence is at most ``S``."""
    b, s = key_padding_mask.shape
    lengths = key_padding_mask.sum(dim=1, dtype=torch.int32)
    starts = torch.arange(b, device=key_padding_mask.device, dtype=torch.int32) * s
    return F.pad(torch.stack([starts, starts + lengths], dim=1).reshape(-1), (0, 1), value=b * s)


def attention_via_varlen(q, k, v, key_padding_mask, *, dropout_p: float = 0.0, training: bool = False,
                         scale: float | None = None, varlen=varlen_attention_flash):
    """Padded attention through an unpadded kernel: ``[B, H, S, D]`` q/k/v as ``B * S`` rows,
    where a row's padding is a sequence of its own (``padded_cu_seqlens``), so the real tokens
    attend only to each other; ``varlen`` is ``varlen_attn`` by default. No host sync (packing
    the real tokens would read their count and the longest length from the device). Outputs at
    padded query positions are zero (the model never reads them)."""
    b, h, s, d = q.shape
    if key_padding_mask is None:
        key_padding_mask = torch.ones(b, s, dtype=torch.bool, device=q.device)
    mask = key_padding_mask.to(torch.bool)
    rows = [t.transpose(1, 2).reshape(b * s, h, d) for t in (q, k, v)]
    out = varlen(*rows, padded_cu_seqlens(mask), s, dropout_p=dropout_p, training=training, scale=scale)
    return (out.view(b, s, h, d) * mask[:, :, None, None].to(out.dtype)).transpose(1, 2)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# SDPA pinned to one backend, as candidates of their own (both take a key-padding mask).
SDPA_EFFICIENT = sdpa_with("EFFICIENT_ATTENTION")
SDPA_CUDNN = sdpa_with("CUDNN_ATTENTION")
