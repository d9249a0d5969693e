"""Distillation with ModernBERT (a tiny transformers ``ModernBertForMaskedLM`` with a byte-level BPE
tokenizer.json, fine-tuned here): a ModernBERT teacher, a ``layers:K`` student made of its layers
(and a ``preset:`` one of ModernBERT's sizes), pseudo-labels over unlabelled text, and a student
written as ``ModernBertForSequenceClassification`` that transformers loads; TinyBERT's intermediate
losses, which read BERT-layout layers, are refused with the way out."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from bertdist.distill.student import StudentSpecError, plan_student
from bertdist.distill.teacher import load_teacher
from bertdist.distill.train import run_distill
from bertdist.finetune.errors import DataError
from tests.distill import fixtures as fx
from tests.export.tiny_modernbert import CORPUS, write_hf_modernbert

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from bertdist.finetune import FinetuneConfig, run_finetune

    tmp = tmp_path_factory.mktemp("mb_distill")
    base = write_hf_modernbert(tmp / "base", num_hidden_layers=4)
    data = tmp / "sst2"
    data.mkdir()
    rows = [(s, 1) for s in CORPUS[:8]] + [(s, 0) for s in CORPUS[8:16]]
    (data / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    (data / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows[::2]))
    run_finetune(FinetuneConfig(task="sst2", checkpoint=str(base), data=str(data), output_dir=str(tmp / "teacher"),
                                max_seq_length=32, batch_size=4, max_steps=8, learning_rate=1e-3, progress=False,
                                save_model=True, predict_test=False, tensorboard=False, classifier_pooling="mean"))
    unl = tmp / "unlabeled.txt"
    unl.write_text("\n".join(CORPUS[16:] + [s.upper() for s in CORPUS[:10]]) + "\n")
    return tmp, base, data, unl, tmp / "teacher" / "model"


def test_layers_k_student_is_made_of_the_teachers_layers_and_head(setup):
    *_, t_dir = setup
    teacher = load_teacher(t_dir, "sst2", "classification", 2, device=torch.device("cpu"))
    assert teacher.vocab_file is None and teacher.model.pooling == "mean"
    plan = plan_student("layers:2", teacher, "classification")
    assert plan.teacher_layers == [0, 3] and plan.head_options["pooling"] == "mean"
    student = plan.build("classification", 2, "cpu")
    s, t = student.state_dict(), teacher.model.state_dict()
    for s_i, t_i in enumerate([0, 3]):
        for name in ("attn.Wqkv.weight", "mlp.Wo.weight"):
            assert torch.equal(s[f"model.layers.{s_i}.{name}"], t[f"model.layers.{t_i}.{name}"])
    for name in ("model.embeddings.tok_embeddings.weight", "head.dense.weight", "classifier.weight"):
        assert torch.equal(s[name], t[name])
    small = plan_student("preset:tiny", teacher, "classification")
    assert small.backbone_state is None and small.config.vocab_size == teacher.config.vocab_size
    assert type(small.config).__name__ == "ModernBertConfig" and small.config.hidden_size == 64
    assert not small.head_state  # tiny is wider (64) than the teacher (32): a fresh head
    with pytest.raises(StudentSpecError, match="unknown ModernBERT preset 'huge'"):
        plan_student("preset:huge", teacher, "classification")


def test_a_bert_checkpoint_cannot_be_a_modernbert_teachers_student(setup, tmp_path):
    *_, t_dir = setup
    teacher = load_teacher(t_dir, "sst2", "classification", 2, device=torch.device("cpu"))
    bert = fx.tiny_base(tmp_path / "bert", fx.write_vocab(tmp_path / "vocab.txt"))
    with pytest.raises(StudentSpecError, match="is not the teacher's"):
        plan_student(str(bert), teacher, "classification")


def test_distill_writes_a_modernbert_student_transformers_loads(setup, tmp_path):
    tmp, base, data, unl, t_dir = setup
    out = tmp_path / "out"
    report = run_distill(fx.distill_config("sst2", t_dir, data, [unl], out, student="layers:2", steps=6))
    assert report is not None
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model", output_loading_info=True)
    assert type(hf).__name__ == "ModernBertForSequenceClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.num_hidden_layers == 2 and hf.config.classifier_pooling == "mean"
    assert (out / "model" / "tokenizer.json").read_bytes() == (t_dir / "tokenizer.json").read_bytes()
    manifest = json.loads((out / "pseudo_labels" / "manifest.json").read_text())
    # the set records the teacher's tokenizer by its tokenizer.json's fingerprint
    assert manifest["teacher"]["vocab_sha256"] == hashlib.sha256((t_dir / "tokenizer.json").read_bytes()).hexdigest()
    with pytest.raises(DataError, match="intermediate losses read BERT-layout layers"):
        run_distill(fx.distill_config("sst2", t_dir, data, [unl], tmp_path / "tiny", student="layers:2", steps=1,
                                      hidden_weight=1.0, labels_dir=str(out / "pseudo_labels")))
