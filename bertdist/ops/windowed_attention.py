"""Attention with an optional sliding window, padded and packed: ModernBERT's global layers (every
key of the sequence) and local layers (keys within ``half_window`` positions of the query).

Padded tensors are ``[B, H, S, D]`` with a ``[B, S]`` bool key-padding mask (True = real token);
packed tensors are ``[T, H, D]``, the sequences back to back, described by a ``Packing``
(``cu_seqlens`` and each token's sequence and position). Packed attention never crosses a sequence
boundary and measures the window within each sequence.

Packed backends, all with one signature and all tested against the reference on CPU:

- ``reference``: ``bertdist.ops.reference.reference_varlen_attention``, a Python loop over the
  sequences with the softmax spelled out (the oracle);
- ``sdpa``: the sequences re-padded to the longest, SDPA with a padding+window bool mask, packed
  again (``torch_native.varlen_attention_sdpa``); supports dropout;
- ``flex``: torch's FlexAttention over the whole packed row with a block mask (same sequence and
  within the window); blocks outside every sequence's band are skipped. No dropout, and on CPU
  no backward (torch 2.14): there it serves inference only.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from bertdist.ops import reference
from bertdist.ops.torch_native import packed_positions, varlen_attention_sdpa


@dataclasses.dataclass
class Packing:
    """Sequences packed back to back into ``T`` rows: ``cu_seqlens`` [B + 1] (int32) the
    cumulative lengths, ``max_seqlen`` (a host int) the longest, ``sequence`` and ``position``
    [T] (int64) each token's sequence and its position in it. ``block_masks`` holds what a backend
    builds once per batch and reuses in every layer (FlexAttention's block masks, per window)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    sequence: torch.Tensor
    position: torch.Tensor
    block_masks: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, max_seqlen: int, total: int) -> "Packing":
        sequence, position = packed_positions(cu_seqlens, total)
        return cls(cu_seqlens.to(torch.int32), int(max_seqlen), sequence, position)

    @property
    def total(self) -> int:
        return self.sequence.shape[0]


def window_keep(seq: int, half_window: int | None, device: torch.device) -> torch.Tensor | None:
    """[S, S] bool, True where ``|query - key| <= half_window`` (None without a window)."""
    if half_window is None:
        return None
    pos = torch.arange(seq, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= half_window


def sdpa_window_attention(q, k, v, key_padding_mask, *, half_window: int | None = None, dropout_p: float = 0.0,
                          training: bool = False, scale: float | None = None) -> torch.Tensor:
    """SDPA over padded ``[B, H, S, D]`` with one bool mask: real keys, within the window."""
    keep = None if key_padding_mask is None else key_padding_mask[:, None, None, :].to(torch.bool)
    band = window_keep(q.shape[-2], half_window, q.device)
    if band is not None:
        keep = band[None, None] if keep is None else keep & band[None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p if training else 0.0,
                                          scale=scale)


def reference_window_attention(q, k, v, key_padding_mask, *, half_window: int | None = None, dropout_p: float = 0.0,
                               training: bool = False, scale: float | None = None) -> torch.Tensor:
    """The padded oracle: ``reference_attention_math`` with the window."""
    return reference.reference_attention_math(q, k, v, key_padding_mask, dropout_p=dropout_p, training=training,
                                              scale=scale, half_window=half_window)


def reference_varlen_window_attention(q, k, v, packing: Packing, *, half_window: int | None = None,
                                      dropout_p: float = 0.0, training: bool = False,
                                      scale: float | None = None) -> torch.Tensor:
    """The packed oracle: one sequence at a time, softmax spelled out."""
    return reference.reference_varlen_attention(q, k, v, packing.cu_seqlens, packing.max_seqlen, dropout_p=dropout_p,
                                                training=training, scale=scale, half_window=half_window)


def sdpa_varlen_window_attention(q, k, v, packing: Packing, *, half_window: int | None = None, dropout_p: float = 0.0,
                                 training: bool = False, scale: float | None = None) -> torch.Tensor:
    """Re-pad to the longest sequence, SDPA with the padding+window mask, pack again."""
    attention = functools.partial(sdpa_window_attention, half_window=half_window)
    return varlen_attention_sdpa(q, k, v, packing.cu_seqlens, packing.max_seqlen, dropout_p=dropout_p,
                                 training=training, scale=scale, attention=attention)


def _flex_block_mask(packing: Packing, half_window: int | None, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    key = half_window
    if key not in packing.block_masks:
        sequence, position = packing.sequence, packing.position

        def same_sequence_in_window(b, h, q_idx, kv_idx):
            keep = sequence[q_idx] == sequence[kv_idx]
            if half_window is not None:
                keep = keep & ((position[q_idx] - position[kv_idx]).abs() <= half_window)
            return keep

        packing.block_masks[key] = create_block_mask(same_sequence_in_window, None, None, packing.total,
                                                     packing.total, device=device)
    return packing.block_masks[key]


def flex_varlen_window_attention(q, k, v, packing: Packing, *, half_window: int | None = None, dropout_p: float = 0.0,
                                 training: bool = False, scale: float | None = None) -> torch.Tensor:
    """FlexAttention over the packed row ``[1, H, T, D]`` with a same-sequence (and window) block mask."""
    if training and dropout_p > 0:
        raise ValueError(f"the flex attention backend has no attention dropout, and this call trains with "
                         f"dropout_p={dropout_p}; use attention_backend=sdpa")
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("FlexAttention has no backward on CPU (torch 2.14), and this call needs gradients; "
                         "train on CPU with attention_backend=sdpa (flex serves CPU inference and CUDA)")
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = _flex_block_mask(packing, half_window, q.device)
    rows = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, T, D]
    out = flex_attention(*rows, block_mask=block_mask, scale=scale)
    return out.squeeze(0).transpose(0, 1)


VarlenAttention = Callable[..., torch.Tensor]
VARLEN_BACKENDS: dict[str, VarlenAttention] = {
    "reference": reference_varlen_window_attention,
    "sdpa": sdpa_varlen_window_attention,
    "flex": flex_varlen_window_attention,
}
PADDED_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "reference": reference_window_attention,
    "sdpa": sdpa_window_attention,
    "flex": sdpa_window_attention,  # FlexAttention serves the packed path; padded batches take SDPA
}
