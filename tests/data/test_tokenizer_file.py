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
    assert tf.continuation is not None and tf.word_marks == "'Ġ' word starts"  # byte-level: words from 'Ġ'
    assert require_continuation(tf, "token") is None and require_continuation(tf, "whole_word") is tf.continuation
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


TEXTS = ["Anne Elliot's walk, in 1814: unremarkable-looking fields.", "When shall we three meet again",
         "In thunder, lightning, or in rain? Fair is foul, and foul is fair!", "Hover through the fog and filthy air."]


def _byte_level_bpe(vocab_size: int = 400):
    """A byte-level BPE trained here in memory (GPT-2's pre-tokenizer, ModernBERT's layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    corpus = (SAMPLES / "books" / "shakespeare-macbeth.txt").read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                          show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    return tok


def _whitespace_words(text: str, enc) -> list[list[int]]:
    """Token positions grouped by the whitespace-separated word their last character falls in (a
    token of spaces alone goes with the word after it); special tokens in no word."""
    import re

    starts = [m.start() for m in re.finditer(r"\S+", text)]
    groups: dict[int, list[int]] = {}
    for pos, (tok_id, (a, b)) in enumerate(zip(enc.ids, enc.offsets)):
        if enc.special_tokens_mask[pos]:
            continue
        c = b - 1
        k = sum(s <= c for s in starts) - (0 if text[c].isspace() else 1)
        groups.setdefault(k, []).append(pos)
    return [groups[k] for k in sorted(groups)]


def test_a_byte_level_bpe_gives_whitespace_words_to_whole_word_masking(tmp_path):
    """The word-start table of a byte-level BPE groups a text's tokens into its whitespace words,
    as the tokenizer's own offsets place them (punctuation split off a word masks with it; the
    first word, with no space before it, starts after [CLS]); whole-word masking masks them whole."""
    from bertdist.data.masking import candidate_words
    from bertdist.train.masking import SpecialIds, dynamic_mask

    tok = _byte_level_bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    tf = load_tokenizer_file(tmp_path / "tokenizer.json")
    assert tf.word_marks == "'Ġ' word starts"
    assert not tf.continuation[list(tf.special_ids)].any()
    rows = []
    for text in TEXTS:
        enc = tok.encode(text)
        ids = np.asarray(enc.ids)
        special = np.isin(ids, list(tf.special_ids))
        words = [w.tolist() for w in candidate_words(special, tf.continuation[ids])]
        assert sum(len(w) > 1 for w in words) >= 2, enc.tokens  # words of several pieces: a real test
        assert words == _whitespace_words(text, enc), (text, enc.tokens)
        rows.append((ids, words))
    # two spaces: the pre-tokenizer leaves the first alone, a token of its own, then a word of its own
    enc = tok.encode("rain?  Fair")
    lone = enc.tokens.index("Ġ")
    ids = np.asarray(enc.ids)
    words = [w.tolist() for w in candidate_words(np.isin(ids, list(tf.special_ids)), tf.continuation[ids])]
    assert [lone] in words and enc.tokens[lone + 1].startswith("Ġ")
    width = max(len(ids) for ids, _ in rows)
    batch = np.full((len(rows), width), tf.special["pad"], np.int64)
    for r, (ids, _) in enumerate(rows):
        batch[r, :len(ids)] = ids
    lengths = np.array([len(ids) for ids, _ in rows])
    sp = SpecialIds(tf.special["pad"], tf.special["cls"], tf.special["sep"], tf.special["mask"])
    for seed in range(20):
        _, labels = dynamic_mask(batch.copy(), lengths, sp, tf.size, np.random.default_rng(seed), 0.3, 64,
                                 tf.continuation, mode="whole_word")
        for r, (_, words) in enumerate(rows):
            chosen = labels[r] != -100
            assert chosen.any()
            for w in words:  # every word is predicted whole or not at all
                assert chosen[w].all() or not chosen[w].any(), (seed, r, w)


def test_a_tokenizer_without_word_marks_is_refused_for_whole_words(tmp_path):
    """A BPE over a plain whitespace pre-tokenizer marks neither continuations nor word starts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=200, show_progress=False,
                                                       special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    tf = load_tokenizer_file(tmp_path / "tokenizer.json")
    assert tf.continuation is None and "nor word starts" in tf.continuation_why
    with pytest.raises(ConfigError, match="masking_mode 'span' needs word boundaries.*Whitespace"):
        require_continuation(tf, "span")
