"""bertdist.data.tokenizer_file: a Hugging Face tokenizer.json's size, special ids and word marks,
read from the file (tokenizers trained here; nothing downloaded)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bertdist.config import ConfigError
from bertdist.data.tokenizer_file import load_tokenizer_file, replacement_ids, require_continuation
from tests.conftest import SAMPLES, train_bpe_tokenizer


def test_specials_of_a_modernbert_style_bpe_come_from_the_file(small_bpe_tokenizer):
    tf = load_tokenizer_file(small_bpe_tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(small_bpe_tokenizer))
    want = {r: tok.token_to_id(t) for r, t in (("pad", "[PAD]"), ("unk", "[UNK]"), ("cls", "[CLS]"),
                                               ("sep", "[SEP]"), ("mask", "[MASK]"))}
    assert tf.special == want and min(want.values()) >= 1900  # after the BPE vocabulary, as ModernBERT's
    assert tf.size == max(want.values()) + 1 == tok.get_vocab_size(with_added_tokens=True)
    assert tf.model_type == "BPE" and set(tf.special_ids) == set(want.values())
    assert tf.continuation is None and "continuing_subword_prefix" in tf.continuation_why
    assert require_continuation(tf, "token") is None
    with pytest.raises(ConfigError, match="masking_mode 'whole_word' needs word boundaries.*ByteLevel"):
        require_continuation(tf, "whole_word")
    repl = replacement_ids(tf.size, tf.special_ids)
    assert repl.size == tf.size - 5 and not set(repl.tolist()) & set(want.values())


def test_tokenizer_config_beside_the_file_names_the_specials(tmp_path):
    path = train_bpe_tokenizer(tmp_path / "tokenizer.json", SAMPLES / "books" / "shakespeare-macbeth.txt", 600)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<mymask>"])
    tok.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"mask_token": {"content": "<mymask>", "__type": "AddedToken"}, "cls_token": "[SEP]"}))
    tf = load_tokenizer_file(path)
    assert tf.special["mask"] == tok.token_to_id("<mymask>") and tf.special["cls"] == tok.token_to_id("[SEP]")


def test_a_tokenizer_without_a_mask_token_is_refused_naming_what_it_has(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a small text to learn from"] * 3, trainers.BpeTrainer(vocab_size=60, show_progress=False))
    tok.add_special_tokens(["[CLS]", "[SEP]", "[PAD]", "[UNK]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"no mask token found.*mask_token"):
        load_tokenizer_file(tmp_path / "tokenizer.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer_file(tmp_path / "bad.json")


def test_a_wordpiece_tokenizer_json_marks_continuations(tmp_path, small_vocab):
    """BERT's tokenizer as a tokenizer.json: the same special ids as the vocab.txt, and the '##'
    pieces as continuation pieces, so whole-word masking works with it."""
    from bertdist.data.vocab import continuation_mask, load_vocab, special_token_ids
    from data_pipeline.tokenization import load_tokenizer

    tok, _ = load_tokenizer(small_vocab)
    tok.save(str(tmp_path / "tokenizer.json"))
    tf = load_tokenizer_file(tmp_path / "tokenizer.json")
    tokens = load_vocab(small_vocab)
    assert tf.special == special_token_ids(tokens) and tf.size == len(tokens) and tf.model_type == "WordPiece"
    assert np.array_equal(tf.continuation, continuation_mask(small_vocab))
    assert require_continuation(tf, "span") is tf.continuation
    assert continuation_mask(tmp_path / "tokenizer.json") is tf.continuation
