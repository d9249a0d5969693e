"""The vocabulary a build tokenizes with, whichever its file: a WordPiece ``vocab.txt`` or a
Hugging Face ``tokenizer.json``. What the instances, the shards and the manifest need of it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from bertdist.data.tokenizer_file import TokenizerFile, is_tokenizer_json, load_tokenizer_file
from bertdist.data.vocab import load_vocab, special_token_ids, vocab_sha256


@dataclass(frozen=True)
class BuildVocab:
    path: str
    size: int
    special: dict[str, int]  # pad / unk / cls / sep / mask -> id
    lowercase: bool | None  # WordPiece: the build's choice; tokenizer.json: None (its normalizer decides)
    tokenizer: TokenizerFile | None = None  # None for a vocab.txt

    @classmethod
    def from_tokens(cls, tokens: list[str], path: str = "", lowercase: bool | None = None) -> "BuildVocab":
        return cls(path, len(tokens), special_token_ids(tokens), lowercase)

    @classmethod
    def load(cls, path: str, lowercase: bool | None) -> "BuildVocab":
        """``lowercase`` None: inferred from a vocab.txt (see ``vocab_is_cased``)."""
        if is_tokenizer_json(path):
            tf = load_tokenizer_file(path)
            return cls(path, tf.size, dict(tf.special), None, tf)
        from data_pipeline.tokenization import vocab_is_cased

        tokens = load_vocab(path)
        return cls.from_tokens(tokens, path, lowercase if lowercase is not None else not vocab_is_cased(tokens))

    @property
    def kind(self) -> str:
        return "wordpiece" if self.tokenizer is None else "tokenizer.json"

    def manifest_vocab(self) -> dict[str, Any]:
        """The manifest's ``vocab`` section (a vocab.txt's as before tokenizer.json builds existed)."""
        entry = {"path": os.path.abspath(self.path), "sha256": vocab_sha256(self.path), "size": self.size,
                 "lowercase": self.lowercase}
        return entry if self.tokenizer is None else {**entry, **self.tokenizer.manifest_entry()}
