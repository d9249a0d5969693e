"""Losses for sentence embeddings and cross-encoders, over embeddings or scores (not over a model).

Bi-encoder losses take ``[B, H]`` embeddings; they compare them by cosine similarity, so they
normalise internally and accept raw pooled vectors:

* ``MultipleNegativesRankingLoss`` (InfoNCE with in-batch negatives): query i's target is
  positive i among all the batch's positives and hard negatives, logits = ``scale * cos``;
  ``symmetric`` averages in the positive -> query direction (positive i against all queries).
  ``scale = 20`` is temperature 0.05. The same loss as sentence-transformers'
  ``MultipleNegativesRankingLoss`` (``directions=("query_to_doc", "doc_to_query")``,
  ``partition_mode="per_direction"`` for the symmetric form);
* ``CoSENTLoss``: ``log(1 + sum over pairs with label_i > label_j of exp(scale * (cos_j - cos_i)))``
  (Su, 2022): only the order of the labels matters;
* ``CosineMSELoss``: ``mean((cos(a, b) - label)^2)``; labels on the cosine's scale (STS-B's 0-5
  divided by 5);
* ``MatryoshkaLoss``: a base loss on the first d dimensions of the embeddings, for each d, summed
  with weights. The cosine in the base loss re-normalises each truncated vector.

Cross-encoder losses take scores (logits): ``listwise_softmax_loss`` over ``[B, 1 + K]``
(the positive in column 0) and ``binary_ce`` over pointwise relevance labels.

Half-precision inputs are computed in float32; float64 stays float64.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[N, H] x [M, H] -> [N, M]`` cosine similarities."""
    return F.normalize(_wide(a), p=2, dim=-1) @ F.normalize(_wide(b), p=2, dim=-1).T


def cosine_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[B, H] x [B, H] -> [B]`` cosine similarity of row i with row i."""
    return (F.normalize(_wide(a), p=2, dim=-1) * F.normalize(_wide(b), p=2, dim=-1)).sum(-1)


def _check_pairs(name: str, a: torch.Tensor, b: torch.Tensor, labels: torch.Tensor | None = None) -> None:
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(f"{name} expects two [B, H] embedding tensors of one shape; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if labels is not None and labels.numel() != a.shape[0]:
        raise ValueError(f"{name} expects one label per pair: {a.shape[0]} pairs, {labels.numel()} labels "
                         f"(shape {tuple(labels.shape)})")


def flat_negatives(negatives: torch.Tensor | None, batch: int, width: int) -> torch.Tensor | None:
    """Hard negatives ``[B, K, H]`` (K per query) or ``[N, H]`` (any number) as ``[N, H]``."""
    if negatives is None:
        return None
    if negatives.dim() == 3 and negatives.shape[0] == batch and negatives.shape[2] == width:
        return negatives.reshape(-1, width)
    if negatives.dim() == 2 and negatives.shape[1] == width:
        return negatives
    raise ValueError(f"hard negatives must be [B={batch}, K, H={width}] or [N, H={width}]; got "
                     f"{tuple(negatives.shape)}")


def mnrl(query: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor | None, offset: int,
         scale: float, symmetric: bool = False, queries: torch.Tensor | None = None) -> torch.Tensor:
    """The ranking loss of ``query`` [b, H] whose positives are rows ``offset .. offset + b`` of
    ``positives`` [P, H], the other rows and ``negatives`` [N, H] being its negatives. Symmetric:
    those b positives are also ranked against ``queries`` [P, H] (all queries; ``query`` is rows
    ``offset .. offset + b`` of it), and the two directions are averaged. On one process
    ``offset`` is 0 and ``positives`` the batch's; across ranks they are the gathered ones."""
    b = query.shape[0]
    if offset < 0 or offset + b > positives.shape[0]:
        raise ValueError(f"{b} queries at offset {offset} have no positives among the {positives.shape[0]} given")
    targets = torch.arange(offset, offset + b, device=query.device)
    candidates = positives if negatives is None else torch.cat([positives, negatives.to(positives.dtype)], 0)
    loss = F.cross_entropy(cosine_matrix(query, candidates) * scale, targets)
    if symmetric:
        if queries is None or queries.shape[0] != positives.shape[0]:
            have = None if queries is None else tuple(queries.shape)
            raise ValueError(f"the symmetric loss needs all {positives.shape[0]} queries, got {have}")
        mine = positives[offset:offset + b]
        loss = (loss + F.cross_entropy(cosine_matrix(mine, queries) * scale, targets)) / 2
    return loss


class MultipleNegativesRankingLoss(nn.Module):
    """``forward(query [B, H], positive [B, H], negatives [B, K, H] | [N, H] | None)``."""

    def __init__(self, scale: float = 20.0, symmetric: bool = False):
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be positive (it is 1 / temperature), got {scale}")
        self.scale = float(scale)
        self.symmetric = bool(symmetric)

    def forward(self, query: torch.Tensor, positive: torch.Tensor,
                negatives: torch.Tensor | None = None) -> torch.Tensor:
        _check_pairs("MultipleNegativesRankingLoss", query, positive)
        negs = flat_negatives(negatives, query.shape[0], query.shape[1])
        return mnrl(query, positive, negs, 0, self.scale, self.symmetric, queries=query)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, symmetric={self.symmetric}"


class CoSENTLoss(nn.Module):
    """``forward(a [B, H], b [B, H], scores [B])``: pairs with a higher gold score must get a higher
    cosine. Ties in the gold score add no term."""

    def __init__(self, scale: float = 20.0):
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = float(scale)

    def forward(self, a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _check_pairs("CoSENTLoss", a, b, scores)
        s = cosine_pairs(a, b) * self.scale
        y = scores.reshape(-1).to(s.device)
        diff = s[None, :] - s[:, None]  # [i, j] = s_j - s_i
        diff = diff.masked_fill(~(y[:, None] > y[None, :]), float("-inf"))
        return torch.logsumexp(torch.cat([s.new_zeros(1), diff.reshape(-1)]), 0)  # the 0 is log(1)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class CosineMSELoss(nn.Module):
    """``forward(a [B, H], b [B, H], scores [B])``: mean squared error between cos(a, b) and the score."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _check_pairs("CosineMSELoss", a, b, scores)
        cos = cosine_pairs(a, b)
        return F.mse_loss(cos, scores.reshape(-1).to(device=cos.device, dtype=cos.dtype))


class MatryoshkaLoss(nn.Module):
    """``sum_d w_d * base_loss(e_1[..., :d], e_2[..., :d], ..., **kwargs)`` over ``dims``.

    Positional arguments are embeddings (each truncated; ``None`` passes through, e.g. no hard
    negatives); keyword arguments reach the base loss unchanged (``scores=`` for CoSENT)."""

    def __init__(self, base_loss: nn.Module, dims: Sequence[int], weights: Sequence[float] | None = None):
        super().__init__()
        dims = list(dims)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"Matryoshka dims must be positive integers, got {dims}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"Matryoshka dims {dims} repeat a width")
        weights = [1.0] * len(dims) if weights is None else [float(w) for w in weights]
        if len(weights) != len(dims):
            raise ValueError(f"{len(weights)} Matryoshka weights {weights} for {len(dims)} dims {dims}")
        self.base_loss = base_loss
        self.dims = dims
        self.weights = weights

    def forward(self, *embeddings: torch.Tensor | None, **kwargs) -> torch.Tensor:
        widths = {e.shape[-1] for e in embeddings if e is not None}
        if len(widths) != 1:
            raise ValueError(f"Matryoshka embeddings must share one width; got widths {sorted(widths)}")
        width = widths.pop()
        if max(self.dims) > width:
            raise ValueError(f"Matryoshka dims {self.dims} exceed the embedding width {width}")
        total = None
        for d, w in zip(self.dims, self.weights):
            cut = [None if e is None else e[..., :d] for e in embeddings]
            term = w * self.base_loss(*cut, **kwargs)
            total = term if total is None else total + term
        return total

    def extra_repr(self) -> str:
        return f"dims={self.dims}, weights={self.weights}"


# ---------------------------------------------------------------- cross-encoders
def listwise_softmax_loss(scores: torch.Tensor) -> torch.Tensor:
    """``[B, 1 + K]`` scores of each query's positive (column 0) and K negatives: the mean of
    ``-log softmax(scores)[0]``."""
    if scores.dim() != 2 or scores.shape[1] < 2:
        raise ValueError(f"listwise scores must be [B, 1 + K] with K >= 1 (the positive in column 0); "
                         f"got {tuple(scores.shape)}")
    s = _wide(scores)
    return F.cross_entropy(s, torch.zeros(s.shape[0], dtype=torch.long, device=s.device))


def binary_ce(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of relevance logits against labels in [0, 1] (soft labels allowed)."""
    if scores.numel() != labels.numel():
        raise ValueError(f"binary_ce: {scores.numel()} scores (shape {tuple(scores.shape)}) for {labels.numel()} "
                         f"labels (shape {tuple(labels.shape)})")
    s = _wide(scores).reshape(-1)
    return F.binary_cross_entropy_with_logits(s, labels.reshape(-1).to(device=s.device, dtype=s.dtype))
