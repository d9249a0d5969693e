"""Distillation with ModernBERT (a tiny transformers ``ModernBertForMaskedLM`` with a byte-level BPE
tokenizer.json, fine-tuned here): a ModernBERT teacher, a ``layers:K`` student made of its layers
(and a ``preset:`` one of ModernBERT's sizes), pseudo-labels over unlabelled text, and a student
written as ``ModernBertForSequenceClassification`` that transformers loads; TinyBERT's intermediate
losses on its layers' hidden states and attention maps (a local layer's compared on its window)."""
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
    # TinyBERT's intermediate losses read a ModernBERT's layers too; a preset:tiny student is wider
    # (64 against 32: the learned projection) and its local window differs from the teacher's
    wide = run_distill(fx.distill_config("sst2", t_dir, data, [unl], tmp_path / "tiny", student="preset:tiny", steps=3,
                                         hidden_weight=1.0, attention_weight=1.0, layer_map=[0, 2, 3],
                                         labels_dir=str(out / "pseudo_labels")))
    assert wide is not None
    r = json.loads((tmp_path / "tiny" / "report.json").read_text())
    assert r["hidden_weight"] == 1.0 and r["attention_weight"] == 1.0 and r["student_spec"]["hidden_size"] == 64


def test_tinybert_losses_between_modernbert_layers_are_finite_and_train_the_student(setup):
    """One batch through a ModernBERT teacher (4 layers: global, local, local, global; window 16)
    and a layers:2 student (teacher layers 0 and 3, the second now local): the hidden-state MSE and
    the attention KL (the student's local layer compared on its window) are finite and positive,
    and their gradient reaches the student's attention weights."""
    from bertdist.distill import losses
    from bertdist.distill.capture import LayerCapture
    from bertdist.export.tokenizer import fast_tokenizer

    *_, t_dir = setup
    teacher = load_teacher(t_dir, "sst2", "classification", 2, device=torch.device("cpu"))
    plan = plan_student("layers:2", teacher, "classification")
    student = plan.build("classification", 2, "cpu").train()
    tok = fast_tokenizer(t_dir / "tokenizer.json")
    texts = [" ".join(CORPUS[i:i + 4]) for i in range(6)]
    batch = dict(tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt"))
    mask = batch["attention_mask"]
    assert mask.shape[1] > 2 * 8 + 1 and not bool(mask.all())  # longer than a local window; padded rows
    s_cap, t_cap = LayerCapture(student.backbone, True), LayerCapture(teacher.model.backbone, True)
    student(batch)
    with torch.no_grad():
        teacher.model(batch)
    assert [a is None for a in s_cap.allowed(mask)] == [True, False]
    assert [a is None for a in t_cap.allowed(mask)] == [True, False, False, True]
    proj = losses.HiddenProjection(32, 32)
    hid = losses.hidden_mse(s_cap.states(mask), t_cap.states(mask), plan.teacher_layers, mask, proj)
    att = losses.attention_kl(s_cap.probs(mask), t_cap.probs(mask), plan.teacher_layers, mask,
                              s_cap.allowed(mask), t_cap.allowed(mask))
    assert torch.isfinite(hid) and torch.isfinite(att) and hid.item() > 0 and att.item() > 0
    # the student's layer 0 is the teacher's, on the same input: its states and map match exactly
    s_states, t_states = s_cap.states(mask), t_cap.states(mask)
    assert losses.hidden_mse(s_states[:1], t_states, [0], mask, proj).item() == pytest.approx(0.0, abs=1e-12)
    assert losses.attention_kl(s_cap.probs(mask)[:1], t_cap.probs(mask), [0], mask).item() == \
        pytest.approx(0.0, abs=1e-6)
    (hid + att).backward()
    grad = student.backbone.layers[1].attn.Wqkv.weight.grad
    assert grad is not None and grad.abs().sum() > 0
