"""Our entity-level F1 against seqeval (the conlleval port HF's NER examples use) on real CoNLL-2003
slices: the original IOB1 files and the IOB2 conversion. Predictions are the gold tags with seeded
corruptions (wrong types, stray I-, broken boundaries), so every chunk rule is exercised."""
from __future__ import annotations

import random

import numpy as np
import pytest

from bertdist.finetune import metrics as M
from bertdist.finetune import ner as N

seqeval_metrics = pytest.importorskip("seqeval.metrics")
pytestmark = pytest.mark.shared

LAYOUTS = [("original_iob1", "eng.testa", "IOB1"), ("iob2_kamalkraj", "valid.txt", "IOB2")]


def corrupt(tags: list[list[str]], labels: list[str], seed: int, rate: float = 0.1) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(labels) if rng.random() < rate else t for t in sent] for sent in tags]


def _seqeval(gold, pred, **kw) -> dict:
    out = {"precision": seqeval_metrics.precision_score(gold, pred, **kw),
           "recall": seqeval_metrics.recall_score(gold, pred, **kw),
           "f1": seqeval_metrics.f1_score(gold, pred, **kw)}
    report = seqeval_metrics.classification_report(gold, pred, output_dict=True, **kw)
    out.update({f"{t}_f1": r["f1-score"] for t, r in report.items() if " avg" not in t})
    return {k: 100 * v for k, v in out.items()}


def _assert_same(ours: dict, theirs: dict):
    per_type = {k for k in theirs if k.endswith("_f1")}
    assert per_type and per_type <= set(ours)
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, abs=1e-9), k


@pytest.mark.parametrize("layout,name,scheme", LAYOUTS)
def test_entity_f1_matches_seqeval_on_conll(shared_data, layout, name, scheme):
    sents = N.read_conll(shared_data / "conll2003" / layout / name, limit=1000)
    assert N.detect_scheme(sents) == scheme
    gold = [s.tags for s in sents]
    labels = N.label_set(sents)
    for seed in range(3):
        pred = corrupt(gold, labels, seed)
        ours = M.entity_f1(pred, gold, scheme)
        assert 50 < ours["f1"] < 95  # the corruptions hit, and most entities survive
        # seqeval's default mode follows conlleval's chunk rules, which read IOB1 and IOB2 alike
        _assert_same(ours, _seqeval(gold, pred))
        # strict IOB2 mode on our IOB2 conversion of both sides: the conversion keeps every entity
        from seqeval.scheme import IOB2

        strict = _seqeval([N.to_iob2(t, scheme) for t in gold], [N.to_iob2(t, scheme) for t in pred],
                          mode="strict", scheme=IOB2)
        _assert_same(ours, strict)


@pytest.mark.parametrize("layout,name,scheme", LAYOUTS)
def test_ner_runner_dev_f1_matches_seqeval(shared_data, layout, name, scheme):
    """The F1 that fine-tuning reports (NerRunner.score: IOB2 predictions vs the file's own tags)."""
    from bertdist.export import bert_tokenizer
    from bertdist.finetune import FinetuneConfig
    from bertdist.finetune.tasks import make_runner

    data = shared_data / "conll2003" / layout
    tok = bert_tokenizer(shared_data / "vocab" / "bert-base-cased-vocab.txt", False)
    cfg = FinetuneConfig(task="ner", data=str(data), max_train_examples=500, max_eval_examples=400)
    runner = make_runner("ner", data, tok, cfg)
    (dev,) = runner.eval_sets()
    iob2_gold = [N.to_iob2(s.tags, scheme) for s in dev.context]
    pred = corrupt(iob2_gold, runner.label_names, seed=7)
    logits = []
    for f, tags in zip(dev.features, pred):  # one-hot logits at each word's first sub-token
        lg = np.zeros((len(f["input_ids"]), runner.num_labels), dtype=np.float32)
        for w, j in enumerate(f["_first_token"]):
            if j is not None:
                lg[j, runner.label_names.index(tags[w])] = 1.0
        logits.append(lg)
    metrics, rows = runner.score(dev, logits)
    assert metrics["scheme"] == scheme and metrics["entities"] > 300
    assert [r["gold"] for r in rows] == [s.tags for s in dev.context]  # the file's own scheme
    theirs = _seqeval([r["gold"] for r in rows], [r["prediction"] for r in rows])
    _assert_same(metrics, theirs)
