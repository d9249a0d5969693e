"""BiEncoder and CrossEncoder against Hugging Face's own models on the same weights, and the
loaders' reading of sentence-transformers directories."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bertdist.embed.model import (BiEncoder, forward_by_length, is_cross_encoder_dir, is_sentence_transformers_dir,
                                  length_groups, load_bi_encoder, load_cross_encoder, pad_batch, read_st_layout)
from bertdist.export.hf import ExportError
from tests.embed import fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    return fixtures.tiny_checkpoint(d / "tiny", fixtures.word_vocab(d / "vocab.txt"))


@pytest.fixture(scope="module")
def texts():
    rows = fixtures.book_pairs(n=12)
    return [r["query"] for r in rows] + [r["positive"] for r in rows] + ["Anne.", "Mr Elliot"]


def _hf_hidden(ckpt, texts, max_len):
    from transformers import AutoModel, BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(str(ckpt))
    hf = AutoModel.from_pretrained(str(ckpt)).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    with torch.no_grad():
        return hf(**enc).last_hidden_state, enc["attention_mask"]


@pytest.mark.parametrize("pooling", ["mean", "cls", "max"])
def test_encode_matches_hugging_face_hidden_states_pooled(ckpt, texts, pooling):
    model = load_bi_encoder(ckpt, pooling=pooling, normalize=True, max_seq_length=48, kernels="reference")
    ours = model.encode(texts, batch_size=5)
    hidden, mask = _hf_hidden(ckpt, texts, 48)
    m = mask.unsqueeze(-1).bool()
    if pooling == "mean":
        ref = (hidden * m).sum(1) / m.sum(1)
    elif pooling == "cls":
        ref = hidden[:, 0]
    else:
        ref = hidden.masked_fill(~m, float("-inf")).amax(1)
    ref = torch.nn.functional.normalize(ref, dim=-1).numpy()
    assert ours.dtype == np.float32 and ours.shape == (len(texts), 128)
    assert np.abs(ours - ref).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_encode_returns_input_order_whatever_the_batching(ckpt, texts):
    model = load_bi_encoder(ckpt, max_seq_length=48, kernels="reference")
    one_by_one = np.concatenate([model.encode([t], batch_size=1) for t in texts])
    batched = model.encode(texts, batch_size=4)  # batches are formed longest-first
    assert np.abs(one_by_one - batched).max() < 1e-5
    # the rows are not all alike: order would matter
    assert np.abs(batched[0] - batched[-1]).max() > 1e-3
    assert model.encode([], batch_size=4).shape == (0, 128)


def test_length_groups_partition_the_batch_by_length():
    feats = [{"input_ids": [0] * n} for n in (9, 2, 7, 3, 5, 2, 8)]
    runs = length_groups(feats, 3, min_tokens=1)
    assert sorted(i for r in runs for i in r) == list(range(7))
    assert [len(r) for r in runs] == [2, 3, 2]
    assert [[len(feats[i]["input_ids"]) for i in r] for r in runs] == [[2, 2], [3, 5, 7], [8, 9]]
    assert length_groups(feats, 1, min_tokens=1) == [sorted(range(7), key=lambda i: len(feats[i]["input_ids"]))]
    assert len(length_groups(feats[:2], 4, min_tokens=1)) == 2  # never an empty group
    # 36 tokens: groups of at least 12 tokens -> 3; of at least 20 -> 1; short batches stay whole
    assert len(length_groups(feats, 4, min_tokens=12)) == 3
    assert len(length_groups(feats, 4, min_tokens=20)) == 1
    assert len(length_groups(feats, 4)) == 1


@pytest.mark.parametrize("groups", [2, 4])
def test_forward_by_length_gives_the_one_batch_outputs_and_gradients(ckpt, texts, groups):
    model = load_bi_encoder(ckpt, max_seq_length=48, kernels="reference").eval()  # no dropout: comparable
    feats = model.features(texts, 48)
    assert len({len(f["input_ids"]) for f in feats}) > groups  # the groups really pad differently

    def run(g):
        model.zero_grad()
        emb = forward_by_length(lambda b: model(b["input_ids"], b["attention_mask"], b["token_type_ids"]), feats, g,
                                "cpu", min_tokens=1)  # short texts: split them all the same
        (emb * torch.linspace(-1, 1, emb.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return emb.detach(), grads

    one = pad_batch(feats)
    with torch.no_grad():
        direct = model(one["input_ids"], one["attention_mask"], one["token_type_ids"])
    emb1, g1 = run(1)
    embg, gg = run(groups)
    assert torch.allclose(emb1, direct, atol=1e-6)
    assert (embg - emb1).abs().max() < 1e-5
    assert g1.keys() == gg.keys() and len(g1) > 10
    for name in g1:
        assert torch.allclose(g1[name], gg[name], atol=1e-5, rtol=1e-4), name


def test_truncation_and_no_normalisation(ckpt, texts):
    full = load_bi_encoder(ckpt, normalize=False, max_seq_length=48, kernels="reference").encode(texts)
    cut = load_bi_encoder(ckpt, normalize=True, truncate_dim=32, max_seq_length=48, kernels="reference").encode(texts)
    assert cut.shape == (len(texts), 32)
    want = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)
    assert np.abs(cut - want).max() < 1e-5
    assert not np.allclose(np.linalg.norm(full, axis=1), 1.0, atol=1e-2)
    with pytest.raises(ValueError, match="truncate_dim 200 is wider than the embeddings \\(128\\)"):
        load_bi_encoder(ckpt, truncate_dim=200, kernels="reference")


def test_cross_encoder_scores_equal_hugging_face_logits(ckpt, tmp_path):
    from transformers import AutoModelForSequenceClassification, BertTokenizerFast

    from bertdist.embed.export import write_cross_encoder

    torch.manual_seed(3)
    ce = load_cross_encoder(ckpt, max_seq_length=64, kernels="reference")
    assert ce.classifier.weight.shape == (1, 128)
    rows = fixtures.book_pairs(n=6)
    pairs = [(r["query"], r["positive"]) for r in rows] + [(rows[0]["query"], rows[1]["positive"])]
    ours = ce.score(pairs, batch_size=3)
    out = write_cross_encoder(tmp_path / "ce", ce)
    assert is_cross_encoder_dir(out) and not is_cross_encoder_dir(ckpt)
    hf = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    tok = BertTokenizerFast.from_pretrained(str(out))
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, truncation=True, max_length=64,
              return_tensors="pt")
    with torch.no_grad():
        ref = hf(**enc).logits.reshape(-1).numpy()
    assert np.abs(ours - ref).max() < 1e-5
    assert len(set(np.round(ours, 5))) > 1
    again = load_cross_encoder(out, kernels="reference")  # the head comes back, not a new one
    assert np.abs(again.score(pairs) - ours).max() < 1e-5
    assert again.max_seq_length == 64 and again.activation == "identity"


def _st_dir(tmp_path, ckpt, modules, pooling_conf, extra=None):
    import shutil

    d = tmp_path / "st"
    shutil.copytree(ckpt, d)
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling_conf))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    for name, content in (extra or {}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(content)
    return d


def test_sentence_transformers_layout_is_read(ckpt, tmp_path, texts):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    d = _st_dir(tmp_path, ckpt, modules, {"word_embedding_dimension": 128, "pooling_mode_cls_token": True,
                                           "pooling_mode_mean_tokens": False})
    assert is_sentence_transformers_dir(d)
    model = load_bi_encoder(d, kernels="reference")
    assert (model.pooling, model.normalize, model.max_seq_length) == ("cls", False, 40)
    direct = load_bi_encoder(ckpt, pooling="cls", normalize=False, max_seq_length=40, kernels="reference")
    assert np.abs(model.encode(texts) - direct.encode(texts)).max() < 1e-6
    # explicit arguments win over the directory
    assert load_bi_encoder(d, pooling="max", normalize=True, kernels="reference").pooling == "max"


def test_unsupported_modules_and_pooling_are_refused_naming_the_file(ckpt, tmp_path):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]
    d = _st_dir(tmp_path, ckpt, modules, {"word_embedding_dimension": 128, "pooling_mode_mean_tokens": True})
    with pytest.raises(ExportError, match=r"modules.json:\d+: modules \['Transformer', 'Pooling', 'LayerNorm'\] "
                                          r"are not supported"):
        read_st_layout(d)
    (d / "modules.json").write_text(json.dumps(modules[:2]))
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 128,
                                                             "pooling_mode_mean_tokens": True,
                                                             "pooling_mode_max_tokens": True}))
    with pytest.raises(ExportError, match=r"1_Pooling/config.json: pooling \['max', 'mean'\] is not supported"):
        load_bi_encoder(d)
    # a module folder outside the directory is never read
    (d / "modules.json").write_text(json.dumps([modules[0], {**modules[1], "path": "../elsewhere"}]))
    with pytest.raises(ExportError, match=r"lists '../elsewhere', which is outside"):
        read_st_layout(d)


def test_a_bi_encoder_is_not_loaded_from_a_cross_encoder_dir(ckpt, tmp_path):
    from bertdist.embed.export import write_cross_encoder

    out = write_cross_encoder(tmp_path / "ce", load_cross_encoder(ckpt, kernels="reference"))
    with pytest.raises(ExportError, match="a cross-encoder directory"):
        load_bi_encoder(out)


def test_pooler_is_kept_but_not_trained(ckpt):
    model = load_bi_encoder(ckpt, kernels="reference")
    assert isinstance(model, BiEncoder)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith("bert.pooler") for n in trainable)
    assert "bert.embeddings.word_embeddings.weight" in trainable
