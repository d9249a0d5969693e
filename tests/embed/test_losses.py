"""Embedding and cross-encoder losses against hand computations, and against sentence-transformers'
own loss code (``compute_loss_from_embeddings``, which takes embeddings, so no model is built)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bertdist.embed.losses import (CoSENTLoss, CosineMSELoss, MatryoshkaLoss, MultipleNegativesRankingLoss,
                                   binary_ce, listwise_softmax_loss)

R = 1 / math.sqrt(2)  # cos 45 degrees

# q0 = (1, 0), q1 = (0, 1); p0 = (1, 0), p1 = (1, 1) (raw, not unit length: the loss normalises)
# cos(q0, p0) = 1, cos(q0, p1) = R, cos(q1, p0) = 0, cos(q1, p1) = R
Q = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
P = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
# one hard negative per query: n0 = (-1, 0), n1 = (0, -1)
# cos(q0, n0) = -1, cos(q0, n1) = 0, cos(q1, n0) = 0, cos(q1, n1) = -1
N = torch.tensor([[[-1.0, 0.0]], [[0.0, -1.0]]], dtype=torch.float64)


def test_mnrl_in_batch_by_hand():
    # scale 1: row 0 logits (1, R), target 0: log(e + e^R) - 1 = 0.557386
    #          row 1 logits (0, R), target 1: log(1 + e^R) - R = 0.400834
    loss = MultipleNegativesRankingLoss(scale=1.0)(Q, P)
    assert loss.item() == pytest.approx((0.557386 + 0.400834) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(((math.log(math.e + math.exp(R)) - 1) + (math.log(1 + math.exp(R)) - R)) / 2,
                                        abs=1e-12)


def test_mnrl_default_scale_is_20():
    # row 0: log(e^20 + e^(20R)) - 20; row 1: log(1 + e^(20R)) - 20R; mean 0.001427
    expected = ((math.log(math.exp(20) + math.exp(20 * R)) - 20) + (math.log(1 + math.exp(20 * R)) - 20 * R)) / 2
    assert expected == pytest.approx(0.001427, abs=1e-6)
    assert MultipleNegativesRankingLoss()(Q, P).item() == pytest.approx(expected, abs=1e-12)


def test_mnrl_hard_negatives_join_every_querys_candidates():
    # row 0 candidates (p0, p1, n0, n1): logits (1, R, -1, 0) -> log(e + e^R + e^-1 + 1) - 1 = 0.810626
    # row 1: (0, R, 0, -1), target 1 -> log(1 + e^R + 1 + e^-1) - R = 0.773587
    loss = MultipleNegativesRankingLoss(scale=1.0)
    expected = (0.810626 + 0.773587) / 2
    assert loss(Q, P, N).item() == pytest.approx(expected, abs=1e-6)
    assert loss(Q, P, N.reshape(2, 2)).item() == pytest.approx(expected, abs=1e-6)  # [B*K, H] form


def test_mnrl_symmetric_averages_both_directions():
    # positive -> query: p0 against (q0, q1): logits (1, 0), target 0 -> log(e + 1) - 1 = 0.313262
    #                    p1 against (q0, q1): logits (R, R), target 1 -> log 2 = 0.693147
    # the query -> positive mean is 0.479110 (test above); the two directions averaged:
    expected = (0.479110 + (0.313262 + 0.693147) / 2) / 2
    assert MultipleNegativesRankingLoss(scale=1.0, symmetric=True)(Q, P).item() == pytest.approx(expected, abs=1e-6)


def test_mnrl_is_scale_invariant_in_the_embeddings_and_checks_shapes():
    loss = MultipleNegativesRankingLoss(scale=1.0)
    assert loss(3 * Q, 0.5 * P).item() == pytest.approx(loss(Q, P).item(), abs=1e-12)
    with pytest.raises(ValueError, match=r"\(2, 2\) and \(3, 2\)"):
        loss(Q, torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[B=2, K, H=2\] or \[N, H=2\]; got \(2, 1, 3\)"):
        loss(Q, P, torch.zeros(2, 1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale must be positive"):
        MultipleNegativesRankingLoss(scale=0.0)


# a = (1, 0) three times; b = (1, 0), (0, 1), (1, 1): cos = (1, 0, R)
A3 = torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64)
B3 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)


def test_cosent_by_hand():
    # labels (5, 1, 3): label_i > label_j for (0, 1), (0, 2), (2, 1); scale 1:
    # log(1 + e^(0 - 1) + e^(R - 1) + e^(0 - R)) = log(1 + 0.367879 + 0.746104 + 0.493069) = 0.958219
    loss = CoSENTLoss(scale=1.0)(A3, B3, torch.tensor([5.0, 1.0, 3.0]))
    assert loss.item() == pytest.approx(0.958219, abs=1e-6)


def test_cosent_ignores_ties_and_only_the_order_of_labels_matters():
    # labels (5, 5, 5): no ordered pair -> log(1) = 0
    assert CoSENTLoss()(A3, B3, torch.tensor([5.0, 5.0, 5.0])).item() == 0.0
    a = CoSENTLoss()(A3, B3, torch.tensor([5.0, 1.0, 3.0])).item()
    b = CoSENTLoss()(A3, B3, torch.tensor([0.9, 0.1, 0.2])).item()
    assert a == pytest.approx(b, abs=1e-12)
    with pytest.raises(ValueError, match="3 pairs, 2 labels"):
        CoSENTLoss()(A3, B3, torch.tensor([1.0, 2.0]))


def test_cosine_mse_by_hand():
    # cos (1, 0, R) against labels (1, 0.5, 0.5): (0^2 + 0.5^2 + (R - 0.5)^2) / 3 = 0.097631
    loss = CosineMSELoss()(A3, B3, torch.tensor([1.0, 0.5, 0.5]))
    assert loss.item() == pytest.approx(0.097631, abs=1e-6)


def test_matryoshka_by_hand_over_cosine_mse():
    # a = (1, 0, 1), b = (1, 1, 0), label 0.6
    # d = 3: cos = 1 / 2 = 0.5            -> (0.5 - 0.6)^2 = 0.01
    # d = 2: (1, 0) vs (1, 1): cos = R    -> (R - 0.6)^2 = 0.011472
    # d = 1: (1) vs (1): cos = 1          -> (1 - 0.6)^2 = 0.16
    # weights (1, 0.5, 0.25): 0.01 + 0.005736 + 0.04 = 0.055736
    a = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss = MatryoshkaLoss(CosineMSELoss(), dims=[3, 2, 1], weights=[1.0, 0.5, 0.25])
    assert loss(a, b, scores=torch.tensor([0.6])).item() == pytest.approx(0.055736, abs=1e-6)


def test_matryoshka_over_mnrl_is_the_weighted_sum_on_renormalised_truncations():
    torch.manual_seed(0)
    q, p, n = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), \
        torch.randn(4, 2, 8, dtype=torch.float64)
    base = MultipleNegativesRankingLoss()
    dims, weights = [8, 4, 2], [1.0, 0.3, 0.7]
    want = sum(w * base(F.normalize(q[:, :d], dim=-1), F.normalize(p[:, :d], dim=-1),
                        F.normalize(n[..., :d], dim=-1)) for d, w in zip(dims, weights))
    got = MatryoshkaLoss(base, dims, weights)(q, p, n)
    assert got.item() == pytest.approx(want.item(), abs=1e-12)
    # no negatives: None passes through to the base loss
    no_negs = MatryoshkaLoss(base, dims)(q, p, None)
    assert no_negs.item() == pytest.approx(sum(base(q[:, :d], p[:, :d]).item() for d in dims), abs=1e-12)


def test_matryoshka_refuses_bad_dims():
    with pytest.raises(ValueError, match=r"dims \[16, 4\] exceed the embedding width 8"):
        MatryoshkaLoss(CosineMSELoss(), [16, 4])(torch.ones(1, 8), torch.ones(1, 8), scores=torch.ones(1))
    with pytest.raises(ValueError, match=r"2 Matryoshka weights \[1.0, 2.0\] for 3 dims \[8, 4, 2\]"):
        MatryoshkaLoss(CosineMSELoss(), [8, 4, 2], [1, 2])
    with pytest.raises(ValueError, match="repeat a width"):
        MatryoshkaLoss(CosineMSELoss(), [8, 8])


def test_listwise_softmax_by_hand():
    # scores (2, 1, 0), positive first: -log(e^2 / (e^2 + e + 1)) = log(1 + e^-1 + e^-2) = 0.407606
    assert listwise_softmax_loss(torch.tensor([[2.0, 1.0, 0.0]])).item() == pytest.approx(0.407606, abs=1e-6)
    # a second query whose positive scores lowest, (0, 1, 2): log(1 + e + e^2) = 2.407606
    two = listwise_softmax_loss(torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]))
    assert two.item() == pytest.approx((0.407606 + 2.407606) / 2, abs=1e-6)
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        listwise_softmax_loss(torch.tensor([1.0, 2.0, 3.0]))


def test_binary_ce_by_hand():
    # logits (0, 2), labels (1, 0): (-log sigmoid(0) - log(1 - sigmoid(2))) / 2 = (log 2 + log(1 + e^2)) / 2
    loss = binary_ce(torch.tensor([0.0, 2.0]), torch.tensor([1, 0]))
    assert loss.item() == pytest.approx(1.410038, abs=1e-6)
    with pytest.raises(ValueError, match=r"2 scores \(shape \(2,\)\) for 3 labels"):
        binary_ce(torch.tensor([0.0, 2.0]), torch.tensor([1, 0, 1]))


# ---------------------------------------------------------------- sentence-transformers' code
@pytest.fixture(scope="module")
def st_losses():
    from sentence_transformers.sentence_transformer import losses

    return losses


@pytest.mark.parametrize("negatives", [0, 3])
@pytest.mark.parametrize("symmetric", [False, True])
def test_mnrl_matches_sentence_transformers(st_losses, negatives, symmetric):
    torch.manual_seed(1)
    q, p, n = torch.randn(6, 16), torch.randn(6, 16), torch.randn(6, negatives, 16)
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    ref = st_losses.MultipleNegativesRankingLoss(None, scale=20.0, directions=directions,
                                                 partition_mode="per_direction")
    want = ref.compute_loss_from_embeddings([q, p] + [n[:, j] for j in range(negatives)], None)
    got = MultipleNegativesRankingLoss(20.0, symmetric=symmetric)(q, p, n if negatives else None)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_cosent_and_cosine_mse_match_sentence_transformers(st_losses):
    torch.manual_seed(2)
    a, b = torch.randn(10, 16), torch.randn(10, 16)
    labels = torch.tensor([0.0, 1.0, 1.0, 2.5, 3.0, 3.0, 4.0, 5.0, 0.5, 2.0]) / 5  # with ties
    want = st_losses.CoSENTLoss(None, scale=20.0).compute_loss_from_embeddings([a, b], labels)
    assert CoSENTLoss(20.0)(a, b, labels).item() == pytest.approx(want.item(), rel=1e-5)
    want = st_losses.CosineSimilarityLoss(None).compute_loss_from_embeddings([a, b], labels)
    assert CosineMSELoss()(a, b, labels).item() == pytest.approx(want.item(), rel=1e-5)
