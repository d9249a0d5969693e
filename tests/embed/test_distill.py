"""Retrieval distillation on real text: margin-MSE from a cross-encoder teacher, embedding MSE
from a bi-encoder teacher of another width; the stored teacher set is reused and pinned."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bertdist.embed.config import EmbedConfig
from bertdist.embed.distill import TeacherSetMismatch, margin_mse
from bertdist.embed.model import load_bi_encoder
from bertdist.embed.train import run_embed
from bertdist.finetune.errors import DataError
from tests.embed import fixtures

FAST = dict(kernels="reference", progress=False, hidden_dropout_prob=0.0, max_seq_length=48)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from bertdist.embed.export import write_cross_encoder
    from bertdist.embed.model import load_cross_encoder

    d = tmp_path_factory.mktemp("distill")
    vocab = fixtures.word_vocab(d / "vocab.txt")
    data = d / "data"
    fixtures.write_jsonl(data / "train.jsonl", fixtures.book_pairs(n=48))
    base = fixtures.tiny_checkpoint(d / "teacher_base", vocab, seed=7)
    # a cross-encoder directory as the bookkeeping tests' teacher (its scores' quality does not matter there)
    untrained = write_cross_encoder(d / "untrained_teacher", load_cross_encoder(base, max_seq_length=48,
                                                                                kernels="reference"))
    student = fixtures.tiny_checkpoint(d / "student", vocab, seed=1)
    return {"dir": d, "vocab": vocab, "data": data, "base": base, "untrained_teacher": untrained, "student": student}


@pytest.fixture(scope="module")
def trained_teacher(setup):
    """A tiny cross-encoder trained on these rows' BM25 groups (what it learned is what the student
    should pick up; it need not be a good re-ranker): about 10 s."""
    run_embed(EmbedConfig(task="rerank", checkpoint=str(setup["base"]), data=str(setup["data"]),
                          output_dir=str(setup["dir"] / "teacher"), batch_size=8, num_negatives=3, epochs=8,
                          learning_rate=1e-3, save_model=True, **FAST))
    return setup["dir"] / "teacher" / "model"


def _margins(model, table, scale=20.0):
    q = model.encode(table["query"])
    p = model.encode(table["positive"])
    n = model.encode(table["negative"])
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    q, p, n = unit(q), unit(p), unit(n)
    return scale * ((q * p).sum(1) - (q * n).sum(1))


@pytest.mark.slow
def test_margin_mse_moves_the_students_margins_toward_the_teachers(setup, trained_teacher, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "student"
    s = run_embed(EmbedConfig(task="embed", checkpoint=str(setup["student"]), data=str(setup["data"]),
                              output_dir=str(out), distill_from=str(trained_teacher), mine="bm25", num_negatives=3,
                              batch_size=16, epochs=6, learning_rate=1e-3, save_model=True, **FAST))
    info = s["distill"]
    assert info["loss"] == "margin_mse" and info["teacher_kind"] == "cross-encoder" and not info["reused"]
    assert info["triples"] == 48 * 3 and s["train_units"] == 48 * 3
    table = pq.read_table(out / "teacher_scores" / "teacher.parquet").to_pydict()
    manifest = json.loads((out / "teacher_scores" / "manifest.json").read_text())
    assert manifest["format"] == "bertdist-teacher-scores/1" and manifest["rows"] == 144
    assert manifest["sources"][0]["role"] == "train" and len(manifest["sources"][0]["sha256"]) == 64
    teacher = np.asarray(table["teacher_positive"]) - np.asarray(table["teacher_negative"])
    assert teacher.std() > 0.5  # the teacher tells the triples apart
    before = _margins(load_bi_encoder(setup["student"], max_seq_length=48, kernels="reference"), table)
    after = _margins(load_bi_encoder(out / "model", kernels="reference"), table)
    r_before, r_after = np.corrcoef(before, teacher)[0, 1], np.corrcoef(after, teacher)[0, 1]
    mse_before, mse_after = np.mean((before - teacher) ** 2), np.mean((after - teacher) ** 2)
    print(f"margin-MSE: Pearson(student, teacher margins) {r_before:.3f} -> {r_after:.3f}; "
          f"MSE {mse_before:.2f} -> {mse_after:.2f} over {len(teacher)} triples")
    assert r_after > r_before + 0.2, (r_before, r_after)
    assert mse_after < 0.7 * mse_before
    curve = [p["loss"] for p in s["loss_curve"]]
    assert np.mean(curve[-5:]) < 0.7 * np.mean(curve[:5]), curve


def test_teacher_set_is_reused_and_refused_for_another_teacher(setup, tmp_path):
    base = dict(task="embed", checkpoint=str(setup["student"]), data=str(setup["data"]), mine="bm25", num_negatives=1,
                batch_size=16, max_steps=1, learning_rate=1e-4, distill_set=str(tmp_path / "set"), **FAST)
    teacher = str(setup["untrained_teacher"])
    first = run_embed(EmbedConfig(output_dir=str(tmp_path / "a"), distill_from=teacher, **base))
    second = run_embed(EmbedConfig(output_dir=str(tmp_path / "b"), distill_from=teacher, **base))
    assert not first["distill"]["reused"] and second["distill"]["reused"]
    # a copy of the teacher whose head differs: other weights, so the stored scores are not its
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other_teacher"
    shutil.copytree(setup["untrained_teacher"], other)
    sd = load_file(str(other / "model.safetensors"))
    sd["classifier.bias"] = sd["classifier.bias"] + torch.ones_like(sd["classifier.bias"])
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TeacherSetMismatch, match=r"teacher\.sha256: set has '[0-9a-f]{64}', this run has"):
        run_embed(EmbedConfig(output_dir=str(tmp_path / "c"), distill_from=str(other), **base))
    # other triples (two negatives per row): refused, naming the content fingerprint and the row count
    with pytest.raises(TeacherSetMismatch, match=r"content_sha256: .*rows: set has 48, this run has 96"):
        run_embed(EmbedConfig(output_dir=str(tmp_path / "d"), distill_from=str(setup["untrained_teacher"]),
                              **{**base, "num_negatives": 2}))


def test_margin_mse_needs_negatives(setup, tmp_path):
    with pytest.raises(DataError, match="margin-MSE distillation needs .* none of the 48 rows has a negative"):
        run_embed(EmbedConfig(task="embed", checkpoint=str(setup["student"]), data=str(setup["data"]),
                              output_dir=str(tmp_path / "o"), distill_from=str(setup["untrained_teacher"]), **FAST))
    with pytest.raises(DataError, match="distill_loss=embedding_mse needs a bi-encoder teacher"):
        run_embed(EmbedConfig(task="embed", checkpoint=str(setup["student"]), data=str(setup["data"]),
                              output_dir=str(tmp_path / "o"), distill_from=str(setup["untrained_teacher"]),
                              distill_loss="embedding_mse", **FAST))


def test_margin_mse_is_zero_when_margins_agree():
    import torch

    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    n = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    student = 20.0 * torch.tensor([1.0 - 0.0, 2 ** -0.5 - (-1.0)])
    assert margin_mse(q, p, n, student, 20.0).item() == pytest.approx(0.0, abs=1e-6)
    assert margin_mse(q, p, n, student + 1.0, 20.0).item() == pytest.approx(1.0, abs=1e-5)


def test_embedding_distillation_from_a_narrower_teacher_learns_a_projection(setup, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    teacher = fixtures.tiny_checkpoint(tmp_path / "teacher64", setup["vocab"], seed=5, hidden_size=64,
                                       num_attention_heads=2, intermediate_size=256)
    out = tmp_path / "student"
    s = run_embed(EmbedConfig(task="embed", checkpoint=str(setup["student"]), data=str(setup["data"]),
                              output_dir=str(out), distill_from=str(teacher), batch_size=16, epochs=5,
                              learning_rate=1e-3, save_model=True, **FAST))
    info = s["distill"]
    assert info["loss"] == "embedding_mse" and info["projection"] == [128, 64] and info["teacher_dim"] == 64
    rows = [json.loads(x) for x in (setup["data"] / "train.jsonl").read_text().splitlines()]
    texts = [r["query"] for r in rows] + [r["positive"] for r in rows]
    target = load_bi_encoder(teacher, max_seq_length=48, kernels="reference").encode(texts)
    student = load_bi_encoder(out / "model", kernels="reference")
    assert student.dim == 64 and student.projection is not None
    got = student.encode(texts)
    cos_after = float(np.mean((got * target).sum(1)))
    curve = [p["loss"] for p in s["loss_curve"]]
    print(f"embedding MSE: loss {curve[0]:.5f} -> {curve[-1]:.5f}; mean cosine to the teacher {cos_after:.3f}")
    assert curve[-1] < 0.5 * curve[0], curve
    assert cos_after > 0.9
    theirs = st.SentenceTransformer(str(out / "model"), device="cpu").encode(texts[:6])
    assert np.abs(theirs - got[:6]).max() < 1e-5
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "model" / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Dense", "Normalize"]
