"""The native WordPiece encoder (data_pipeline._native_wordpiece) against the Python path of
WordPieceEncoder and HF tokenizers: the same ids (dtype included) and sentence bounds on tricky
text, random text, edge words, real books and Wikipedia with the cased and uncased BERT vocabs,
a vocab with uint32 ids, and with a small cache that resets; argument errors."""
from __future__ import annotations

import random

import numpy as np
import pytest

from data_pipeline import wordpiece
from data_pipeline.wordpiece import WordPieceEncoder

pytestmark = pytest.mark.skipif(not wordpiece.native_available(),
                                reason=wordpiece.native_unavailable_reason() or "native encoder not built")


def encoders(tok, lowercase, **kw):
    native = WordPieceEncoder(tok, lowercase, native=True, **kw)
    python = WordPieceEncoder(tok, lowercase, native=False, **kw)
    assert native.native and not python.native
    return native, python


def assert_same(native, python, doc):
    got, want = native.encode_document(doc), python.encode_document(doc)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype == np.int64
    assert np.array_equal(got[0], want[0]), doc
    assert np.array_equal(got[1], want[1]), doc
    return got


def sentences_of(ids, bounds):
    return [ids[bounds[i]:bounds[i + 1]].tolist() for i in range(len(bounds) - 1)]


@pytest.mark.parametrize("lowercase", [True, False])
def test_native_matches_python_and_hf_on_tricky_text(small_vocab, lowercase):
    from data_pipeline.tokenization import load_tokenizer
    from tests.data_pipeline.test_tokenization import TRICKY

    tok, _ = load_tokenizer(small_vocab, lowercase)
    native, python = encoders(tok, lowercase)
    for doc in (TRICKY, TRICKY[::-1], ["[MASK] is special", "so is [SEP]"], ["a"], [""], [], ["\n", "a\nb"]):
        ids, bounds = assert_same(native, python, doc)
        want = [e.ids for e in tok.encode_batch_fast([s.replace("\n", " ") for s in doc], add_special_tokens=False)]
        assert sentences_of(ids, bounds) == [w for w in want if w], doc
        assert bounds[0] == 0 and bounds[-1] == ids.shape[0] and (np.diff(bounds) > 0).all()


EDGE_WORDS = [
    "x" * 100, "x" * 101, "é" * 100, "é" * 101, "東" * 101, "ab" * 60 + ",", "🙂" * 101, "qqqqzzzzxxxx",
    "zzz\u0301", "e\u0301\u0302\u0303", "a🙂b", "🙂", "👍🏽", "東京都", "##", "###", "#a#", "a##b", "naïve",
    "\U00020000\U0002a6df", "\u0600\u0601x", "ÿ" * 3, "ﬁve", "x\u200bx", "İ", "ǅ", "ß", "\uffff", "a\U0010ffff",
]


@pytest.mark.parametrize("lowercase", [True, False])
def test_native_edge_words(small_vocab, lowercase):
    """Over-long words (counted in characters, not bytes), words without a match, CJK, emoji,
    combining marks, the prefix itself; each word alone through HF's model too."""
    from data_pipeline.tokenization import load_tokenizer

    tok, _ = load_tokenizer(small_vocab, lowercase)
    native, python = encoders(tok, lowercase)
    for w in EDGE_WORDS:
        assert native._native.wordpiece(w) == [t.id for t in tok.model.tokenize(w)], w
    assert native._native.wordpiece("a\U0010ffff") == [tok.token_to_id("[UNK]")]
    assert_same(native, python, EDGE_WORDS)
    assert_same(native, python, [" ".join(EDGE_WORDS)])
    assert_same(native, python, ["".join(EDGE_WORDS)])


def test_native_word_limit_counts_characters(tmp_path):
    """100 two-byte characters still match piece by piece, 101 are [UNK]; the longest match wins;
    one position without a match makes the whole word [UNK]."""
    from data_pipeline.tokenization import bert_special_layout, load_tokenizer

    pieces = ["é", "##é", "a", "##a", "ab", "##abc", "##b", "東", "##東京", "##"]
    (tmp_path / "vocab.txt").write_text("\n".join(bert_special_layout() + pieces) + "\n", encoding="utf-8")
    tok, lowercase = load_tokenizer(tmp_path / "vocab.txt", lowercase=False)
    native, python = encoders(tok, lowercase)
    v, unk = tok.get_vocab(), tok.token_to_id("[UNK]")
    wp = native._native.wordpiece
    assert wp("é" * 100) == [v["é"]] + [v["##é"]] * 99 and wp("é" * 101) == [unk]
    assert wp("aabcb") == [v["a"], v["##abc"], v["##b"]] and wp("abx") == [unk] and wp("東東京") == [v["東"], v["##東京"]]
    for w in ["é" * 100, "é" * 101, "aabcb", "abx", "東東京", "a##", "##", "aé" * 50, "x"]:
        assert wp(w) == [t.id for t in tok.model.tokenize(w)], w
    assert_same(native, python, ["é" * 100 + " " + "é" * 101, "aabcb abx", "東東京 a## ##"])


def random_docs(seed: int, n: int):
    alphabet = (list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"()[]#-_$%&*") + list("    ")
                + ["\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u1680", "\u2007", "\u2028",
                   "\u2029", "\u202f", "\u3000", "\u200b", "\x00", "\x01", "\x7f", "\xad", "é", "e\u0301", "ñ",
                   "ß", "İ", "東", "京", "\u3001", "🙂", "👍🏽", "Ω", "ς", "Σ", "ﬁ", "\u0300", "¿", "—", "“",
                   "\U00020001", "\ufffd", "\ufeff", "ǅ", "ﬀ", "Å", "ⅷ", "①", "ｗ"])
    r = random.Random(seed)
    for _ in range(n):
        yield ["".join(r.choice(alphabet) for _ in range(r.randrange(30))) for _ in range(r.randrange(6))]


@pytest.mark.parametrize("lowercase", [True, False])
def test_native_matches_python_on_random_text(small_vocab, lowercase):
    from data_pipeline.tokenization import load_tokenizer

    tok, _ = load_tokenizer(small_vocab, lowercase)
    native, python = encoders(tok, lowercase)
    fresh = WordPieceEncoder(tok, lowercase, native=False)  # no cache history: the cache changes nothing
    for doc in random_docs(1 if lowercase else 2, 400):
        got = assert_same(native, python, doc)
        want = fresh.encode_document(doc)
        fresh._reset_cache()
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_native_whitespace_is_str_split():
    """The whitespace set the native split uses is exactly what str.split() splits on."""
    space = set(wordpiece._whitespace())
    split_on = {cp for cp in range(0x110000) if len(f"a{chr(cp)}b".split()) == 2}
    assert space == split_on and 0x20 in space and 0x85 in space and 0x200B not in space


def test_native_cache_resets_and_keeps_ids(small_vocab):
    from data_pipeline.tokenization import load_tokenizer

    tok, lowercase = load_tokenizer(small_vocab)
    native, python = encoders(tok, lowercase, max_cached_words=5)
    docs = [[f"word{i} and more, {i * 7}"] * 3 for i in range(40)] + list(random_docs(3, 50))
    for doc in docs + docs:
        assert_same(native, python, doc)
        assert native.cached_chunks <= 5 + 200  # reset before each document once over 5 chunks
    assert native.cached_chunks > 5  # grows within a document
    native._native.clear_cache()
    assert native.cached_chunks == 0
    assert_same(native, python, docs[0])


@pytest.mark.shared
def test_native_uint32_vocab(tmp_path, shared_data):
    """A vocab of >= 65536 tokens gives uint32 ids; words that match the added tokens get ids
    above 65535."""
    from data_pipeline.tokenization import load_tokenizer

    base = (shared_data / "vocab" / "bert-base-uncased-vocab.txt").read_text(encoding="utf-8").splitlines()
    extra = [f"zq{i}" for i in range(70000 - len(base))] + ["##qz"]
    (tmp_path / "vocab.txt").write_text("\n".join(base + extra) + "\n", encoding="utf-8")
    tok, lowercase = load_tokenizer(tmp_path / "vocab.txt")
    native, python = encoders(tok, lowercase)
    doc = ["The zq39000 and ZQ39470 plus zq1qz, zq12x.", "", "whale zq0zq1 東京 🙂 " + "y" * 101]
    ids, _ = assert_same(native, python, doc)
    assert ids.dtype == np.uint32 and ids.max() >= 65536
    text = (shared_data / "books" / "melville-moby_dick.txt").read_text(encoding="utf-8")[:200_000]
    assert_same(native, python, text.split("\n"))


@pytest.mark.shared
@pytest.mark.parametrize("case", ["uncased", "cased"])
def test_native_matches_python_on_real_text(shared_data, case):
    """Several books whole (one document each, then again warm) and Wikipedia paragraphs."""
    import bz2

    from data_pipeline.text import text_to_sentences
    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wikitext import article_paragraphs, iter_page_blobs, parse_page

    tok, lowercase = load_tokenizer(shared_data / "vocab" / f"bert-base-{case}-vocab.txt")
    assert lowercase == (case == "uncased")
    native, python = encoders(tok, lowercase)
    books = sorted((shared_data / "books").glob("*.txt"))
    assert len(books) >= 4
    docs = [text_to_sentences(p.read_text(encoding="utf-8", errors="replace")) for p in books[:4]]
    wiki = []
    with bz2.open(shared_data / "wiki" / "enwiki-pages-articles-shortened.xml.bz2", "rb") as f:
        for kind, blob in iter_page_blobs(f, 1 << 26):
            page = parse_page(blob)[0]
            if page and not page.redirect and page.ns == 0 and len(wiki) < 400:
                wiki += [text_to_sentences(p) for p in article_paragraphs(page.title, page.text) or []]
    assert len(wiki) >= 100
    total = 0
    for doc in docs + wiki + docs:
        total += assert_same(native, python, doc)[0].shape[0]
    assert total > 500_000


def test_native_argument_errors(small_vocab):
    from data_pipeline import _native_wordpiece
    from data_pipeline.tokenization import load_tokenizer

    tok, lowercase = load_tokenizer(small_vocab)
    vocab = tok.get_vocab(with_added_tokens=False)
    ok = dict(unk_id=100, max_input_chars_per_word=100, continuing_prefix="##",
              single_ranges=wordpiece._ranges(wordpiece._unicode_classes()[0]),
              whitespace=list(wordpiece._whitespace()), id_bits=16, max_cached_words=10)
    enc = _native_wordpiece.Encoder(vocab, **ok)
    for bad, match in [(dict(id_bits=8), "id_bits"), (dict(unk_id=70000), "unk_id"),
                       (dict(max_input_chars_per_word=-1), "max_input_chars"), (dict(max_cached_words=-1), "max_cached"),
                       (dict(single_ranges=[(5, 2)]), "empty"), (dict(single_ranges=[(0, 0x110000)]), "outside"),
                       (dict(whitespace=[]), "whitespace"), (dict(whitespace=[-1]), "outside")]:
        with pytest.raises(ValueError, match=match):
            _native_wordpiece.Encoder(vocab, **{**ok, **bad})
    with pytest.raises(ValueError, match="does not fit"):
        _native_wordpiece.Encoder({**vocab, "big": 65536}, **ok)
    with pytest.raises(ValueError, match="empty"):
        _native_wordpiece.Encoder({}, **ok)
    with pytest.raises(ValueError, match="exactly one"):
        enc.encode("a b", "\n\n")
    with pytest.raises(ValueError, match="not whitespace"):
        enc.encode("a b", "x")
    with pytest.raises(ValueError, match="native must be"):
        WordPieceEncoder(tok, lowercase, native="yes")
    auto = WordPieceEncoder(tok, lowercase)
    assert auto.native and auto.native_reason == "native encoder"


def test_native_encoder_shared_by_threads(small_vocab):
    """encode releases the GIL; one encoder (one cache) used by several threads gives each the
    ids a single-threaded Python encoder gives."""
    from concurrent.futures import ThreadPoolExecutor

    from data_pipeline.tokenization import load_tokenizer

    tok, lowercase = load_tokenizer(small_vocab)
    native, python = encoders(tok, lowercase, max_cached_words=50)
    docs = list(random_docs(4, 200))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(native.encode_document, docs))
    for doc, (ids, bounds) in zip(docs, got):
        want = python.encode_document(doc)
        assert np.array_equal(ids, want[0]) and np.array_equal(bounds, want[1])
