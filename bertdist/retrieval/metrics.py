"""Ranking metrics with binary relevance, and reciprocal rank fusion.

``ranked[i]`` is query i's ranked document ids (best first, no repeats); ``relevant[i]`` the set
of ids relevant to it (at least one). Each metric is the mean over queries of:

* recall@k: |relevant in the top k| / |relevant|;
* MRR@k: 1 / rank of the first relevant document in the top k (ranks from 1), 0 when none is;
* nDCG@k: DCG@k / IDCG@k, DCG@k = sum over relevant documents at rank r <= k of 1 / log2(r + 1),
  IDCG@k the DCG of the ideal ranking: min(|relevant|, k) relevant documents at ranks 1, 2, ...

Plain Python so the numbers do not depend on optional packages.
"""
from __future__ import annotations

import math
from typing import Hashable, Iterable, Sequence


def _check(ranked: Sequence[Sequence[Hashable]], relevant: Sequence[Iterable[Hashable]], k: int) -> list[set]:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if len(ranked) != len(relevant):
        raise ValueError(f"{len(ranked)} rankings for {len(relevant)} relevance sets: one of each per query")
    if not ranked:
        raise ValueError("no queries to score")
    sets = []
    for i, (r, rel) in enumerate(zip(ranked, relevant)):
        rel = set(rel)
        if not rel:
            raise ValueError(f"query {i} has no relevant document: recall and nDCG are undefined for it")
        top = list(r[:k])
        if len(set(top)) != len(top):
            dup = next(d for j, d in enumerate(top) if d in top[:j])
            raise ValueError(f"query {i}: document {dup!r} appears twice in its top {k}")
        sets.append(rel)
    return sets


def recall_at_k(ranked: Sequence[Sequence[Hashable]], relevant: Sequence[Iterable[Hashable]], k: int) -> float:
    sets = _check(ranked, relevant, k)
    return sum(len(rel.intersection(r[:k])) / len(rel) for r, rel in zip(ranked, sets)) / len(sets)


def mrr_at_k(ranked: Sequence[Sequence[Hashable]], relevant: Sequence[Iterable[Hashable]], k: int) -> float:
    sets = _check(ranked, relevant, k)
    total = 0.0
    for r, rel in zip(ranked, sets):
        total += next((1.0 / (i + 1) for i, d in enumerate(r[:k]) if d in rel), 0.0)
    return total / len(sets)


def ndcg_at_k(ranked: Sequence[Sequence[Hashable]], relevant: Sequence[Iterable[Hashable]], k: int) -> float:
    sets = _check(ranked, relevant, k)
    total = 0.0
    for r, rel in zip(ranked, sets):
        dcg = sum(1.0 / math.log2(i + 2) for i, d in enumerate(r[:k]) if d in rel)
        idcg = sum(1.0 / math.log2(i + 2) for i in range(min(len(rel), k)))
        total += dcg / idcg
    return total / len(sets)


def retrieval_scores(ranked: Sequence[Sequence[Hashable]], relevant: Sequence[Iterable[Hashable]],
                     ks: Sequence[int] = (1, 5, 10, 100)) -> dict[str, float]:
    """``recall@k``, ``mrr@k`` and ``ndcg@k`` for each k, plus the query count."""
    out: dict[str, float] = {}
    for k in ks:
        out[f"recall@{k}"] = recall_at_k(ranked, relevant, k)
        out[f"mrr@{k}"] = mrr_at_k(ranked, relevant, k)
        out[f"ndcg@{k}"] = ndcg_at_k(ranked, relevant, k)
    out["queries"] = len(ranked)
    return out


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hashable]], k: int = 60) -> list[tuple[Hashable, float]]:
    """One query's rankings from several systems fused (Cormack et al., 2009): each document scores
    ``sum over the rankings that hold it of 1 / (k + rank)``, ranks from 1. Returns (id, score),
    best first; equal scores keep the order in which the documents first appear (the first
    ranking's order, then the next's)."""
    if isinstance(k, bool) or not isinstance(k, (int, float)) or k < 0:
        raise ValueError(f"the RRF constant k must be a non-negative number, got {k!r}")
    scores: dict[Hashable, float] = {}
    for n, ranking in enumerate(rankings):
        if len(set(ranking)) != len(ranking):
            dup = next(d for j, d in enumerate(ranking) if d in ranking[:j])
            raise ValueError(f"ranking {n} lists document {dup!r} twice")
        for rank, doc in enumerate(ranking, 1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda item: -item[1])  # stable: ties keep first appearance
