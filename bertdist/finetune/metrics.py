"""Task metrics: GLUE (accuracy, F1, Matthews correlation, Pearson/Spearman), the
official SQuAD v1.1/v2.0 EM/F1 (with its answer normalisation), and entity-level
F1 for NER in the conlleval sense (IOB1 and IOB2 tag schemes).

Plain numpy/python so the numbers do not depend on which optional packages are installed.
"""
from __future__ import annotations

import collections
import re
import string
from typing import Iterable, Sequence

import numpy as np


# ---------------------------------------------------------------- classification / regression
def accuracy(preds: Sequence, labels: Sequence) -> float:
    p, y = np.asarray(preds), np.asarray(labels)
    return float((p == y).mean()) if len(y) else 0.0


def binary_f1(preds: Sequence[int], labels: Sequence[int], positive: int = 1) -> float:
    p, y = np.asarray(preds) == positive, np.asarray(labels) == positive
    tp, fp, fn = int((p & y).sum()), int((p & ~y).sum()), int((~p & y).sum())
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews_corrcoef(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Binary MCC; 0 when a row or column of the confusion matrix is empty (sklearn's convention)."""
    p, y = np.asarray(preds) == 1, np.asarray(labels) == 1
    tp, tn = float((p & y).sum()), float((~p & ~y).sum())
    fp, fn = float((p & ~y).sum()), float((~p & y).sum())
    denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return 0.0 if denom == 0 else float((tp * tn - fp * fn) / denom)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xc, yc = x - x.mean(), y - y.mean()
    denom = np.sqrt((xc * xc).sum() * (yc * yc).sum())
    return 0.0 if denom == 0 else float((xc * yc).sum() / denom)


def _ranks(a: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank (as scipy.stats.rankdata)."""
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=np.float64)
    sorted_a = a[order]
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and sorted_a[j + 1] == sorted_a[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    return pearson(_ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64)))


# ---------------------------------------------------------------- SQuAD (official evaluation script logic)
def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (the official SQuAD script)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def squad_exact(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def squad_f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:  # v2.0: no-answer is right only when both are empty
        return float(pred == gold)
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], gold: dict[str, list[str]]) -> dict[str, float]:
    """EM and F1 in percent, max over the gold answers; a question with no gold answers (v2.0)
    counts as answered correctly only by the empty string. Questions without a prediction score 0."""
    em = f1 = 0.0
    has_ans = [q for q, a in gold.items() if a]
    scores = {}
    for qid, answers in gold.items():
        pred = predictions.get(qid, None)
        truths = answers or [""]
        if pred is None:
            e = f = 0.0
        else:
            e = max(squad_exact(pred, t) for t in truths)
            f = max(squad_f1(pred, t) for t in truths)
        scores[qid] = (e, f)
        em += e
        f1 += f
    n = max(len(gold), 1)
    out = {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n, "total": len(gold)}
    if len(has_ans) != len(gold):  # v2.0 breakdown, as the official script reports
        no_ans = [q for q in gold if not gold[q]]
        for name, ids in (("HasAns", has_ans), ("NoAns", no_ans)):
            if ids:
                out[f"{name}_exact"] = 100.0 * sum(scores[q][0] for q in ids) / len(ids)
                out[f"{name}_f1"] = 100.0 * sum(scores[q][1] for q in ids) / len(ids)
                out[f"{name}_total"] = len(ids)
    return out


# ---------------------------------------------------------------- NER (conlleval)
def entity_spans(tags: Sequence[str], scheme: str = "IOB2") -> set[tuple[str, int, int]]:
    """(type, start, end_exclusive) entity chunks, following conlleval's chunk rules.

    IOB1: ``I-X`` continues or starts X; ``B-X`` only separates two adjacent X entities.
    IOB2: every entity starts with ``B-X``; conlleval still treats a stray ``I-X`` as a start.
    Both reduce to: a chunk starts at B-X, or at I-X whose previous tag is not X-typed (or O).
    """
    if scheme not in ("IOB1", "IOB2"):
        raise ValueError(f"unknown tag scheme {scheme!r} (IOB1 or IOB2)")
    spans = set()
    start, typ = None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, t = tag.partition("-") if tag != "O" else ("O", "", "")
        if prefix not in ("B", "I", "O"):
            raise ValueError(f"tag {tag!r} at position {i} is not O, B-X or I-X")
        begins = prefix == "B" or (prefix == "I" and t != typ)
        ends = prefix == "O" or begins
        if start is not None and ends:
            spans.add((typ, start, i))
            start, typ = None, None
        if begins:
            start, typ = i, t
    return spans


def entity_f1(pred_tags: Iterable[Sequence[str]], gold_tags: Iterable[Sequence[str]], scheme: str = "IOB2") -> dict:
    """Micro precision/recall/F1 over exact entity matches (type and boundaries), in percent."""
    tp = n_pred = n_gold = 0
    per_type: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for sent, (p, g) in enumerate(zip(pred_tags, gold_tags, strict=True)):
        if len(p) != len(g):
            raise ValueError(f"sentence {sent}: {len(p)} predicted tags for {len(g)} tokens")
        ps, gs = entity_spans(p, scheme), entity_spans(g, scheme)
        tp += len(ps & gs)
        n_pred += len(ps)
        n_gold += len(gs)
        for s in ps & gs:
            per_type[s[0]][0] += 1
        for s in ps:
            per_type[s[0]][1] += 1
        for s in gs:
            per_type[s[0]][2] += 1
    prec = tp / n_pred if n_pred else 0.0
    rec = tp / n_gold if n_gold else 0.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    out = {"precision": 100 * prec, "recall": 100 * rec, "f1": 100 * f1, "entities": n_gold}
    for t, (a, b, c) in sorted(per_type.items()):
        out[f"{t}_f1"] = 100 * (2 * a / (b + c)) if b + c else 0.0
    return out
