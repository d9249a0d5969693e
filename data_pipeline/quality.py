"""Document quality rules (pure functions), after Gopher (Rae et al. 2021, appendix A) and C4
(Raffel et al. 2020): a document is dropped by the first rule it fails, and the rule's name is
what the build counts (``filtered_<rule>``) and samples into the manifest.

The thresholds live in :class:`data_pipeline.config.QualityConfig`; the defaults keep every
Wikipedia article and book in ``../shared/data`` (a test checks it) with a margin, and drop
random bytes that happened to decode, navigation-only pages and text repeated over and over.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from data_pipeline.config import QualityConfig

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_C1_CONTROLS = re.compile(r"[\x80-\x9f]")
# bytes.translate tables, ~50x faster than a regex over the text: what each count deletes
_SPACE = b" \t\n\r\x0b\x0c"
_NOT_ASCII_LETTER = bytes(b for b in range(256) if not (b < 128 and chr(b).isalpha()))
_NOT_ASCII_CONTROL = bytes(b for b in range(256) if b not in (*range(0, 9), 11, 12, *range(14, 32), 127))
_SPACE_FLAGS = bytes(1 if b in _SPACE else 0 for b in range(256))
# Gopher's symbols ("#", ellipsis) and the separators of navigation bars and link lists.
SYMBOLS = ("#", "...", "\u2026", "|", "\u2022")


@dataclass(frozen=True)
class QualityStats:
    words: int
    chars: int  # non-whitespace characters
    letter_fraction: float  # letters / non-whitespace characters
    replacement_fraction: float  # U+FFFD / characters
    control_fraction: float  # control characters / characters
    mean_word_length: float
    symbol_word_ratio: float
    duplicate_line_fraction: float  # lines that repeat an earlier line / non-blank lines
    duplicate_line_char_fraction: float  # their characters / characters in non-blank lines
    duplicate_paragraph_fraction: float
    duplicate_paragraph_char_fraction: float


def _duplicates(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier one, fraction of characters in them)."""
    if len(items) < 2 or len(set(items)) == len(items):  # the usual case, at a set's cost
        return 0.0, 0.0
    seen: Counter[str] = Counter(items)
    dup_items = sum(n - 1 for n in seen.values() if n > 1)
    dup_chars = sum((n - 1) * len(s) for s, n in seen.items() if n > 1)
    total_chars = sum(map(len, items)) or 1
    return dup_items / len(items), dup_chars / total_chars


def document_stats(text: str) -> QualityStats:
    raw = text.encode("utf-8")
    space = np.frombuffer(raw.translate(_SPACE_FLAGS), np.int8)
    words = int(np.count_nonzero(np.diff(space, prepend=np.int8(1)) == -1))  # space -> non-space steps
    spaces = int(np.count_nonzero(space))
    letters = len(raw.translate(None, _NOT_ASCII_LETTER))
    controls = len(raw.translate(None, _NOT_ASCII_CONTROL))
    if not text.isascii():
        other = "".join(_NON_ASCII.findall(text))
        letters += sum(map(str.isalpha, other))
        controls += len(_C1_CONTROLS.findall(other))
    n_chars = len(text)
    chars = n_chars - spaces
    lines = list(filter(None, map(str.strip, text.split("\n"))))
    paras = list(filter(None, map(str.strip, _PARAGRAPH_BREAK.split(text))))
    dl, dlc = _duplicates(lines)
    dp, dpc = _duplicates(paras)
    symbols = sum(text.count(s) for s in SYMBOLS)
    return QualityStats(
        words=words, chars=chars, letter_fraction=letters / chars if chars else 0.0,
        replacement_fraction=text.count("\ufffd") / n_chars if n_chars else 0.0,
        control_fraction=controls / n_chars if n_chars else 0.0,
        mean_word_length=chars / words if words else 0.0, symbol_word_ratio=symbols / words if words else 0.0,
        duplicate_line_fraction=dl, duplicate_line_char_fraction=dlc,
        duplicate_paragraph_fraction=dp, duplicate_paragraph_char_fraction=dpc)


def failed_rule(s: QualityStats, cfg: QualityConfig) -> str | None:
    """The first rule ``s`` fails, as ``(name)``, or None when the document passes them all."""
    if s.words < cfg.min_words:
        return "too_few_words"
    if s.replacement_fraction > cfg.max_replacement_fraction:
        return "replacement_characters"
    if s.control_fraction > cfg.max_control_fraction:
        return "control_characters"
    if s.letter_fraction < cfg.min_letter_fraction:
        return "few_letters"
    if not cfg.min_mean_word_length <= s.mean_word_length <= cfg.max_mean_word_length:
        return "mean_word_length"
    if s.symbol_word_ratio > cfg.max_symbol_word_ratio:
        return "symbols"
    if (s.duplicate_line_fraction > cfg.max_duplicate_line_fraction
            or s.duplicate_line_char_fraction > cfg.max_duplicate_line_char_fraction):
        return "repeated_lines"
    if (s.duplicate_paragraph_fraction > cfg.max_duplicate_paragraph_fraction
            or s.duplicate_paragraph_char_fraction > cfg.max_duplicate_paragraph_char_fraction):
        return "repeated_paragraphs"
    return None


RULES = ("too_few_words", "replacement_characters", "control_characters", "few_letters", "mean_word_length",
         "symbols", "repeated_lines", "repeated_paragraphs")


def check(text: str, cfg: QualityConfig) -> tuple[str | None, QualityStats]:
    s = document_stats(text)
    return failed_rule(s, cfg), s
