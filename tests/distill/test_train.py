"""`bertdist distill` end to end on tiny models, one test per task family: the student trains on
labelled + pseudo-labelled rows, is scored beside the teacher, and its exported directory serves
in a transformers `pipeline` for its task."""
import json
import shutil

import pytest

from bertdist.distill.train import run_distill
from tests.distill import fixtures as fx

pytestmark = pytest.mark.slow  # each trains a teacher and two students (20-60 s on the CI machine)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return fx.write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def _check_report(out, task, n_pseudo, n_labelled):
    r = json.loads((out / "report.json").read_text())
    assert r["task"] == task and r["pseudo_labels"]["rows"] == n_pseudo and r["labelled_rows"] == n_labelled
    assert r["student"]["train_rows"] == n_pseudo + n_labelled
    assert r["student"]["retention"] == pytest.approx(r["student"]["score"] / r["teacher"]["score"]) \
        if r["teacher"]["score"] else True
    assert r["student"]["parameters"] < r["teacher"]["parameters"]
    assert 0 < r["student"]["size_bytes"] < r["teacher"]["size_bytes"]
    for who in ("teacher", "student"):
        assert r["speed"]["cpu"][who]["latency_b1_ms"] > 0 and r["speed"]["cpu"][who]["throughput_b32_seq_per_s"] > 0
    assert "| teacher |" in (out / "report.md").read_text()
    return r


def test_sst2_through_the_cli_with_a_direct_baseline(tmp_path, vocab):
    from transformers import pipeline

    from bertdist.cli.main import main

    data = fx.write_sst2(tmp_path / "sst2")
    teacher = fx.teacher(tmp_path, "sst2", data, vocab)
    unl = fx.write_unlabeled_text(tmp_path / "unlabeled.txt", n=40)
    out = tmp_path / "out"
    rc = main(["distill", "sst2", "--teacher", str(teacher), "--student", "layers:1", "--data", str(data),
               "--unlabeled", str(unl), "--out", str(out), "--baseline", "direct",
               "--set", "train.max_steps=4", "--set", "train.batch_size=8", "--set", "train.max_seq_length=48",
               "--set", "train.kernels=reference", "--set", "train.progress=false", "--set", "bench_repeats=1",
               "--set", "bench_seq_length=32", "--set", "shard_rows=16"])
    assert rc == 0
    r = _check_report(out, "sst2", 40, 32)
    assert r["direct"]["train_rows"] == 32 and "gain_over_direct_points" in r["student"]
    assert json.loads((out / "pseudo_labels" / "manifest.json").read_text())["num_shards"] == 3
    clf = pipeline("text-classification", model=str(out / "model"), device="cpu")
    pred = clf("the film was very good and it actor .")[0]
    assert pred["label"] in ("0", "1") and 0.0 <= pred["score"] <= 1.0


def test_pair_task_and_regression(tmp_path, vocab):
    from transformers import pipeline

    for task, data in (("rte", fx.write_rte(tmp_path / "rte")), ("stsb", fx.write_stsb(tmp_path / "stsb"))):
        unl = tmp_path / f"{task}_unlabeled.tsv"
        shutil.copy(data / "dev.tsv", unl)  # the task's layout; its label column is ignored
        teacher = fx.teacher(tmp_path, task, data, vocab)
        out = tmp_path / f"out_{task}"
        _check_report(out, task, 12, 32) if run_distill(fx.distill_config(task, teacher, data, [unl], out,
                                                                         student="layers:1")) else None
        clf = pipeline("text-classification", model=str(out / "model"), device="cpu",
                       function_to_apply="none" if task == "stsb" else "softmax")
        pred = clf({"text": "the film was good .", "text_pair": "the film was very good ."})
        assert isinstance(pred["score"] if isinstance(pred, dict) else pred[0]["score"], float)


def test_ner_is_distilled_per_token(tmp_path, vocab):
    from transformers import pipeline

    data = fx.write_conll(tmp_path / "ner")
    unl = fx.write_conll_unlabeled(tmp_path / "unlabeled.conll", n=30)
    teacher = fx.teacher(tmp_path, "ner", data, vocab, steps=20)
    out = tmp_path / "out"
    run_distill(fx.distill_config("ner", teacher, data, [unl], out, student="layers:1", steps=10))
    _check_report(out, "ner", 30, 24)
    rows = json.loads((out / "predictions" / "dev.json").read_text())
    assert len(rows) == 8 and len(rows[0]["prediction"]) == len(rows[0]["words"])
    ner = pipeline("token-classification", model=str(out / "model"), device="cpu")
    tags = ner("john smith visited paris .")
    assert all(t["entity"] in {"O", "B-PER", "I-PER", "B-LOC", "I-LOC"} for t in tags)


def test_squad_is_distilled_on_start_and_end_logits(tmp_path, vocab):
    data = fx.write_squad(tmp_path / "squad")
    unl = fx.write_squad_unlabeled(tmp_path / "unlabeled.json", n=6)
    teacher = fx.teacher(tmp_path, "squad", data, vocab)
    out = tmp_path / "out"
    run_distill(fx.distill_config("squad", teacher, data, [unl], out, student="layers:1"))
    r = _check_report(out, "squad", 12, 16)  # 2 questions per paragraph, one window each
    assert r["main_metric"] == "f1"
    # transformers 5 has no question-answering pipeline: the model class it served, loaded cleanly
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    model, info = AutoModelForQuestionAnswering.from_pretrained(str(out / "model"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    enc = AutoTokenizer.from_pretrained(str(out / "model"))("where did john go ?", "john smith visited paris .",
                                                            return_tensors="pt")
    res = model.eval()(**enc)
    assert res.start_logits.shape == res.end_logits.shape == enc["input_ids"].shape
