"""Ranking metrics and RRF against hand-computed values."""
from __future__ import annotations

import math

import pytest

from bertdist.retrieval.metrics import (mrr_at_k, ndcg_at_k, recall_at_k, reciprocal_rank_fusion,
                                        retrieval_scores)

ONE = [["d1", "d2", "d3", "d4"]]
ONE_REL = [{"d3"}]  # relevant at rank 3


def test_single_relevant_at_rank_3():
    assert recall_at_k(ONE, ONE_REL, 2) == 0.0
    assert recall_at_k(ONE, ONE_REL, 3) == 1.0
    assert mrr_at_k(ONE, ONE_REL, 10) == pytest.approx(1 / 3)
    assert mrr_at_k(ONE, ONE_REL, 2) == 0.0
    # DCG = 1 / log2(3 + 1) = 0.5; IDCG = 1 / log2(2) = 1
    assert ndcg_at_k(ONE, ONE_REL, 10) == pytest.approx(0.5)
    assert ndcg_at_k(ONE, ONE_REL, 2) == 0.0


# relevant {a, c, x}: a at rank 1, c at rank 3, x never retrieved
MANY = [["a", "b", "c", "d", "e"]]
MANY_REL = [{"a", "c", "x"}]


def test_several_relevant():
    assert recall_at_k(MANY, MANY_REL, 5) == pytest.approx(2 / 3)
    assert recall_at_k(MANY, MANY_REL, 2) == pytest.approx(1 / 3)
    assert mrr_at_k(MANY, MANY_REL, 5) == 1.0
    # k = 5: DCG = 1/log2(2) + 1/log2(4) = 1.5; IDCG = 1 + 1/log2(3) + 1/log2(4) = 2.130930 (3 relevant)
    assert ndcg_at_k(MANY, MANY_REL, 5) == pytest.approx(0.703918, abs=1e-6)
    # k = 2: DCG = 1; IDCG capped at 2 documents = 1 + 1/log2(3) = 1.630930
    assert ndcg_at_k(MANY, MANY_REL, 2) == pytest.approx(0.613147, abs=1e-6)


def test_means_over_queries():
    ranked, relevant = ONE + MANY, ONE_REL + MANY_REL
    assert recall_at_k(ranked, relevant, 5) == pytest.approx((1 + 2 / 3) / 2)
    assert mrr_at_k(ranked, relevant, 5) == pytest.approx((1 / 3 + 1) / 2)
    assert ndcg_at_k(ranked, relevant, 5) == pytest.approx((0.5 + 0.703918) / 2, abs=1e-6)
    scores = retrieval_scores(ranked, relevant, ks=(1, 5))
    assert scores == pytest.approx({"recall@1": (0 + 1 / 3) / 2, "mrr@1": 0.5, "ndcg@1": 0.5,
                                    "recall@5": (1 + 2 / 3) / 2, "mrr@5": (1 / 3 + 1) / 2,
                                    "ndcg@5": (0.5 + 0.703918) / 2, "queries": 2}, abs=1e-6)


def test_integer_ids_and_short_rankings():
    assert ndcg_at_k([[7, 3]], [{3}], 10) == pytest.approx(1 / math.log2(3))
    assert recall_at_k([[]], [{3}], 10) == 0.0


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match="1 rankings for 2 relevance sets"):
        recall_at_k(ONE, ONE_REL * 2, 5)
    with pytest.raises(ValueError, match="query 1 has no relevant document"):
        ndcg_at_k(ONE * 2, [{"d1"}, set()], 5)
    with pytest.raises(ValueError, match="query 0: document 'd1' appears twice in its top 3"):
        mrr_at_k([["d1", "d2", "d1"]], ONE_REL, 3)
    with pytest.raises(ValueError, match="k must be a positive integer, got 0"):
        recall_at_k(ONE, ONE_REL, 0)
    with pytest.raises(ValueError, match="no queries"):
        recall_at_k([], [], 1)


def test_rrf_by_hand():
    # k = 60: a 1/61 = 0.016393; b 1/62 + 1/61 = 0.032522; c 1/63 + 1/62 = 0.032002; d 1/63 = 0.015873
    fused = reciprocal_rank_fusion([["a", "b", "c"], ["b", "c", "d"]])
    assert [d for d, _ in fused] == ["b", "c", "a", "d"]
    assert [s for _, s in fused] == pytest.approx([0.032522, 0.032002, 0.016393, 0.015873], abs=1e-6)


def test_rrf_ties_keep_first_appearance_and_k_changes_scores():
    # x: 1/61 + 1/62, y: 1/62 + 1/61: equal -> x first (it appears first)
    assert [d for d, _ in reciprocal_rank_fusion([["x", "y"], ["y", "x"]])] == ["x", "y"]
    # k = 0: plain reciprocal ranks: p = 1/1 + 1/3, q = 1/2 + 1/1
    fused = dict(reciprocal_rank_fusion([["p", "q"], ["q", "r", "p"]], k=0))
    assert fused == pytest.approx({"p": 1 + 1 / 3, "q": 1.5, "r": 0.5})
    with pytest.raises(ValueError, match="ranking 1 lists document 'q' twice"):
        reciprocal_rank_fusion([["p"], ["q", "q"]])
