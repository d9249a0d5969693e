"""Bi- and cross-encoders on a ModernBERT backbone (a tiny transformers ``ModernBertForMaskedLM``
with a byte-level BPE tokenizer.json, tests/export/tiny_modernbert.py):

- the bi-encoder's embeddings are transformers' ``ModernBertModel`` states, mean pooled;
- STS training runs (Spearman measured before and after) and exports a sentence-transformers
  directory (a ``ModernBertModel`` with the BPE tokenizer) that sentence-transformers and our loader
  read back to the same embeddings;
- re-ranking trains a cross-encoder that exports as ``ModernBertForSequenceClassification`` with one
  label; transformers and our loader reproduce its scores.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bertdist.embed.config import EmbedConfig
from bertdist.embed.model import load_bi_encoder, load_cross_encoder
from bertdist.embed.train import run_embed
from tests.embed import fixtures
from tests.export.tiny_modernbert import CORPUS, write_hf_modernbert

transformers = pytest.importorskip("transformers")
FAST = dict(progress=False, hidden_dropout_prob=0.0, max_seq_length=64)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return write_hf_modernbert(tmp_path_factory.mktemp("modernbert"))


@pytest.fixture(scope="module")
def sts(tmp_path_factory) -> Path:
    """STS-B layout: pairs of the corpus, scored 5 for a sentence with itself lower-cased, 0 across halves."""
    d = tmp_path_factory.mktemp("STS-B")
    rows = []
    for i, s in enumerate(CORPUS):
        rows.append((s, s.lower().rstrip("."), 5.0 - (i % 3) * 0.5))
        rows.append((s, CORPUS[(i + 11) % len(CORPUS)], 0.5 * (i % 3)))
    head = "index\tsentence1\tsentence2\tscore\n"
    body = lambda rs: "".join(f"{i}\t{a}\t{b}\t{y}\n" for i, (a, b, y) in enumerate(rs))  # noqa: E731
    (d / "train.tsv").write_text(head + body(rows))
    (d / "dev.tsv").write_text(head + body(rows[::2] + rows[1::4]))
    return d


def _transformers_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    from bertdist.export.tokenizer import fast_tokenizer

    hf = transformers.AutoModel.from_pretrained(model_dir).eval()
    enc = fast_tokenizer(model_dir / "tokenizer.json")(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()


def test_bi_encoder_embeds_as_transformers_modernbert(pretrained):
    model = load_bi_encoder(pretrained)
    assert type(model.bert).__name__ == "ModernBertBackbone" and model.tokenizer_files
    texts = CORPUS[16:22]
    assert np.abs(model.encode(texts, batch_size=4) - _transformers_embeddings(pretrained, texts)).max() <= 1e-5


def test_sts_trains_and_exports_a_sentence_transformers_dir(pretrained, sts, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    out = tmp_path / "out"
    s = run_embed(EmbedConfig(task="sts", checkpoint=str(pretrained), data=str(sts), output_dir=str(out),
                              batch_size=8, max_steps=12, learning_rate=1e-3, save_model=True, **FAST))
    assert s["main_metric"] == "spearman" and np.isfinite(s["initial"]["metrics"]["spearman"])
    assert np.isfinite(s["best"]["metrics"]["spearman"]) and s["steps"] == 12
    assert s["loss_curve"][-1]["loss"] < s["loss_curve"][0]["loss"], s["loss_curve"]
    conf = json.loads((out / "model" / "config.json").read_text())
    assert conf["architectures"] == ["ModernBertModel"] and (out / "model" / "tokenizer.json").is_file()
    texts = CORPUS[16:22]
    ours = load_bi_encoder(out / "model").encode(texts)
    theirs = st.SentenceTransformer(str(out / "model"), device="cpu").encode(texts, convert_to_numpy=True)
    assert np.abs(ours - theirs).max() <= 1e-5
    base = load_bi_encoder(pretrained).encode(texts)
    assert np.abs(ours - base).max() > 1e-3  # it was trained


def test_rerank_trains_a_cross_encoder_transformers_reproduces(pretrained, tmp_path):
    data = fixtures.retrieval_dir(tmp_path / "data", n_train=16, n_dev=6, negatives=2)
    out = tmp_path / "o"
    s = run_embed(EmbedConfig(task="rerank", checkpoint=str(pretrained), data=str(data), output_dir=str(out),
                              loss="bce", batch_size=8, max_steps=3, learning_rate=1e-3, num_negatives=2,
                              save_model=True, **FAST))
    assert s["model"]["activation"] == "sigmoid" and np.isfinite(s["best"]["metrics"]["ndcg@10"])
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model",
                                                                             output_loading_info=True)
    assert type(hf).__name__ == "ModernBertForSequenceClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"] and hf.config.num_labels == 1
    pairs = [("Who wrote the letter?", CORPUS[i]) for i in range(16, 22)]
    model = load_cross_encoder(out / "model")
    assert model.activation == "sigmoid" and model.origin["format"] == "cross-encoder"
    ours = model.score(pairs)
    from bertdist.export.tokenizer import fast_tokenizer

    enc = fast_tokenizer(out / "model" / "tokenizer.json")([a for a, _ in pairs], [b for _, b in pairs],
                                                           padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval()(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.reshape(-1)
    assert np.abs(ours - theirs.numpy()).max() <= 1e-5


def test_an_embedding_set_of_a_modernbert_pins_its_tokenizer(pretrained, tmp_path):
    """`bertdist embed` (bertdist/retrieval/embed_job.py) over a ModernBERT: the set's rows are the
    bi-encoder's embeddings, and the set records the tokenizer.json's fingerprint."""
    import hashlib

    from bertdist.retrieval.embed_job import read_embeddings, run_embedding

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(CORPUS[:12]) + "\n")
    manifest = run_embedding(pretrained, [texts], tmp_path / "emb", batch_size=4, progress=False, device="cpu")
    assert manifest["model"]["vocab_sha256"] == hashlib.sha256((pretrained / "tokenizer.json").read_bytes()).hexdigest()
    got = read_embeddings(tmp_path / "emb")
    want = load_bi_encoder(pretrained).encode(CORPUS[:12])
    assert np.abs(got.vectors - want).max() <= 1e-5
