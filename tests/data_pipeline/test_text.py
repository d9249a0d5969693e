"""data_pipeline.text: cleaning equals its one-regex definition, whichever path it takes."""
from __future__ import annotations

import random
import unicodedata

from data_pipeline import text as textlib


def _by_definition(text: str) -> str:
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    return textlib._RUNS.sub(" ", text)


def test_normalize_equals_the_regex_definition_on_random_text():
    rng = random.Random(0)
    # plain text, runs of spaces, and every kind of character the regex rewrites
    alphabet = ["a", "b", "é", "e\u0301", ".", "\n", " ", " ", " ", "\t", "\x00", "\x07", "\x7f", "\x0b",
                "\u00a0", "\u2003", "\u200b", "\u3000", "\ufffe", "\r"]
    plain = ["a", "b", "é", ".", "\n", " ", " ", " "]  # only plain spaces: the fast path
    ascii_plain = ["a", "b", ".", "\n", "\r", " ", " ", "~"]  # and its byte check
    for chars in (alphabet, plain, ascii_plain):
        for _ in range(3000):
            text = "".join(rng.choice(chars) for _ in range(rng.randint(0, 40)))
            assert textlib._normalize(text) == _by_definition(text), repr(text)
            assert textlib._normalize(text, text.encode("utf-8", "surrogatepass")) == _by_definition(text), repr(text)


def test_normalize_collapses_long_runs_and_keeps_single_spaces():
    assert textlib._normalize("a" + " " * 37 + "b c") == "a b c"
    assert textlib._normalize("a \t b\u00a0\u00a0c") == "a b c"
    assert textlib.clean_lines("  x  y \n\x00z\t") == ["x y", "z"]
