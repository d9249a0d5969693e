"""HF export/import: clean loading in transformers, logits parity, lossless round trips."""
from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from bertdist.export import ExportError, bert_tokenizer, infer_do_lower_case, read_hf_dir, write_hf_dir
from bertdist.export.sources import load_pretrained, write_torch_dir
from bertdist.export.verify import max_logit_diff, padded_batch
from bertdist.model import BertConfig, BertForPreTraining

pytestmark = pytest.mark.shared

PRETRAIN_HEADS = {"cls.predictions.bias", "cls.predictions.transform.dense.weight",
                  "cls.predictions.transform.dense.bias", "cls.predictions.transform.LayerNorm.weight",
                  "cls.predictions.transform.LayerNorm.bias", "cls.seq_relationship.weight",
                  "cls.seq_relationship.bias"}


def sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def vocab(shared_data):
    return shared_data / "vocab" / "bert-base-uncased-vocab.txt"


@pytest.fixture(scope="module")
def ours(vocab):
    torch.manual_seed(0)
    cfg = BertConfig.from_preset("tiny", kernels="reference")
    model = BertForPreTraining(cfg, device_type="cpu")
    # Make the heads non-trivial (zero-initialised biases would hide a dropped or swapped bias).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return cfg, model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, ours, vocab):
    cfg, model = ours
    out = tmp_path_factory.mktemp("hf")
    write_hf_dir(out, cfg, model.state_dict(), vocab)
    return out


def test_export_writes_hf_files_with_tied_embeddings(exported):
    from safetensors import safe_open

    for name in ("config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).is_file(), name
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "cls.predictions.decoder.weight" not in keys  # tied: stored once, as HF does
    assert PRETRAIN_HEADS <= keys and "bert.pooler.dense.weight" in keys


def test_transformers_loads_every_key(exported):
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, BertForPreTraining as HF

    model, info = HF.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    _, info = AutoModelForMaskedLM.from_pretrained(str(exported), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers 5 lists the parts a masked-LM model has no place for (NSP head, pooler) as unexpected.
    assert set(info["unexpected_keys"]) == {"cls.seq_relationship.weight", "cls.seq_relationship.bias",
                                            "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    _, info = AutoModelForSequenceClassification.from_pretrained(str(exported), num_labels=3, output_loading_info=True)
    assert set(info["missing_keys"]) == {"classifier.weight", "classifier.bias"}  # the new task head only
    assert set(info["unexpected_keys"]) == PRETRAIN_HEADS and not info["mismatched_keys"]  # cls.* only: no bert.* key


def test_exported_logits_match_ours_on_padded_batch(exported, ours):
    cfg, model = ours
    d = max_logit_diff(exported, cfg, model.state_dict())
    assert d["mlm"] <= 1e-4 and d["nsp"] <= 1e-4, d


def test_fill_mask_pipeline_and_tokenizer_casing(exported, ours):
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(str(exported))
    assert tok.tokenize("Hello World") == ["hello", "world"]  # uncased vocab -> lower-casing tokenizer
    fill = pipeline("fill-mask", model=str(exported), top_k=3)
    out = fill("the cat sat on the [MASK] .")
    assert len(out) == 3 and all(o["token_str"] for o in out)
    # the pipeline's top token is our model's argmax at the mask position
    cfg, model = ours
    enc = tok("the cat sat on the [MASK] .", return_tensors="pt")
    with torch.no_grad():
        logits = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).prediction_logits
    pos = (enc["input_ids"][0] == tok.mask_token_id).nonzero().item()
    assert out[0]["token"] == logits[0, pos].argmax().item()


def test_cased_vocab_exports_cased_tokenizer(tmp_path, shared_data):
    cased = shared_data / "vocab" / "bert-base-cased-vocab.txt"
    assert infer_do_lower_case(cased) is False
    assert infer_do_lower_case(shared_data / "vocab" / "bert-base-uncased-vocab.txt") is True
    cfg = BertConfig.from_preset("tiny", kernels="reference", vocab_size=28996)
    model = BertForPreTraining(cfg, device_type="cpu")
    write_hf_dir(tmp_path, cfg, model.state_dict(), cased)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path)).tokenize("Hello") == ["Hello"]
    assert read_hf_dir(tmp_path).do_lower_case is False


def test_vocab_size_mismatch_is_an_error(tmp_path, ours, shared_data):
    cfg, model = ours
    with pytest.raises(ExportError, match="28996 tokens but the model's vocab_size is 30522"):
        write_hf_dir(tmp_path, cfg, model.state_dict(), shared_data / "vocab" / "bert-base-cased-vocab.txt")


def test_hf_to_ours_to_hf_is_bitwise_identical(tmp_path, vocab):
    from transformers import BertConfig as HFConfig, BertForPreTraining as HF

    torch.manual_seed(1)
    hf = HF(HFConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128))
    src = tmp_path / "src"
    hf.save_pretrained(str(src))
    bert_tokenizer(vocab, True).save_pretrained(str(src))
    shutil.copyfile(vocab, src / "vocab.txt")

    ck = read_hf_dir(src, kernels="reference")
    assert not ck.fresh_keys
    model = BertForPreTraining(ck.config, device_type="cpu")
    model.load_state_dict(ck.state_dict, strict=True)
    # through our torch format too: HF -> import-hf -> export
    mid = write_torch_dir(tmp_path / "mid", load_pretrained(src))
    w = load_pretrained(mid)
    back = write_hf_dir(tmp_path / "back", w.config, w.state_dict, w.vocab_file, w.do_lower_case)
    assert sha(src / "model.safetensors") == sha(back / "model.safetensors")
    direct = write_hf_dir(tmp_path / "direct", ck.config, model.state_dict(), vocab, True)
    assert sha(src / "model.safetensors") == sha(direct / "model.safetensors")
    batch = padded_batch(30522)
    with torch.no_grad():
        a, b = model.eval()(**batch), hf.eval()(**batch)
    assert (a.seq_relationship_logits - b.seq_relationship_logits).abs().max() <= 1e-4


def test_import_legacy_and_partial_hf_checkpoints(tmp_path, vocab):
    """gamma/beta names, a position_ids buffer, no NSP head (a masked-LM checkpoint)."""
    from transformers import BertConfig as HFConfig, BertForMaskedLM

    torch.manual_seed(2)
    hf = BertForMaskedLM(HFConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=128))
    sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
          for k, v in hf.state_dict().items() if k != "cls.predictions.decoder.weight"}
    sd["bert.embeddings.position_ids"] = torch.arange(512)[None]
    src = tmp_path / "legacy"
    src.mkdir()
    torch.save(sd, src / "pytorch_model.bin")
    hf.config.to_json_file(str(src / "config.json"))
    shutil.copyfile(vocab, src / "vocab.txt")
    ck = read_hf_dir(src, kernels="reference")
    assert {k.rsplit(".", 1)[0] for k in ck.fresh_keys} == {"cls.seq_relationship", "bert.pooler.dense"}
    model = BertForPreTraining(ck.config, device_type="cpu")
    model.load_state_dict(ck.state_dict, strict=True)
    batch = padded_batch(30522, seq=16)
    with torch.no_grad():
        ours = model.eval()(**batch).prediction_logits
        theirs = hf.eval()(**batch).logits
    real = batch["attention_mask"].bool()
    assert (ours - theirs)[real].abs().max() <= 1e-4


def test_import_rejects_non_bert(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "roberta"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ExportError, match="roberta"):
        read_hf_dir(tmp_path)
