"""Tiny Hugging Face BERT directories of every exported kind, and their ONNX exports."""
from __future__ import annotations

from pathlib import Path

import pytest

ARCHITECTURES = {
    "classification": "BertForSequenceClassification",
    "regression": "BertForSequenceClassification",
    "token": "BertForTokenClassification",
    "span": "BertForQuestionAnswering",
    "choice": "BertForMultipleChoice",
    "encoder": "BertModel",
}


def architecture(kind: str, family: str = "Bert") -> str:
    return ARCHITECTURES[kind].replace("Bert", family, 1)


def make_hf_dir(out: Path, kind: str, vocab: Path, seed: int = 0, family: str = "Bert") -> Path:
    """A randomly initialised tiny BERT (or ELECTRA, its embeddings narrower than its hidden states
    as in ELECTRA-Small) of ``kind`` with its tokenizer files."""
    import torch
    import transformers

    from bertdist.export.tokenizer import read_vocab, write_tokenizer_files

    torch.manual_seed(seed)
    labels = {"classification": ["negative", "positive"], "token": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]}.get(kind)
    sizes = dict(vocab_size=len(read_vocab(vocab)), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128)
    conf = (transformers.ElectraConfig(embedding_size=16, **sizes) if family == "Electra"
            else transformers.BertConfig(**sizes))
    if labels:
        conf.id2label = dict(enumerate(labels))
        conf.label2id = {n: i for i, n in enumerate(labels)}
    if kind == "regression":
        conf.num_labels, conf.problem_type = 1, "regression"
    model = getattr(transformers, architecture(kind, family))(conf).eval()
    model.save_pretrained(str(out))
    write_tokenizer_files(out, vocab, True, 128)
    return out


def self_labelled_sst2(tmp_path, onnx_dir, n=64, keep=None):
    """An SST-2-layout dev set labelled by the fp32 model itself: fp32 accuracy is 1.0 by construction.
    ``keep``: only the ``keep`` texts of the ``n`` that the model labels with the widest logit margin."""
    import csv

    from bertdist.serve.parity import sample_texts
    from bertdist.serve.runtime import load_served_model

    texts = [t[:300].replace("\t", " ") for t in sample_texts(n)]
    m = load_served_model(onnx_dir, variant="fp32")
    job = m.prepare("predict", {"inputs": [[t] for t in texts], "raw_scores": True})
    answers = job.finish(m.run(job.items))
    rows = [(t, 1 if a[0]["label"] == "positive" else 0, a[0]["score"] - a[1]["score"]) for t, a in zip(texts, answers)]
    if keep is not None:
        rows = sorted(rows, key=lambda r: -r[2])[:keep]
    d = tmp_path / "SST-2"
    d.mkdir()
    with (d / "dev.tsv").open("w", newline="") as f:
        w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\")
        w.writerow(["sentence", "label"])
        for t, label, _ in rows:
            w.writerow([t, label])
    return d


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory, small_vocab):
    """``hf_model(kind)`` -> a tiny HF directory of that kind (made once per session)."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = make_hf_dir(tmp_path_factory.mktemp(f"hf_{kind}"), kind, small_vocab)
        return made[kind]
    return get


@pytest.fixture(scope="session")
def onnx_model(tmp_path_factory, hf_model):
    """``onnx_model(kind)`` -> its ONNX export (fp32 + optimised, made once per session)."""
    from bertdist.serve.onnx_export import ExportOptions, export_onnx

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = tmp_path_factory.mktemp(f"onnx_{kind}") / "model"
            export_onnx(hf_model(kind), out, ExportOptions(optimize=True), log=lambda *_: None)
            made[kind] = out
        return made[kind]
    return get
