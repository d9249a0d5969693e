"""WordPiece vocab files (``vocab.txt``: one token per line, id = line number)."""
from __future__ import annotations

import hashlib
import io
import os
from functools import lru_cache

import numpy as np

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _read_bytes(path: str | os.PathLike) -> bytes:
    """A local path, or a URL on any Beam filesystem (gs://, s3://, ...): a Beam worker reads the
    vocab that the build staged beside its output."""
    p = os.fspath(path)
    if "://" not in p:
        with open(p, "rb") as f:
            return f.read()
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(p) as f:
        return f.read()


def load_vocab(path: str | os.PathLike) -> list[str]:
    # text mode's universal newlines, as a local open() reads it
    tokens = [line.rstrip("\n") for line in io.TextIOWrapper(io.BytesIO(_read_bytes(path)), encoding="utf-8")]
    while tokens and tokens[-1] == "":
        tokens.pop()
    return tokens


def vocab_file_size(path: str | os.PathLike) -> int:
    """The number of ids of a vocab file: a vocab.txt's lines, a tokenizer.json's highest id + 1."""
    if os.fspath(path).endswith(".json"):
        from bertdist.data.tokenizer_file import load_tokenizer_file

        return load_tokenizer_file(path).size
    return len(load_vocab(path))


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


def continuation_mask(path: str | os.PathLike) -> np.ndarray | None:
    """Bool array over the vocab: True where the token is a '##' continuation piece.

    Whole-word masking derives word starts from this (a position starts a word unless its
    token is a continuation). For a Hugging Face tokenizer.json, its table
    (``bertdist.data.tokenizer_file``), or None when the tokenizer marks no continuation pieces."""
    p = os.fspath(path)
    if p.endswith(".json"):
        from bertdist.data.tokenizer_file import load_tokenizer_file

        return load_tokenizer_file(p).continuation
    # a URL names one run's staged copy, never rewritten: its path alone keys the cache
    return _continuation_mask_cached(p, os.path.getmtime(p) if "://" not in p else 0.0)
