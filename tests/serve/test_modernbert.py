"""ModernBERT through `bertdist export --format onnx` and a real `bertdist serve` process: a tiny
ModernBERT (byte-level BPE tokenizer.json, tests/export/tiny_modernbert.py) fine-tuned on SST-2-format
rows answers /predict as the fine-tuned model does offline, and the pretrained ModernBertForMaskedLM
directory answers /embed as our encoder's mean-pooled states; texts past the model's limit are
answered as the tokenizer's truncation of the whole text."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bertdist.cli.main import main
from tests.export.tiny_modernbert import CORPUS, write_hf_modernbert
from tests.serve.test_server import CliServer, call

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    return write_hf_modernbert(tmp_path_factory.mktemp("modernbert"))


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, pretrained) -> Path:
    from bertdist.finetune import FinetuneConfig, run_finetune

    d = tmp_path_factory.mktemp("SST-2")
    rows = [(s, 1) for s in CORPUS[:8]] + [(s, 0) for s in CORPUS[8:16]]
    (d / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    (d / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    out = tmp_path_factory.mktemp("run")
    run_finetune(FinetuneConfig(task="sst2", checkpoint=str(pretrained), data=str(d), output_dir=str(out),
                                max_seq_length=64, batch_size=4, max_steps=8, learning_rate=1e-3, progress=False,
                                save_model=True, predict_test=False, tensorboard=False))
    return out


@pytest.fixture(scope="module")
def onnx_dirs(tmp_path_factory, pretrained, finetuned) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("onnx")
    assert main(["export", str(finetuned / "model"), "--format", "onnx", "--out", str(root / "cls"), "--optimize"]) == 0
    assert main(["export", str(pretrained), "--format", "onnx", "--out", str(root / "enc")]) == 0
    return {"cls": root / "cls", "enc": root / "enc"}


def test_the_card_names_the_graphs_inputs(onnx_dirs):
    card = json.loads((onnx_dirs["cls"] / "onnx_card.json").read_text())
    assert card["model_type"] == "modernbert" and card["architecture"] == "ModernBertForSequenceClassification"
    assert card["task"] == "classification" and card["inputs"] == ["input_ids", "attention_mask"]
    assert card["parity"]["fp32"]["max_abs_diff"] <= 1e-4 and card["parity"]["optimized"]["max_abs_diff"] <= 1e-4
    assert json.loads((onnx_dirs["enc"] / "onnx_card.json").read_text())["task"] == "encoder"


def _our_embeddings(pretrained: Path, texts: list[str], max_length: int) -> np.ndarray:
    """Our ModernBERT (not transformers'), mean pooled over real tokens, unit length."""
    from bertdist.embed.pooling import pool
    from bertdist.export.encoders import family_of
    from bertdist.export.sources import load_pretrained
    from bertdist.export.tokenizer import fast_tokenizer

    w = load_pretrained(pretrained)
    family = family_of(w.config)
    enc = family.embedding_encoder(w.config).eval()
    enc.load_state_dict(family.encoder_state(w.state_dict, enc))
    batch = fast_tokenizer(pretrained / "tokenizer.json")(texts, truncation=True, max_length=max_length,
                                                          padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden, _ = enc(batch["input_ids"], batch["attention_mask"])
        e = pool(hidden, batch["attention_mask"], "mean")
    return torch.nn.functional.normalize(e, dim=-1).numpy()


def test_a_served_modernbert_answers_as_the_offline_models(onnx_dirs, finetuned, pretrained):
    dev = json.loads((finetuned / "predictions" / "dev.json").read_text())  # our fine-tuned model's logits
    srv = CliServer(str(onnx_dirs["cls"]), str(onnx_dirs["enc"]), "--name", "cls", "--name", "enc")
    try:
        sentences = [s for s in CORPUS[:16]]
        status, _, answers = call(srv.port, "POST", "/predict", {"inputs": [[s] for s in sentences],
                                                                  "raw_scores": True})
        assert status == 200, answers
        for answer, row in zip(answers, dev):
            got = {a["label"]: a["score"] for a in answer}
            assert max(abs(got[str(i)] - x) for i, x in enumerate(row["logits"])) <= 1e-5, (answer, row)
        long = " ".join(CORPUS * 6)  # several hundred tokens: cut to the card's 128
        status, _, vecs = call(srv.port, "POST", "/embed", {"inputs": [CORPUS[16], long, CORPUS[20]]})
        assert status == 200, vecs
        want = _our_embeddings(pretrained, [CORPUS[16], long, CORPUS[20]], 128)
        assert np.abs(np.asarray(vecs) - want).max() <= 1e-5
    finally:
        assert srv.stop() == 0


def test_a_torch_format_modernbert_exports_as_the_hf_one(tmp_path, pretrained, onnx_dirs):
    from bertdist.export.sources import load_pretrained, write_torch_dir
    from bertdist.serve.runtime import load_served_model

    torch_dir = write_torch_dir(tmp_path / "torch", load_pretrained(pretrained))
    assert main(["export", str(torch_dir), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    body = {"inputs": CORPUS[16:20]}
    a, b = (load_served_model(d) for d in (tmp_path / "onnx", onnx_dirs["enc"]))
    ja, jb = a.prepare("embed", body), b.prepare("embed", body)
    assert np.abs(np.asarray(ja.finish(a.run(ja.items))) - np.asarray(jb.finish(b.run(jb.items)))).max() <= 1e-6


@pytest.mark.parametrize("mode", ["per-channel", "static"])
def test_int8_of_a_modernbert_classifier_keeps_its_dev_accuracy(tmp_path, finetuned, onnx_dirs, mode):
    """int8 of a ModernBERT classifier (two graph inputs, no token types) through the same gate as
    BERT's: the SST-2 dev accuracy, on texts the fp32 model labelled itself, within 10 points; every
    weight MatMul is quantised (the attention products, RoPE and GeGLU's gate are activations)."""
    import onnx

    from bertdist.serve.onnx_export import ExportOptions, export_onnx
    from bertdist.serve.quantization import weight_matmuls
    from tests.serve.conftest import self_labelled_sst2

    dev = self_labelled_sst2(tmp_path, onnx_dirs["cls"])
    card = export_onnx(finetuned / "model", tmp_path / "q", ExportOptions(
        quantize="int8", int8_mode=mode, task="sst2", dev=str(dev), tolerance_points=10.0, calibration=32),
        log=lambda *_: None)
    p = card["parity"]["int8"]
    assert p["metric"] == "accuracy" and p["fp32"] == 1.0 and p["examples"] == 64
    assert p["within_tolerance"] and p["int8"] >= 0.9, p
    assert card["quantization"]["mode"] == mode and card["quantization"]["kept_fp32"] == []
    fp32 = onnx.load(str(tmp_path / "q" / "model.onnx"))
    int8 = onnx.load(str(tmp_path / "q" / "model.int8.onnx"))
    assert [i.name for i in int8.graph.input] == ["input_ids", "attention_mask"]
    n = len(weight_matmuls(fp32))
    assert n >= 4 * 3  # Wqkv, Wo, Wi and the MLP's Wo in each of the 3 layers
    assert weight_matmuls(int8) == []  # none left in fp32
    quantised = [x for x in int8.graph.node if x.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")
                 or (x.op_type == "MatMul" and mode == "static")]
    assert len(quantised) >= n
    # the served int8 model (two inputs fed) labels the dev texts as the gate measured
    from bertdist.serve.runtime import load_served_model

    texts = [ln.split("\t")[0] for ln in (dev / "dev.tsv").read_text().splitlines()[1:]]
    labels = {}
    for variant in ("fp32", "int8"):
        m = load_served_model(tmp_path / "q", variant=variant)
        job = m.prepare("predict", {"inputs": [[t] for t in texts]})
        labels[variant] = [a[0]["label"] for a in job.finish(m.run(job.items))]
    agree = sum(a == b for a, b in zip(labels["fp32"], labels["int8"])) / len(texts)
    assert agree == pytest.approx(p["int8"], abs=1 / len(texts)) and agree >= 0.9


def test_int8_of_a_modernbert_encoder_is_judged_by_its_embeddings(tmp_path, pretrained):
    from bertdist.serve.onnx_export import ExportOptions, export_onnx

    card = export_onnx(pretrained, tmp_path / "enc", ExportOptions(quantize="int8", calibration=16),
                       log=lambda *_: None)
    p = card["parity"]["int8"]
    assert p["metric"] == "embedding_cosine_min" and p["min_cosine"] >= 0.98 and p["within_tolerance"], p


def test_the_int8_fallback_measures_a_modernbert_graphs_nodes(tmp_path, finetuned):
    """A tolerance no int8 model meets (a drop of -1 point) runs the fallback: it measures each
    quantised node's error on the two-input graph, keeps the most sensitive in fp32, and refuses."""
    from bertdist.serve.onnx_export import ExportOptions, export_onnx
    from bertdist.serve.parity import ParityError

    dev = tmp_path / "SST-2"
    dev.mkdir()
    (dev / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{int(i < 8)}\n" for i, s in enumerate(CORPUS[:16])))
    logged = []
    with pytest.raises(ParityError, match=r"keeping up to 2 of the most sensitive nodes in fp32 "
                                          r"\(--int8-fallback-steps 2\)"):
        export_onnx(finetuned / "model", tmp_path / "bad", ExportOptions(
            quantize="int8", task="sst2", dev=str(dev), tolerance_points=-1.0, fallback_steps=2, calibration=16),
            log=logged.append)
    sens = next(line for line in logged if line.startswith("int8 sensitivity"))
    assert "/model/layers." in sens and "MatMul" in sens, sens
    assert [line.split(":")[0] for line in logged if line.startswith("int8 step ")] == \
        ["int8 step 0", "int8 step 1", "int8 step 2"], logged
    assert not (tmp_path / "bad").exists()


def test_a_served_modernbert_ner_model_labels_whole_words(tmp_path, pretrained):
    """Byte-level BPE counts the space before a word into its first token; the served words and
    spans are the words' own."""
    from bertdist.finetune import FinetuneConfig, run_finetune
    from bertdist.serve.runtime import load_served_model

    data = tmp_path / "conll"
    data.mkdir()
    sents = [("John Smith lives in Paris .", "B-PER I-PER O O B-LOC O"),
             ("Mary visited Berlin with Peter .", "B-PER O B-LOC O B-PER O")]
    body = "\n".join("\n".join(f"{w} {t}" for w, t in zip(s.split(), tags.split())) + "\n" for s, tags in sents * 4)
    (data / "train.txt").write_text(body)
    (data / "valid.txt").write_text(body)
    run_finetune(FinetuneConfig(task="ner", checkpoint=str(pretrained), data=str(data), output_dir=str(tmp_path / "run"),
                                max_seq_length=32, batch_size=4, max_steps=2, learning_rate=1e-3, progress=False,
                                save_model=True, predict_test=False, tensorboard=False))
    assert main(["export", str(tmp_path / "run" / "model"), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    m = load_served_model(tmp_path / "onnx")
    text = "Mary  visited Berlin, with John Smith."
    job = m.prepare("predict", {"inputs": text})
    words = job.finish(m.run(job.items))
    assert [w["word"] for w in words] == ["Mary", "visited", "Berlin", ",", "with", "John", "Smith", "."]
    assert all(text[w["start"]:w["end"]] == w["word"] for w in words)


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_cut_text_tokenizes_as_the_whole_text_truncated(onnx_dirs, direction):
    """The server cuts a long text at a whitespace before tokenizing it; with ModernBERT's byte-level
    BPE (a word behind a space is another token than the same word at the start) the ids must still
    be those of the whole text, truncated on that side."""
    from tokenizers import Tokenizer

    from bertdist.serve.runtime import load_served_model

    m = load_served_model(onnx_dirs["enc"])
    whole = Tokenizer.from_file(str(onnx_dirs["enc"] / "tokenizer.json"))
    whole.enable_truncation(m.max_length, direction=direction)
    for text in (" ".join(CORPUS * 8), "  ".join(reversed(CORPUS * 8)) + " tail"):
        (item,) = m.encode([text], truncate=True, direction=direction)
        assert item.input_ids.tolist() == whole.encode(text).ids and item.length == m.max_length
