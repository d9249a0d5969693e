"""Every task end to end with the tiny model: real slices of ../shared/data where it has the task
(CoLA, SST-2, MRPC, STS-B, RTE, SQuAD v1.1, CoNLL-2003 IOB1 and IOB2), small fixture files in the
real formats for the others (MNLI, QNLI, QQP, WNLI, SWAG, SQuAD v2.0). A few optimizer steps each:
these check the plumbing and that metrics.json agrees with the prediction files, not learning
(test_learning.py does that)."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from bertdist.finetune import FinetuneConfig, run_finetune
from tests.finetune import fixtures

pytestmark = pytest.mark.shared

FAST = dict(max_seq_length=64, batch_size=8, eval_batch_size=32, max_steps=3, epochs=1, progress=False,
            kernels="reference", learning_rate=1e-4)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, shared_data):
    return fixtures.tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_hf"),
                                       shared_data / "vocab" / "bert-base-uncased-vocab.txt")


def _run(tmp_path, ckpt, task, data, **kw):
    cfg = FinetuneConfig(task=task, checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / task),
                         **{**FAST, **kw})
    summary = run_finetune(cfg)
    on_disk = json.loads((tmp_path / task / "metrics.json").read_text())
    assert on_disk["best"]["metrics"] == json.loads(json.dumps(summary["best"]["metrics"]))
    assert len(summary["runs"]) >= 1 and summary["runs"][0]["steps"] == kw.get("max_steps", FAST["max_steps"])
    assert summary["runs"][0]["epoch"] == 1 and summary["world_size"] == 1
    first = summary["runs"][0]
    assert list((tmp_path / task / f"lr{first['lr']:g}_seed{first['seed']}" / "tensorboard").iterdir())
    return summary, tmp_path / task


GLUE_SHARED = {  # task, dir, metric keys
    "cola": ("CoLA", {"mcc", "accuracy"}),
    "sst2": ("SST-2", {"accuracy"}),
    "mrpc": ("MRPC", {"f1", "accuracy"}),
    "stsb": ("STS-B", {"pearson", "spearman"}),
    "rte": ("RTE", {"accuracy"}),
}


@pytest.mark.parametrize("task", list(GLUE_SHARED))
def test_glue_shared_slice(tmp_path, tiny_ckpt, shared_data, task):
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    from scipy.stats import pearsonr

    sub, keys = GLUE_SHARED[task]
    s, out = _run(tmp_path, tiny_ckpt, task, shared_data / "glue" / sub, max_train_examples=48, max_eval_examples=40)
    m = s["best"]["metrics"]["dev"]
    assert set(m) == keys
    rows = json.loads((out / "predictions" / "dev.json").read_text())
    assert len(rows) == 40
    # recompute the metric from the prediction file with sklearn/scipy
    if task == "stsb":
        assert m["pearson"] == pytest.approx(pearsonr([r["prediction"] for r in rows], [r["label"] for r in rows])[0],
                                             abs=1e-6)
    else:
        p = [r["prediction"] for r in rows]
        y = [r["label"] for r in rows]
        assert m["accuracy"] == pytest.approx(accuracy_score(y, p))
        if task == "cola":
            assert m["mcc"] == pytest.approx(matthews_corrcoef(y, p), abs=1e-9)
        if task == "mrpc":
            assert m["f1"] == pytest.approx(f1_score(y, p, pos_label="1", zero_division=0.0), abs=1e-9)
    # the GLUE submission file for the test split
    sub_file = out / "glue_submission" / f"{sub}.tsv"
    lines = sub_file.read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 41
    if task == "stsb":
        assert all(0.0 <= float(l.split("\t")[1]) <= 5.0 for l in lines[1:])
    if task == "sst2":
        assert s["majority_baseline"]["dev"]["accuracy"] >= 0.5


@pytest.mark.parametrize("task", ["mnli", "qnli", "qqp", "wnli"])
def test_glue_fixture_tasks(tmp_path, tiny_ckpt, task):
    data = tmp_path / "data"
    if task == "mnli":
        fixtures.write_mnli(data)
    else:
        fixtures.write_pair_task(data, task)
    s, out = _run(tmp_path, tiny_ckpt, task, data)
    metrics = s["best"]["metrics"]
    if task == "mnli":
        assert set(metrics) == {"dev_matched", "dev_mismatched"}
        assert (out / "glue_submission" / "MNLI-m.tsv").is_file() and (out / "glue_submission" / "MNLI-mm.tsv").is_file()
        lines = (out / "glue_submission" / "MNLI-m.tsv").read_text().splitlines()
        assert all(l.split("\t")[1] in ("entailment", "neutral", "contradiction") for l in lines[1:])
    else:
        assert set(metrics) == {"dev"}
        if task == "qqp":
            assert set(metrics["dev"]) == {"f1", "accuracy"}
        name = {"qnli": "QNLI", "qqp": "QQP", "wnli": "WNLI"}[task]
        assert len((out / "glue_submission" / f"{name}.tsv").read_text().splitlines()) == 13


def test_squad_v1_real_slice(tmp_path, tiny_ckpt, shared_data):
    src = shared_data / "squad" / "dev-v1.1.json"
    data = tmp_path / "squad"
    fixtures.squad_slice(src, data / "train-v1.1.json", slice(0, 2))
    fixtures.squad_slice(src, data / "dev-v1.1.json", slice(2, 3), max_paragraphs=2)
    s, out = _run(tmp_path, tiny_ckpt, "squad", data, max_seq_length=128, doc_stride=32, max_train_examples=40)
    m = s["best"]["metrics"]["dev"]
    assert 0 <= m["exact_match"] <= m["f1"] <= 100
    preds = json.loads((out / "predictions" / "predictions.json").read_text())  # the official format
    gold = json.loads((data / "dev-v1.1.json").read_text())
    qids = [q["id"] for a in gold["data"] for p in a["paragraphs"] for q in p["qas"]]
    assert sorted(preds) == sorted(qids) and m["total"] == len(qids)
    # every prediction is a span of its context no longer than max_answer_length tokens
    ctx = {q["id"]: p["context"] for a in gold["data"] for p in a["paragraphs"] for q in p["qas"]}
    assert all(preds[q] and preds[q] in ctx[q] for q in qids)


def test_squad_v2_fixture(tmp_path, tiny_ckpt):
    data = tmp_path / "squad2"
    fixtures.write_squad_v2(data / "train-v2.0.json")
    fixtures.write_squad_v2(data / "dev-v2.0.json", n_paragraphs=3)
    s, _ = _run(tmp_path, tiny_ckpt, "squad2", data, max_seq_length=64, doc_stride=16)
    m = s["best"]["metrics"]["dev"]
    assert m["HasAns_total"] == 3 and m["NoAns_total"] == 3
    # (the no-answer threshold itself is tested on hand-built logits in test_squad_decoding.py)


@pytest.mark.parametrize("layout,scheme", [("original_iob1", "IOB1"), ("iob2_kamalkraj", "IOB2")])
def test_ner_real_slice(tmp_path, tiny_ckpt, shared_data, layout, scheme):
    s, out = _run(tmp_path, tiny_ckpt, "ner", shared_data / "conll2003" / layout, max_train_examples=200,
                  max_eval_examples=30)
    m = s["best"]["metrics"]["dev"]
    assert m["scheme"] == scheme and m["entities"] > 0 and 0 <= m["f1"] <= 100
    rows = json.loads((out / "predictions" / "dev.json").read_text())
    assert len(rows) == 30 and all(len(r["prediction"]) == len(r["words"]) for r in rows)


def test_swag_fixture(tmp_path, tiny_ckpt):
    data = fixtures.write_swag(tmp_path / "swag")
    s, out = _run(tmp_path, tiny_ckpt, "swag", data)
    rows = json.loads((out / "predictions" / "dev.json").read_text())
    acc = np.mean([r["prediction"] == r["label"] for r in rows])
    assert s["best"]["metrics"]["dev"]["accuracy"] == pytest.approx(acc) and len(rows) == 8


def test_sweep_and_restarts_pick_best_on_dev(tmp_path, tiny_ckpt, shared_data):
    s, _ = _run(tmp_path, tiny_ckpt, "sst2", shared_data / "glue" / "SST-2", max_train_examples=16,
                max_eval_examples=16, sweep_learning_rates=[5e-5, 2e-5], restarts=2, predict_test=False,
                head_learning_rate=1e-3, max_steps=1)
    assert [(r["lr"], r["seed"]) for r in s["runs"]] == [(5e-5, 42), (5e-5, 43), (2e-5, 42), (2e-5, 43)]
    assert s["best"]["score"] == max(r["score"] for r in s["runs"])
