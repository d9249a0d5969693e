"""Fast WordPiece (tokenizers) and the pipeline's cached document encoder == BERT's reference
Python tokenizer, id for id; vocab layout."""
from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.text import text_to_sentences
from data_pipeline.wordpiece import WordPieceEncoder


@pytest.mark.shared
@pytest.mark.parametrize("case", ["uncased", "cased"])
def test_fast_equals_reference_tokenizer_on_real_text(shared_data, case):
    import bz2

    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    vocab = shared_data / "vocab" / f"bert-base-{case}-vocab.txt"
    fast, lowercase = load_tokenizer(vocab)
    assert lowercase == (case == "uncased")
    slow = BertTokenizerLegacy(str(vocab), do_lower_case=lowercase)
    sents = text_to_sentences((shared_data / "books" / "melville-moby_dick.txt").read_text())[:1500]
    with bz2.open(shared_data / "wiki" / "enwiki-pages-articles-shortened.xml.bz2", "rb") as f:
        for n, (kind, blob) in enumerate(iter_page_blobs(f, 1 << 26)):
            page = parse_page(blob)[0]
            if page and not page.redirect and page.ns == 0 and len(sents) < 3000:
                for p in article_paragraphs(page.title, page.text) or []:
                    sents += text_to_sentences(p)
    sents += ["Café naïve résumé — “quoted” 東京 [MASK] text [UNK] x", "ﬁve\u200bzero\ttab\u00adsoft"]
    got = [e.ids for e in fast.encode_batch_fast(sents, add_special_tokens=False)]
    want = [slow.convert_tokens_to_ids(slow.tokenize(s)) for s in sents]
    bad = [(s, g, w) for s, g, w in zip(sents, got, want) if g != w]
    assert not bad, bad[:3]
    assert len(sents) > 2000
    # the pipeline's encoder, one "document" per 100 sentences (specials in their own document,
    # which takes the HF path), must give the same ids; empty sentences are dropped from bounds
    encoder = WordPieceEncoder(fast, lowercase)
    plain, special = sents[:-2], sents[-2:]
    for doc in [plain[i:i + 100] for i in range(0, len(plain), 100)] + [special]:
        ids, bounds = encoder.encode_document(doc)
        want_doc = [w for w in (slow.convert_tokens_to_ids(slow.tokenize(s)) for s in doc) if w]
        assert [ids[bounds[i]:bounds[i + 1]].tolist() for i in range(len(bounds) - 1)] == want_doc


TRICKY = [
    "Café naïve résumé — “quoted” 東京 text x", "ﬁve\u200bzero\ttab\u00adsoft", "a\x0bb c\x1fd\x7fe",
    "under_score $5.00 ½ ² ©2020 e\u0301 İstanbul ǅ ß ẞ", "x" * 150, "\u2028line\u2029sep\u00a0nb\u3000w",
    "", "   ", "\x00\x01", "trailing\n newline inside", "emoji 🙂👍🏽 and ＦＵＬＬ－ｗｉｄｔｈ", "Ελληνικά Кириллица עברית",
]


@pytest.mark.parametrize("lowercase", [True, False])
def test_document_encoder_matches_hf_on_tricky_text(small_vocab, lowercase):
    """Controls, accents, CJK, symbols, over-long words, odd whitespace, empty sentences."""
    from data_pipeline.tokenization import load_tokenizer

    tok, _ = load_tokenizer(small_vocab, lowercase)
    encoder = WordPieceEncoder(tok, lowercase)
    for doc in (TRICKY, TRICKY[::-1], ["[MASK] is special", "so is [SEP]"], ["a"], [""]):
        ids, bounds = encoder.encode_document(doc)
        want = [e.ids for e in tok.encode_batch_fast([s.replace("\n", " ") for s in doc], add_special_tokens=False)]
        got = [ids[bounds[i]:bounds[i + 1]].tolist() for i in range(len(bounds) - 1)]
        assert got == [w for w in want if w], doc
        assert bounds[0] == 0 and bounds[-1] == ids.shape[0] and (np.diff(bounds) > 0).all()


def test_special_token_strings_are_found_wherever_they_are(small_vocab):
    from data_pipeline.tokenization import load_tokenizer

    tok, lowercase = load_tokenizer(small_vocab)
    encoder = WordPieceEncoder(tok, lowercase)
    assert {"[MASK]", "[SEP]"} <= set(encoder.specials)
    for text in ("[MASK]", "a [SEP]", "[[MASK]", "[a] [b] x[CLS]y", "[" * 50 + "[UNK]"):
        assert encoder._holds_special(text), text
    for text in ("", "[", "[a] [MASKED? no: [MAS", "a]MASK[", "[mask]" if not lowercase else "[ SEP]"):
        assert not encoder._holds_special(text), text


@pytest.mark.parametrize("native", [False, None], ids=["python", "native-when-built"])
def test_document_encoder_cache_is_bounded(small_vocab, native):
    from data_pipeline.tokenization import load_tokenizer

    tok, lowercase = load_tokenizer(small_vocab)
    encoder = WordPieceEncoder(tok, lowercase, max_cached_words=50, native=native)
    first = encoder.encode_document([f"word{i} and more" for i in range(200)])
    assert encoder.cached_chunks > 50  # grew within the document ...
    again = encoder.encode_document([f"word{i} and more" for i in range(200)])
    assert encoder.cached_chunks <= 210  # ... and was reset before the next one, same ids
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])


def test_trained_vocab_has_bert_special_ids(small_vocab):
    from bertdist.data.vocab import load_vocab, special_token_ids

    tokens = load_vocab(small_vocab)
    assert len(tokens) == 3000
    assert special_token_ids(tokens) == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    assert tokens[1] == "[unused0]" and any(t.startswith("##") for t in tokens)


def test_gutenberg_and_text_helpers():
    from data_pipeline.text import cut_long_sentence, strip_gutenberg

    body, stripped = strip_gutenberg("head\n*** START OF THE PROJECT GUTENBERG EBOOK A ***\nBody text.\n"
                                     "End of the Project Gutenberg EBook of A\nlicence")
    assert stripped and body.strip() == "Body text."
    assert strip_gutenberg("No markers here.") == ("No markers here.", False)
    parts = cut_long_sentence("word " * 100, 50)
    assert all(len(p) <= 50 for p in parts) and " ".join(parts).split() == ["word"] * 100


def test_clean_line_equals_its_plain_definition():
    """clean_line's fast regexes == NFC, controls -> space, every whitespace run -> one space, strip."""
    import random
    import re
    import unicodedata

    from data_pipeline.text import clean_line

    def plain(t: str) -> str:
        t = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffe\uffff]", " ", unicodedata.normalize("NFC", t))
        return re.sub(r"[ \t\u00a0\u2000-\u200b\u3000]+", " ", t).strip()

    r = random.Random(0)
    alphabet = [" ", "  ", "\t", "\u00a0", "\u2003", "\u200b", "\u3000", "a", "Z", "\x01", "\x0c", "\x1f", "\x7f",
                "e\u0301", "\ufffe", "\u2028", "\n"]
    for _ in range(20000):
        s = "".join(r.choice(alphabet) for _ in range(r.randrange(14)))
        assert clean_line(s) == plain(s), repr(s)


def test_the_blocks_the_unicode_scan_skips_hold_nothing_it_looks_for():
    import unicodedata

    from data_pipeline import wordpiece

    looked_for = [cp for lo, hi in wordpiece._SKIPPED for cp in range(lo, hi)
                  if unicodedata.category(chr(cp))[0] == "P" or unicodedata.category(chr(cp)) in ("Cc", "Cf", "Mn")]
    assert looked_for == []
    # skipped and scanned blocks tile planes 0-2 from U+0080 (without the surrogates) and plane 14
    blocks = sorted(wordpiece._SKIPPED + wordpiece._SCANNED)
    assert all(a[1] == b[0] or (a[1], b[0]) in ((0xD800, 0xE000), (0x30000, 0xE0000)) for a, b in zip(blocks, blocks[1:]))
    assert blocks[0][0] == 128 and blocks[-1][1] == 0xF0000


def test_the_ascii_control_check_equals_its_regex():
    import random

    from data_pipeline import wordpiece

    for cp in range(0x3000):  # alone, and inside multi-byte neighbours
        for text in (chr(cp), f"é{chr(cp)}中"):
            assert wordpiece._has_ascii_control(text) == bool(wordpiece._ASCII_CONTROL.search(text)), hex(cp)
    r = random.Random(3)
    for _ in range(2000):
        text = "".join(r.choice("ab \n\t\r\x00\x1f\x7fé中\u0301") for _ in range(r.randrange(12)))
        assert wordpiece._has_ascii_control(text) == bool(wordpiece._ASCII_CONTROL.search(text)), repr(text)
