"""`bertdist export` of a ModernBERT run writes the tokenizer its data was tokenized with (a
byte-level BPE tokenizer.json, or a WordPiece vocab.txt), so that ``AutoTokenizer`` on the export
encodes the ids the data pipeline did; a missing tokenizer file, or one whose bytes are not the
ones the data manifest fingerprinted, is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from bertdist.cli.main import main
from tests.conftest import SAMPLES, train_bpe_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["When shall we three meet again in thunder, lightning, or in rain?",
         "Fair is foul, and foul is fair: hover through the fog and filthy air.",
         "Anne Elliot walked to Kellynch Hall in 1814."]


def _run(tmp_path, vocab_file):
    """A trainer checkpoint of a tiny ModernBERT whose resolved config names ``vocab_file`` as its
    data's tokenizer and a manifest whose vocab section is the pipeline's own for that file."""
    from data_pipeline.build_vocab import BuildVocab
    from bertdist.data.vocab import vocab_file_size
    from bertdist.export.sources import PretrainedWeights
    from bertdist.export.trainer_init import TAG, write_trainer_init
    from bertdist.model.modernbert import ModernBertForMaskedLM
    from bertdist.model.modernbert_config import ModernBertConfig
    from bertdist.train.checkpoint import CONFIG_FILE

    records = tmp_path / "records"
    records.mkdir()
    vocab = BuildVocab.load(str(vocab_file), None)
    (records / "manifest.json").write_text(json.dumps({"vocab": vocab.manifest_vocab()}))
    n = vocab_file_size(vocab_file)
    cfg = ModernBertConfig.from_preset("tiny", vocab_size=n + (-n) % 8, max_position_embeddings=128,
                                       local_attention=32, pad_token_id=vocab.special["pad"],
                                       cls_token_id=vocab.special["cls"], sep_token_id=vocab.special["sep"],
                                       bos_token_id=vocab.special["cls"], eos_token_id=vocab.special["sep"])
    torch.manual_seed(0)
    sd = ModernBertForMaskedLM(cfg).state_dict()
    run = write_trainer_init(tmp_path / "run", PretrainedWeights(cfg, sd, None, None, {}), "test")
    conf = run / TAG / CONFIG_FILE
    run_cfg = yaml.safe_load(conf.read_text())
    run_cfg["data"] = {"train_manifest": str(records / "manifest.json"), "vocab_file": str(vocab_file)}
    conf.write_text(yaml.safe_dump(run_cfg))
    return run, vocab


def _pipeline_ids(vocab_file, text):
    from data_pipeline.tokenization import load_encoder

    ids, _ = load_encoder(str(vocab_file), None).encode_document([text])
    return [int(i) for i in ids]


def _export(run, out, *extra):
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["export", str(run), "--out", str(out), *extra])
    return code, printed.getvalue()


def test_a_bpe_run_exports_its_tokenizer_json_and_autotokenizer_encodes_as_the_pipeline(tmp_path):
    tok_json = train_bpe_tokenizer(tmp_path / "bpe" / "tokenizer.json", SAMPLES / "books" / "shakespeare-macbeth.txt",
                                   vocab_size=400)
    run, vocab = _run(tmp_path, tok_json)
    code, printed = _export(run, tmp_path / "hf")
    assert code == 0, printed
    assert "tokenizer.json, tokenizer_config.json" in printed and "-> OK" in printed, printed
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok_json.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert {r: tok.convert_tokens_to_ids(getattr(tok, f"{r}_token")) for r in vocab.special} == vocab.special
    for text in TEXTS:
        ids = _pipeline_ids(tok_json, text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert tok(text)["input_ids"] == [vocab.special["cls"], *ids, vocab.special["sep"]]
    assert tok.model_max_length == 128
    hf = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "hf")
    assert hf.config.cls_token_id == tok.cls_token_id and hf.config.pad_token_id == tok.pad_token_id
    longest = max(len(tok(t).input_ids) for t in TEXTS)
    assert hf(**tok(TEXTS, padding=True, return_tensors="pt")).logits.shape[:2] == (3, longest)


def test_a_wordpiece_run_exports_bert_tokenizer_files(tmp_path, small_vocab):
    run, vocab = _run(tmp_path, small_vocab)
    code, printed = _export(run, tmp_path / "hf")
    assert code == 0, printed
    assert "vocab.txt" in printed, printed
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.mask_token_id == vocab.special["mask"] and tok("Anne Elliot")["input_ids"] == tok("anne elliot")["input_ids"]
    for text in TEXTS:
        assert tok(text, add_special_tokens=False)["input_ids"] == _pipeline_ids(small_vocab, text), text
    hf = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "hf")
    assert sorted(tok(TEXTS[0])) == ["attention_mask", "input_ids"]  # no token types: it goes into the model as is
    assert hf(**tok(TEXTS, padding=True, return_tensors="pt")).logits.shape[0] == 3


def test_a_missing_or_altered_tokenizer_is_refused(tmp_path):
    from bertdist.data.vocab import vocab_sha256

    tok_json = train_bpe_tokenizer(tmp_path / "bpe" / "tokenizer.json", SAMPLES / "books" / "shakespeare-macbeth.txt",
                                   vocab_size=400)
    run, vocab = _run(tmp_path, tok_json)
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    spec = json.loads(tok_json.read_text())
    spec["normalizer"] = {"type": "Lowercase"}  # same vocabulary, other ids for capitalised words
    other.write_text(json.dumps(spec))
    code, printed = _export(run, tmp_path / "hf", "--vocab", str(other))
    assert code == 2, printed
    assert f"{other} has sha256 {vocab_sha256(other)}" in printed and vocab_sha256(tok_json) in printed, printed
    assert not (tmp_path / "hf").exists()

    shutil.rmtree(tok_json.parent)
    code, printed = _export(run, tmp_path / "hf")
    assert code == 2, printed
    assert f"tokenized with {tok_json}" in printed and "which is not there; pass --vocab FILE" in printed, printed
    shutil.copytree(other.parent, tok_json.parent)  # a file of that name, but not the bytes the data used
    code, printed = _export(run, tmp_path / "hf")
    assert code == 2 and f"but the run's data ({tmp_path / 'records' / 'manifest.json'})" in printed, printed


def test_fine_tuning_a_bpe_run_tokenizes_with_its_tokenizer_json(tmp_path):
    """A run's checkpoint read for fine-tuning names the tokenizer.json its data used as its own
    tokenizer (not as a WordPiece vocab), and fine-tuning encodes with it as the pipeline did."""
    from bertdist.export.sources import load_pretrained
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.finetune.train import resolve_tokenizer

    tok_json = train_bpe_tokenizer(tmp_path / "bpe" / "tokenizer.json", SAMPLES / "books" / "shakespeare-macbeth.txt",
                                   vocab_size=400)
    run, vocab = _run(tmp_path, tok_json)
    w = load_pretrained(run)
    assert w.vocab_file is None and w.tokenizer_json == tok_json
    tok = resolve_tokenizer(FinetuneConfig(task="sst2", checkpoint=str(run)), w)
    for text in TEXTS:
        assert tok(text)["input_ids"] == [vocab.special["cls"], *_pipeline_ids(tok_json, text), vocab.special["sep"]]
