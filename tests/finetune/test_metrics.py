"""Metric implementations against known values: sklearn/scipy and hand-checked SQuAD and conlleval cases."""
from __future__ import annotations

import numpy as np
import pytest

from bertdist.finetune import metrics as M


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_metrics_match_sklearn(seed):
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 500)
    p = np.where(rng.random(500) < 0.7, y, 1 - y)
    assert M.accuracy(p, y) == pytest.approx(accuracy_score(y, p), abs=1e-12)
    assert M.binary_f1(p, y) == pytest.approx(f1_score(y, p), abs=1e-12)
    assert M.matthews_corrcoef(p, y) == pytest.approx(matthews_corrcoef(y, p), abs=1e-12)


def test_mcc_degenerate_and_hand_values():
    from sklearn.metrics import matthews_corrcoef

    assert M.matthews_corrcoef([1, 1, 1, 1], [1, 0, 1, 0]) == 0.0 == matthews_corrcoef([1, 0, 1, 0], [1, 1, 1, 1])
    # tp=2 tn=1 fp=1 fn=0: (2*1 - 1*0) / sqrt(3*2*2*1) = 2/sqrt(12)
    assert M.matthews_corrcoef([1, 1, 1, 0], [1, 1, 0, 0]) == pytest.approx(2 / np.sqrt(12))
    assert M.binary_f1([0, 0], [1, 1]) == 0.0


def test_correlations_match_scipy_with_ties():
    from scipy.stats import pearsonr, spearmanr

    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, 300).astype(float)  # many ties, like STS-B's 0-5 scores
    y = x + rng.normal(0, 1.5, 300)
    assert M.pearson(x, y) == pytest.approx(pearsonr(x, y)[0], abs=1e-10)
    assert M.spearman(x, y) == pytest.approx(spearmanr(x, y)[0], abs=1e-10)
    assert M.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_squad_normalization_hand_checked():
    assert M.normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert M.normalize_answer("an apple, a pear & the plum") == "apple pear plum"
    assert M.normalize_answer("Theory") == "theory"  # 'the' only as a whole word
    assert M.squad_exact("the Denver Broncos", "Denver Broncos") == 1.0
    # pred "denver broncos team" vs gold "broncos": overlap 1, P=1/3, R=1 -> F1 = 0.5
    assert M.squad_f1("Denver Broncos team", "Broncos") == pytest.approx(0.5)
    assert M.squad_f1("Santa Clara, California", "Levi's Stadium") == 0.0
    assert M.squad_f1("", "") == 1.0 and M.squad_f1("x", "") == 0.0


def test_squad_scores_max_over_gold_and_v2_no_answer():
    gold = {"q1": ["Denver Broncos", "Broncos"], "q2": ["1990"], "q3": []}
    preds = {"q1": "the Broncos", "q2": "in 1990 and 1991", "q3": ""}
    s = M.squad_scores(preds, gold)
    # q1 exact (vs "Broncos"); q2 F1: pred [in,1990,and,1991] vs [1990] -> P=1/4 R=1 -> 0.4; q3 no-answer right
    assert s["exact_match"] == pytest.approx(100 * 2 / 3)
    assert s["f1"] == pytest.approx(100 * (1 + 0.4 + 1) / 3)
    assert s["HasAns_total"] == 2 and s["NoAns_exact"] == 100.0
    assert M.squad_scores({}, {"q": ["a"]})["f1"] == 0.0  # missing predictions count as wrong


def test_entity_spans_iob1_and_iob2():
    # IOB1: I- opens an entity; B- only splits two adjacent entities of the same type
    iob1 = ["I-PER", "I-PER", "B-PER", "O", "I-LOC", "I-ORG"]
    assert M.entity_spans(iob1, "IOB1") == {("PER", 0, 2), ("PER", 2, 3), ("LOC", 4, 5), ("ORG", 5, 6)}
    iob2 = ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "B-ORG"]
    assert M.entity_spans(iob2, "IOB2") == M.entity_spans(iob1, "IOB1")


def test_entity_f1_hand_checked():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]  # 2 of 3 right, 3 predicted
    r = M.entity_f1(pred, gold)
    assert r["precision"] == pytest.approx(200 / 3) and r["recall"] == pytest.approx(200 / 3)
    assert r["f1"] == pytest.approx(200 / 3)
    # a boundary error is a miss: PER predicted over one token only
    r = M.entity_f1([["B-PER", "O"]], [["B-PER", "I-PER"]])
    assert r["f1"] == 0.0
    with pytest.raises(ValueError, match="2 predicted tags for 3 tokens"):
        M.entity_f1([["O", "O"]], [["O", "O", "O"]])



def test_entity_spans_conlleval_edge_cases():
    # a stray I- after O or after another type starts a new chunk (conlleval), in either scheme
    assert M.entity_spans(["O", "I-PER", "I-LOC", "I-LOC"], "IOB2") == {("PER", 1, 2), ("LOC", 2, 4)}
    assert M.entity_spans(["B-PER", "I-LOC"], "IOB2") == {("PER", 0, 1), ("LOC", 1, 2)}
    assert M.entity_spans(["B-PER"], "IOB2") == {("PER", 0, 1)}  # an entity at the end of the sentence
    with pytest.raises(ValueError, match="not O, B-X or I-X"):
        M.entity_spans(["X-PER"])
