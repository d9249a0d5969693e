"""WordPiece vocab files (``vocab.txt``: one token per line, id = line number)."""
from __future__ import annotations

import hashlib
import os
from functools import lru_cache

import numpy as np

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def load_vocab(path: str | os.PathLike) -> list[str]:
    with open(path, encoding="utf-8") as f:
        tokens = [line.rstrip("\n") for line in f]
    while tokens and tokens[-1] == "":
        tokens.pop()
    return tokens


def vocab_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def special_token_ids(tokens: list[str]) -> dict[str, int]:
    """{'pad','unk','cls','sep','mask'} -> id; a vocab missing one of them is an error."""
    index = {t: i for i, t in enumerate(tokens)}
    out = {}
    for tok in SPECIAL_TOKENS:
        if tok not in index:
            raise ValueError(f"vocab lacks the special token {tok}")
        out[tok.strip("[]").lower()] = index[tok]
    return out


@lru_cache(maxsize=8)
def _continuation_mask_cached(path: str, mtime: float) -> np.ndarray:
    tokens = load_vocab(path)
    return np.fromiter((t.startswith("##") for t in tokens), dtype=bool, count=len(tokens))


def continuation_mask(path: str | os.PathLike) -> np.ndarray:
    """Bool array over the vocab: True where the token is a '##' continuation piece.

    Whole-word masking derives word starts from this (a position starts a word unless its
    token is a continuation)."""
    p = os.fspath(path)
    return _continuation_mask_cached(p, os.path.getmtime(p))
