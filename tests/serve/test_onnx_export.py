"""`bertdist export --format onnx`: parity for every task type, the int8 gate, and the output directory rules."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bertdist.serve.card import CARD, FILES, read_card
from bertdist.serve.onnx_export import ExportOptions, export_onnx
from bertdist.serve.runtime import make_session
from tests.serve.conftest import make_hf_dir, self_labelled_sst2

KINDS = ["classification", "regression", "token", "span", "choice", "encoder"]
SENTENCES = ["A short one.", "The captain walked slowly along the deck, thinking of the letter he had not sent.",
             "Yes", "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
             "age of foolishness, it was the epoch of belief, it was the epoch of incredulity.", "Rain again."]


def hf_outputs(hf_dir, kind, enc, family="Bert"):
    """The transformers model as users load it (default attention), independent of the export's own reference."""
    import torch
    import transformers

    from tests.serve.conftest import architecture

    model = getattr(transformers, architecture(kind, family)).from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in enc.items()})
    if kind == "encoder":
        h = out.last_hidden_state.numpy()
        m = enc["attention_mask"][..., None]
        return [h, (h * m).sum(1) / m.sum(1)]
    if kind == "span":
        return [out.start_logits.numpy(), out.end_logits.numpy()]
    return [out.logits.numpy()]


def encode(hf_dir, kind, texts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    if kind == "choice":
        firsts = [t for t in texts for _ in range(3)]
        seconds = [texts[(i + c + 1) % len(texts)] for i in range(len(texts)) for c in range(3)]
        enc = tok(firsts, seconds, padding=True, return_tensors="np")
        return {k: enc[k].reshape(len(texts), 3, -1).astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    enc = tok(texts, padding=True, return_tensors="np")
    return {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}


@pytest.mark.parametrize("kind", KINDS)
def test_every_task_type_exports_with_parity(kind, hf_model, onnx_model):
    out = onnx_model(kind)
    card = read_card(out)
    assert card["task"] == kind and card["opset"] >= 17
    assert set(card["files"]) == {"fp32", "optimized"}
    for variant in ("fp32", "optimized"):
        assert card["parity"][variant]["max_abs_diff"] <= 1e-4
        assert card["parity"][variant]["tokens_max"] > 3 * card["parity"][variant]["tokens_min"]  # varied lengths
    assert (out / "tokenizer.json").is_file() and (out / "vocab.txt").is_file()
    if kind in ("classification", "token"):
        id2label = json.loads((hf_model(kind) / "config.json").read_text())["id2label"]
        assert card["labels"] == [id2label[str(i)] for i in range(len(id2label))]
    # dynamic axes: batch sizes 1 and 5, sequence lengths other than the traced example's
    for texts in (SENTENCES[:1], SENTENCES):
        assert_onnx_matches_transformers(out, hf_model(kind), kind, texts)


def assert_onnx_matches_transformers(out, hf_dir, kind, texts, family="Bert"):
    """Every exported fp32 variant's outputs equal the transformers model's within 1e-4 (hidden
    states compared at real tokens only)."""
    enc = encode(hf_dir, kind, texts)
    ref = hf_outputs(hf_dir, kind, enc, family)
    for variant in ("fp32", "optimized"):
        got = make_session(out / FILES[variant]).run(None, enc)
        assert len(got) == len(ref)
        for r, g in zip(ref, got):
            assert r.shape == g.shape
            if kind == "encoder" and r.ndim == 3:
                r, g = r * enc["attention_mask"][..., None], g * enc["attention_mask"][..., None]
            np.testing.assert_allclose(g, r, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_electra_models_export_with_parity(kind, tmp_path, small_vocab):
    src = make_hf_dir(tmp_path / "hf", kind, small_vocab, family="Electra")
    out = tmp_path / "onnx"
    card = export_onnx(src, out, ExportOptions(optimize=True), log=lambda *_: None)
    assert card["model_type"] == "electra" and card["task"] == kind
    assert card["architecture"].startswith("Electra")
    # BERT's fusions, a narrower embedding (16 -> 32, projected) notwithstanding
    assert {k: card["fused"].get(k) for k in ("EmbedLayerNormalization", "Attention", "SkipLayerNormalization")} == {
        "EmbedLayerNormalization": 1, "Attention": 2, "SkipLayerNormalization": 4}
    for variant in ("fp32", "optimized"):
        assert card["parity"][variant]["max_abs_diff"] <= 1e-4
    assert_onnx_matches_transformers(out, src, kind, SENTENCES, family="Electra")


def test_electra_discriminator_exports_as_an_encoder_with_int8(tmp_path, small_vocab):
    import transformers

    src = make_hf_dir(tmp_path / "hf", "encoder", small_vocab, family="Electra")
    conf = transformers.ElectraConfig.from_pretrained(str(src))
    transformers.ElectraForPreTraining(conf).save_pretrained(str(tmp_path / "disc"))
    for name in ("tokenizer.json", "vocab.txt"):
        (tmp_path / "disc" / name).write_bytes((src / name).read_bytes())
    card = export_onnx(tmp_path / "disc", tmp_path / "out", ExportOptions(quantize="int8"), log=lambda *_: None)
    assert card["task"] == "encoder" and card["architecture"] == "ElectraForPreTraining"
    assert card["parity"]["fp32"]["max_abs_diff"] <= 1e-4
    assert card["parity"]["int8"]["min_cosine"] >= 0.98


def test_pretraining_directory_exports_as_an_encoder(tmp_path, small_vocab):
    src = make_hf_dir(tmp_path / "hf", "encoder", small_vocab)
    import transformers

    conf = transformers.BertConfig.from_pretrained(str(src))
    transformers.BertForPreTraining(conf).save_pretrained(str(tmp_path / "pre"))
    (tmp_path / "pre" / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (tmp_path / "pre" / "vocab.txt").write_bytes((src / "vocab.txt").read_bytes())
    card = export_onnx(tmp_path / "pre", tmp_path / "out", ExportOptions(quantize="int8"), log=lambda *_: None)
    assert card["task"] == "encoder" and card["outputs"] == ["last_hidden_state", "sentence_embedding"]
    assert (tmp_path / "out" / "model.int8.onnx").is_file()
    assert card["parity"]["int8"]["min_cosine"] >= 0.98


def _negate_logits(path):
    """Turn an ONNX classifier into its opposite: every argmax flips (for two labels)."""
    import onnx

    m = onnx.load(str(path))
    out = m.graph.output[0].name
    for node in m.graph.node:
        node.output[:] = [o + "_raw" if o == out else o for o in node.output]
    m.graph.node.append(onnx.helper.make_node("Neg", [out + "_raw"], [out]))
    onnx.save(m, str(path))


def test_int8_is_refused_when_the_dev_metric_drops(tmp_path, hf_model, onnx_model, monkeypatch):
    from bertdist.serve import int8_fallback, onnx_export

    dev = self_labelled_sst2(tmp_path, onnx_model("classification"))
    ok = export_onnx(hf_model("classification"), tmp_path / "ok", ExportOptions(
        quantize="int8", task="sst2", dev=str(dev), tolerance_points=10.0), log=lambda *_: None)
    p = ok["parity"]["int8"]
    assert p["metric"] == "accuracy" and p["fp32"] == 1.0 and p["examples"] == 64
    assert p["int8"] >= 0.9 and p["within_tolerance"]
    assert ok["files"]["int8"] == "model.int8.onnx"

    real = int8_fallback.quantize

    def broken_int8(src, dst, *args, **kwargs):  # a real int8 model, made wrong on purpose
        settings = real(src, dst, *args, **kwargs)
        _negate_logits(dst)
        return settings

    monkeypatch.setattr(int8_fallback, "quantize", broken_int8)
    with pytest.raises(onnx_export.ExportError, match=r"int8 refused: sst2 dev accuracy drops from 1.0000 to 0.0000, "
                                                      r"100.00 points, above the tolerance of 1.0 points \(64 examples\); "
                                                      r"keeping up to 1 of the most sensitive nodes in fp32 "
                                                      r"\(--int8-fallback-steps 1\) reached at best 0.0000"):
        export_onnx(hf_model("classification"), tmp_path / "bad", ExportOptions(quantize="int8", task="sst2", dev=str(dev),
                                                                                fallback_steps=1), log=lambda *_: None)
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad.")]  # no staging left behind


def test_cli_needs_a_dev_set_for_int8_of_a_task_model(tmp_path, hf_model, capsys):
    from bertdist.cli.main import main

    rc = main(["export", str(hf_model("classification")), "--format", "onnx", "--quantize", "int8",
               "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "pass --task NAME and --dev DIR_OR_FILE" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def test_cli_never_writes_over_a_users_directory(tmp_path, hf_model, capsys):
    from bertdist.cli.main import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    rc = main(["export", str(hf_model("token")), "--format", "onnx", "--out", str(mine)])
    assert rc == 2 and "not an ONNX export" in capsys.readouterr().out
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1

    out = tmp_path / "o"
    assert main(["export", str(hf_model("token")), "--format", "onnx", "--out", str(out)]) == 0
    assert main(["export", str(hf_model("token")), "--format", "onnx", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().out
    assert main(["export", str(hf_model("token")), "--format", "onnx", "--optimize", "--overwrite", "--out", str(out)]) == 0
    assert set(json.loads((out / CARD).read_text())["files"]) == {"fp32", "optimized"}


def test_a_non_bert_or_non_model_directory_is_refused(tmp_path, capsys):
    from bertdist.cli.main import main

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2Model"]}))
    (tmp_path / "x" / "model.safetensors").write_bytes(b"")
    assert main(["export", str(tmp_path / "x"), "--format", "onnx", "--out", str(tmp_path / "o")]) == 2
    assert "model_type 'gpt2'" in capsys.readouterr().out


@pytest.fixture(scope="module")
def embed_ckpt(tmp_path_factory):
    from tests.embed import fixtures

    d = tmp_path_factory.mktemp("embed_ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


@pytest.mark.parametrize("pooling,normalize,truncate", [("cls", True, None), ("max", False, 48)])
def test_bi_encoder_exports_with_its_pooling_in_the_graph(embed_ckpt, tmp_path, pooling, normalize, truncate):
    """A sentence-transformers directory written by `finetune embed`: the ONNX sentence embedding is
    SentenceTransformer(DIR)'s (pooling, Dense, Normalize in the graph), and /embed serves it."""
    st = pytest.importorskip("sentence_transformers")
    from bertdist.embed.export import write_bi_encoder
    from bertdist.embed.model import load_bi_encoder
    from bertdist.serve.runtime import load_served_model
    from tests.embed import fixtures

    model = load_bi_encoder(embed_ckpt, pooling=pooling, normalize=normalize, truncate_dim=truncate,
                            max_seq_length=64, kernels="reference")
    src = write_bi_encoder(tmp_path / "st", model)
    card = export_onnx(src, tmp_path / "onnx", ExportOptions(quantize="int8"), log=lambda *_: None)
    assert card["task"] == "encoder" and card["pooling"] == pooling and card["normalized"] is normalize
    texts = [r["query"] for r in fixtures.book_pairs(n=6)] + [r["positive"] for r in fixtures.book_pairs(n=6)]
    want = st.SentenceTransformer(str(src), device="cpu").encode(texts, batch_size=4, convert_to_numpy=True)
    served = load_served_model(tmp_path / "onnx", variant="fp32")
    job = served.prepare("embed", {"inputs": texts, "normalize": False})
    got = np.asarray(job.finish(served.run(job.items)))
    assert got.shape == want.shape == (len(texts), truncate or 128)
    assert np.abs(got - want).max() < 1e-5


def test_cross_encoder_exports_and_reranks_as_sentence_transformers_scores(embed_ckpt, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from bertdist.embed.export import write_cross_encoder
    from bertdist.embed.model import load_cross_encoder
    from bertdist.serve.runtime import load_served_model
    from tests.embed import fixtures

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    ce = load_cross_encoder(embed_ckpt, max_seq_length=96, activation="sigmoid", kernels="reference")
    src = write_cross_encoder(tmp_path / "ce", ce)
    card = export_onnx(src, tmp_path / "onnx", ExportOptions(), log=lambda *_: None)
    assert card["task"] == "regression" and card["activation"] == "sigmoid"
    rows = fixtures.book_pairs(n=5)
    query, texts = rows[0]["query"], [r["positive"] for r in rows]
    want = st.CrossEncoder(str(src), device="cpu").predict([(query, t) for t in texts])
    served = load_served_model(tmp_path / "onnx")
    assert served.routes == ("predict", "rerank")
    job = served.prepare("rerank", {"query": query, "texts": texts})
    answer = job.finish(served.run(job.items))
    assert [a["index"] for a in answer] == list(np.argsort(-np.asarray(want), kind="stable"))
    got = {a["index"]: a["score"] for a in answer}
    assert max(abs(got[i] - float(want[i])) for i in range(len(texts))) < 1e-5


class _RunsCode:
    """Unpickling this runs ``touch MARKER``: what a poisoned pytorch_model.bin can do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_poisoned_pytorch_model_bin_is_refused(tmp_path, small_vocab, capsys):
    import shutil

    import torch
    from safetensors.torch import load_file

    from bertdist.cli.main import main

    src = make_hf_dir(tmp_path / "hf", "classification", small_vocab)
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    torch.save({**state, "payload": _RunsCode(marker)}, src / "pytorch_model.bin")
    assert main(["export", str(src), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 1
    out = capsys.readouterr().out
    assert "pytorch_model.bin: refused to load" in out and "--trust-checkpoint" in out, out
    assert not marker.exists() and not (tmp_path / "onnx").exists()
    # Plain tensors in the same format load without the flag, through the same safe reader.
    torch.save(state, src / "pytorch_model.bin")
    shutil.rmtree(tmp_path / "onnx", ignore_errors=True)
    assert main(["export", str(src), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0, capsys.readouterr()
    assert read_card(tmp_path / "onnx")["task"] == "classification"


@pytest.mark.parametrize("change,words", [({"num_attention_heads": 0}, "num_attention_heads is 0"),
                                         ({"num_attention_heads": 3}, "hidden_size 32 does not split into 3"),
                                         ({"hidden_size": "32"}, "hidden_size is '32'")])
def test_a_bad_config_is_refused_with_a_message(tmp_path, hf_model, capsys, change, words):
    import shutil

    from bertdist.cli.main import main

    src = tmp_path / "hf"
    shutil.copytree(hf_model("classification"), src)
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, **change}))
    assert main(["export", str(src), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 2
    out = capsys.readouterr().out
    assert words in out and "Traceback" not in out, out
