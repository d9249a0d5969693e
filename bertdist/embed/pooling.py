"""Sentence embeddings from an encoder's last hidden states.

``pool`` turns ``[B, S, H]`` token states into ``[B, H]``:

* ``mean``: the average over the real tokens (``attention_mask`` 1), padding excluded;
* ``cls``: the state at position 0 (BERT's ``[CLS]``; inputs are right-padded);
* ``max``: the per-dimension maximum over the real tokens, padding excluded.

A row with no real token pools to zeros in every mode but ``cls`` (a guard here would need a
host-device sync on every batch). Pooling runs in float32: a bf16 sum over hundreds of tokens
loses digits that the cosine similarities then inherit.

``EmbeddingHead`` adds what a sentence-embedding model fixes once and saves with its weights:
the pooling mode, L2 normalisation, and a truncation width for Matryoshka-trained models
(``truncate_dim``: the first d dimensions, taken before normalising, so the served vectors are
unit length). Training with ``MatryoshkaLoss`` uses the full width; set ``truncate_dim`` for
inference.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

POOLING_MODES = ("mean", "cls", "max")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """``[B, S, H]`` hidden states and a ``[B, S]`` mask (1 on real tokens) to ``[B, H]`` float32."""
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {mode!r} is not one of {list(POOLING_MODES)}")
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"pool expects hidden [B, S, H] and attention_mask [B, S]; got hidden "
                         f"{tuple(hidden.shape)} and attention_mask {tuple(attention_mask.shape)}")
    h = hidden.float()
    if mode == "cls":
        return h[:, 0]
    m = attention_mask.to(dtype=torch.bool, device=h.device).unsqueeze(-1)  # [B, S, 1]
    if mode == "mean":
        count = m.sum(1).clamp(min=1)  # an empty row: 0 / 1 = zeros, not NaN
        return (h * m).sum(1) / count
    out = h.masked_fill(~m, float("-inf")).amax(1)
    return torch.where(m.any(1), out, torch.zeros_like(out))


class EmbeddingHead(nn.Module):
    """Pooling, optional truncation and optional L2 normalisation; no parameters of its own."""

    def __init__(self, pooling: str = "mean", normalize: bool = True, truncate_dim: int | None = None):
        super().__init__()
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling mode {pooling!r} is not one of {list(POOLING_MODES)}")
        if truncate_dim is not None and (isinstance(truncate_dim, bool) or not isinstance(truncate_dim, int)
                                         or truncate_dim < 1):
            raise ValueError(f"truncate_dim must be a positive integer or None, got {truncate_dim!r}")
        self.pooling = pooling
        self.normalize = bool(normalize)
        self.truncate_dim = truncate_dim

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        emb = pool(hidden, attention_mask, self.pooling)
        if self.truncate_dim is not None:
            if self.truncate_dim > emb.shape[-1]:
                raise ValueError(f"truncate_dim {self.truncate_dim} is wider than the embeddings ({emb.shape[-1]})")
            emb = emb[:, :self.truncate_dim]
        return F.normalize(emb, p=2, dim=-1) if self.normalize else emb

    def config(self) -> dict:
        return {"pooling": self.pooling, "normalize": self.normalize, "truncate_dim": self.truncate_dim}

    @classmethod
    def from_config(cls, cfg: dict) -> "EmbeddingHead":
        unknown = sorted(set(cfg) - {"pooling", "normalize", "truncate_dim"})
        if unknown:
            raise ValueError(f"embedding head config has unknown keys {unknown}; known: pooling, normalize, "
                             "truncate_dim")
        return cls(**cfg)

    def extra_repr(self) -> str:
        return f"pooling={self.pooling}, normalize={self.normalize}, truncate_dim={self.truncate_dim}"
