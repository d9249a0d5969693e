"""Document-at-a-time BERT WordPiece with a word cache: the tokenizer's hot path.

Why: HF ``tokenizers`` tracks character offsets for every normalised character, which makes it
~2 MB/s on one core here, the pipeline's single largest cost. Natural text repeats its words, so
this encoder normalises a whole document at once, splits it on whitespace (one C call), looks each
chunk up in a cache, and only for chunks it has not seen splits off punctuation and runs WordPiece
(the HF model itself, so the pieces are the same); numpy gathers then build the ids.

It reproduces ``BertNormalizer`` + ``BertPreTokenizer`` + ``WordPiece`` as set up by
:func:`data_pipeline.tokenization.load_tokenizer`, and so BERT's reference tokenizer:
  1. clean: drop NUL, U+FFFD and control characters (Cc/Cf except tab, newline, return);
  2. lower-case, then NFD and drop non-spacing marks (Mn) — uncased vocabs only;
  3. split on whitespace; every punctuation character (ASCII symbols or Unicode P*) and every
     CJK ideograph is a word of its own;
  4. greedy longest-match WordPiece, [UNK] for words over 100 characters or with no match.
A document that contains a special-token string ("[MASK]", …) goes through the HF tokenizer,
which matches those before normalisation. Tests compare both paths id for id on real text.

Steps 3-4 with the cache also exist in C++ (``data_pipeline._native_wordpiece``,
csrc/data_pipeline/wordpiece.cpp), used when it is built (``native=None``): ~3x faster warm and
~5x cold on the 14 books. Normalisation and the special-token path stay here, and the Python
path below stays the reference: tests/data_pipeline/test_native_wordpiece.py holds the two to
identical ids. The Unicode classes the C++ side uses (punctuation/CJK, whitespace) come from
this module, so from Python's unicodedata.
"""
from __future__ import annotations

import itertools
import re
import unicodedata
from functools import lru_cache
from itertools import repeat

import numpy as np
from tokenizers import Tokenizer, models

from data_pipeline.native_build import import_native

# the native twin of the post-normalisation path (csrc/data_pipeline/wordpiece.cpp)
_native_wordpiece, _NATIVE_UNAVAILABLE = import_native("data_pipeline._native_wordpiece")

# BERT's _is_chinese_char ranges: each such character becomes a word of its own
_CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# every byte but those of _ASCII_CONTROL: deleting them from the UTF-8 leaves its ASCII controls
# (no multi-byte character holds a byte below 0x80): 4.6 ms on the 14 books against 20.5 ms for
# the regex's search
_NOT_ASCII_CONTROL = bytes(b for b in range(256) if not _ASCII_CONTROL.match(chr(b)) or b >= 0x80)
_SEPARATOR = "\n"  # between sentences before normalising; whitespace, so no sentence can hold one
_MARK = " \x00 "  # between sentences after normalising: a chunk of its own (NUL never survives cleaning)


def _is_punctuation(cp: int) -> bool:
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(chr(cp)).startswith("P")


def _char_class(cps) -> str:
    """A regex character class body for sorted code points (merged into ranges)."""
    return "".join(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}"
                   for lo, hi in _ranges(cps))


# Blocks of letters only (CJK ideographs, Hangul syllables, all of plane 2): 40% of the code points
# _unicode_classes would scan, for none of what it looks for
_SKIPPED = ((0x3400, 0x4DC0), (0x4E00, 0xA000), (0xAC00, 0xD7A4), (0x20000, 0x30000))
_SCANNED = ((128, 0x3400), (0x4DC0, 0x4E00), (0xA000, 0xAC00), (0xD7A4, 0xD800), (0xE000, 0x20000),
            (0xE0000, 0xF0000))


@lru_cache(maxsize=1)
def _unicode_classes() -> tuple[tuple[int, ...], frozenset[str], frozenset[str]]:
    """(sorted "single" code points: punctuation and CJK, each a word of its own; non-ASCII control
    characters to drop; non-spacing marks to drop); built once per process from Python's Unicode
    tables (~0.02 s)."""
    singles = [cp for lo, hi in _CJK_RANGES for cp in range(lo, hi + 1)]
    singles += [cp for cp in range(128) if _is_punctuation(cp)]
    controls, marks = [], []
    category = unicodedata.category
    # planes 3-13 are unassigned and 15-16 private use: no punctuation, controls or marks there;
    # nor in the ideograph and syllable blocks of _SKIPPED (a test checks every code point)
    for cp in itertools.chain(*(range(lo, hi) for lo, hi in _SCANNED)):
        cat = category(chr(cp))
        if cat[0] == "P":
            singles.append(cp)
        elif cat in ("Cc", "Cf") or cp == 0xFFFD:
            controls.append(cp)
        elif cat == "Mn":
            marks.append(cp)
    return tuple(sorted(set(singles))), frozenset(map(chr, controls)), frozenset(map(chr, marks))


@lru_cache(maxsize=1)
def _tables() -> tuple[re.Pattern, frozenset[str], frozenset[str]]:
    """(word split regex, non-ASCII control characters to drop, non-spacing marks to drop)."""
    singles, controls, marks = _unicode_classes()
    single = _char_class(singles)
    split = re.compile(rf"[{single}]|[^\s{single}]+")
    return split, controls, marks


def _ranges(cps) -> list[tuple[int, int]]:
    """Sorted code points merged into inclusive (first, last) ranges."""
    out: list[tuple[int, int]] = []
    for cp in cps:
        if out and out[-1][1] == cp - 1:
            out[-1] = (out[-1][0], cp)
        else:
            out.append((cp, cp))
    return out


@lru_cache(maxsize=1)
def _whitespace() -> tuple[int, ...]:
    """The code points str.split() splits on (Py_UNICODE_ISSPACE, the same test as str.isspace).
    All of them are at or below U+3000 (IDEOGRAPHIC SPACE); a test checks every code point, so a
    future Unicode version that adds one above would be caught."""
    return tuple(cp for cp in range(0x3001) if chr(cp).isspace())


@lru_cache(maxsize=256)
def _deleter(chars: frozenset[str]) -> re.Pattern:
    """A regex matching any of a few characters: scanning for a small class is fast, while a class
    of every Unicode mark or control character costs ~200 ns per character scanned."""
    return re.compile(f"[{_char_class(sorted(map(ord, chars)))}]")


_ASCII_BYTES = bytes(range(128))
_NON_ASCII_RUNS = re.compile(r"[^\x00-\x7f]+")


def _has_ascii_control(text: str) -> bool:
    return bool(text.encode("utf-8", "surrogatepass").translate(None, _NOT_ASCII_CONTROL))


def _nfd_of_match(m: re.Match) -> str:
    return unicodedata.normalize("NFD", m.group())


def _non_ascii_chars(text: str) -> set[str]:
    """The distinct non-ASCII characters of ``text``. UTF-8 continuation and lead bytes are all
    >= 0x80, so deleting the ASCII bytes keeps every other character whole (~2 ms per MB)."""
    return set(text.encode("utf-8", "surrogatepass").translate(None, _ASCII_BYTES).decode("utf-8", "surrogatepass"))


def native_available() -> bool:
    return _native_wordpiece is not None


def native_unavailable_reason() -> str:
    """Why the native encoder cannot be used ("" when it can)."""
    return _NATIVE_UNAVAILABLE


def _native_unsupported_reason(tok: Tokenizer) -> str:
    """Why the native encoder cannot replay ``tok``'s model ("" when it can)."""
    model = tok.model
    if not isinstance(model, models.WordPiece):
        return f"the tokenizer's model is {type(model).__name__}, not WordPiece"
    if model.unk_token not in tok.get_vocab(with_added_tokens=False):
        return f"the unk token {model.unk_token!r} is not in the vocab"
    return ""


class WordPieceEncoder:
    """``encode_document(sentences) -> (ids, bounds)``: all ids of a document concatenated and
    the sentence boundaries (sentence i is ``ids[bounds[i]:bounds[i+1]]``; sentences with no
    tokens are dropped).

    ``native``: None uses the C++ twin of the post-normalisation path when it is built (the
    Python path otherwise), True requires it, False uses the Python path (the reference)."""

    def __init__(self, tok: Tokenizer, lowercase: bool, *, max_cached_words: int = 2_000_000,
                 native: bool | None = None):
        self.tok, self.lowercase, self.max_cached_words = tok, lowercase, max_cached_words
        vocab_size = tok.get_vocab_size()
        self.dtype = np.uint16 if vocab_size < 65536 else np.uint32
        self.specials = [t.content for t in tok.get_added_tokens_decoder().values()]
        self._specials = tuple(s for s in self.specials if s)
        _, self._controls, self._marks = _unicode_classes()
        if native not in (None, True, False):
            raise ValueError(f"native must be None, True or False, got {native!r}")
        why_not = native_unavailable_reason() or (_native_unsupported_reason(tok) if native is not False else "")
        if native and why_not:
            raise ValueError(f"native=True, but {why_not} (use native=None or False)")
        self.native = native is not False and not why_not
        self.native_reason = "native encoder" if self.native else (why_not or "native=False")
        if self.native:
            self._native = self._make_native()
        else:
            self._reset_cache()

    @property
    def _split(self) -> re.Pattern:
        """The word split regex: only the Python path and :meth:`words` use it, and compiling its
        class of every punctuation and CJK character takes ~10 ms, so the native path skips it."""
        return _tables()[0]

    @property
    def cached_chunks(self) -> int:
        """Whitespace chunks in the cache (native or Python): bounded by ``max_cached_words``
        between documents."""
        return len(self._native) if self.native else len(self._index)

    def _make_native(self):
        model = self.tok.model
        vocab = self.tok.get_vocab(with_added_tokens=False)  # exactly the vocab the HF model matches against
        return _native_wordpiece.Encoder(
            vocab, unk_id=vocab[model.unk_token], max_input_chars_per_word=model.max_input_chars_per_word,
            continuing_prefix=model.continuing_subword_prefix, single_ranges=_ranges(_unicode_classes()[0]),
            whitespace=list(_whitespace()), id_bits=8 * np.dtype(self.dtype).itemsize,
            max_cached_words=self.max_cached_words)

    def _reset_cache(self) -> None:
        # whitespace chunk -> index; index 0 is the sentence mark (no pieces)
        self._index: dict[str, int] = {_MARK.strip(): 0}
        self._word_pieces: dict[str, list[int]] = {}  # BERT word -> piece ids
        self._start = np.zeros(1024, np.int64)  # first piece of chunk i in _pieces
        self._len = np.zeros(1024, np.int64)
        self._pieces = np.zeros(8192, self.dtype)
        self._num_pieces = 0

    def normalize(self, text: str) -> str:
        if _has_ascii_control(text):
            text = _ASCII_CONTROL.sub("", text)
        if text.isascii():
            return text.lower() if self.lowercase else text
        # only the characters this document holds are scanned for (see _deleter)
        present = _non_ascii_chars(text)
        controls = self._controls & present
        if controls:
            text = _deleter(frozenset(controls)).sub("", text)
        if self.lowercase:
            # NFD of the non-ASCII runs only: an ASCII character is its own decomposition and a
            # starter, which canonical reordering never crosses, so this is NFD of the whole text
            # (a book with a few accented letters: 4 ms instead of 15)
            text = _NON_ASCII_RUNS.sub(_nfd_of_match, text.lower())
            # lower() and NFD map each character on its own (final sigma aside, which is no mark),
            # so the marks the result can hold come from the decompositions of ``present``
            marks = {m for c in present - controls for m in unicodedata.normalize("NFD", c.lower())} & self._marks
            if marks:
                text = _deleter(frozenset(marks)).sub("", text)
        return text

    def words(self, chunk: str) -> list[str]:
        """BERT's pre-tokens of normalised text: punctuation and CJK characters split off."""
        return self._split.findall(chunk)

    def encode_document(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        text = _SEPARATOR.join(sentences)
        if text.count(_SEPARATOR) != len(sentences) - 1:  # a separator inside a sentence is whitespace
            text = _SEPARATOR.join(s.replace(_SEPARATOR, " ") for s in sentences)
        if self._holds_special(text):
            return self._encode_with_hf(sentences)
        if self.native:
            return self._native.encode(self.normalize(text), _SEPARATOR)
        return self._encode_normalized(self.normalize(text))

    def _holds_special(self, text: str) -> bool:
        """Does a special-token string ("[MASK]", ...) occur in ``text``? One scan for their
        first characters, then a comparison at each: 0.4 ms for the 10 MB of the 14 books,
        against 23 ms for one substring search per special token."""
        firsts = {s[0] for s in self.specials if s}
        for c in firsts:
            i = text.find(c)
            while i >= 0:
                if text.startswith(self._specials, i):
                    return True
                i = text.find(c, i + 1)
        return False

    def _encode_normalized(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """The Python reference of what the native encoder does: split, cache, WordPiece."""
        chunks = text.replace(_SEPARATOR, _MARK).split()
        if len(self._index) > self.max_cached_words:  # bounded memory on corpora with endless unique words
            self._reset_cache()
        index = self._index
        widx = np.fromiter(map(index.get, chunks, repeat(-1)), np.int64, len(chunks))
        missing = np.flatnonzero(widx < 0)
        if missing.size:  # first sight of these chunks: index them, then look them up again
            new = list(dict.fromkeys([chunks[i] for i in missing]))
            self._add_chunks(new, len(index))
            index.update(zip(new, range(len(index), len(index) + len(new))))
            widx[missing] = np.fromiter(map(index.__getitem__, [chunks[i] for i in missing]), np.int64, missing.size)
        lens = self._len[widx]
        ends = np.cumsum(lens)
        total = int(ends[-1]) if ends.size else 0
        starts = ends - lens
        ids = self._pieces[np.repeat(self._start[widx] - starts, lens) + np.arange(total)]
        cuts = ends[widx == 0]  # token count before each separator
        bounds = np.concatenate(([0], cuts, [total]))
        keep = np.concatenate(([True], np.diff(bounds) > 0))  # drop sentences without tokens
        return ids, bounds[keep]

    def _pieces_of_word(self, word: str) -> list[int]:
        ids = self._word_pieces.get(word)
        if ids is None:
            ids = self._word_pieces[word] = [t.id for t in self.tok.model.tokenize(word)]
        return ids

    def _add_chunks(self, new_chunks: list[str], first: int) -> None:
        encs = [[i for w in self._split.findall(c) for i in self._pieces_of_word(w)] for c in new_chunks]
        lens = np.fromiter((len(e) for e in encs), np.int64, len(encs))
        n_new = int(lens.sum())
        end = first + len(new_chunks)
        if end > self._start.shape[0]:
            cap = max(end, 2 * self._start.shape[0])
            self._start = np.resize(self._start, cap)
            self._len = np.resize(self._len, cap)
        if self._num_pieces + n_new > self._pieces.shape[0]:
            self._pieces = np.resize(self._pieces, max(self._num_pieces + n_new, 2 * self._pieces.shape[0]))
        self._len[first:end] = lens
        self._start[first:end] = self._num_pieces + np.cumsum(lens) - lens
        flat = np.fromiter((i for e in encs for i in e), self.dtype, n_new)
        self._pieces[self._num_pieces:self._num_pieces + n_new] = flat
        self._num_pieces += n_new

    def _encode_with_hf(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encs = self.tok.encode_batch_fast(sentences, add_special_tokens=False)
        arrays = [a for a in (np.asarray(e.ids, dtype=self.dtype) for e in encs) if a.shape[0]]
        lens = np.fromiter((a.shape[0] for a in arrays), np.int64, len(arrays))
        bounds = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum(lens, out=bounds[1:])
        ids = np.concatenate(arrays) if arrays else np.zeros(0, self.dtype)
        return ids, bounds
