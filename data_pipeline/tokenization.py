"""WordPiece tokenization with HF ``tokenizers`` (Rust), id-exact with BERT's reference tokenizer;
any Hugging Face ``tokenizer.json`` through :class:`TokenizerJsonEncoder` (:func:`load_encoder` picks).

:func:`load_tokenizer` builds the same pipeline as BERT's ``BasicTokenizer`` + ``WordpieceTokenizer``
(clean text, CJK spacing, optional lower-casing + accent stripping, punctuation split, greedy
longest-match WordPiece with 100-char word limit), with BERT's special tokens recognised in text
as the reference does. :func:`train_vocab` trains a new vocab with BERT's id layout.
"""
from __future__ import annotations

import os
import re
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bertdist.data.vocab import SPECIAL_TOKENS, load_vocab

_HAS_UPPER = re.compile(r"[A-Z]")


def vocab_is_cased(tokens: list[str]) -> bool:
    """A vocab with upper-case word pieces (other than [PAD]-style specials) is cased."""
    return any(_HAS_UPPER.search(t) for t in tokens if not (t.startswith("[") and t.endswith("]")))


def load_tokenizer(vocab_path: str | os.PathLike, lowercase: bool | None = None) -> tuple[Tokenizer, bool]:
    """Fast tokenizer for ``vocab_path``; ``lowercase=None`` infers it from the vocab. Returns (tok, lowercase)."""
    tokens = load_vocab(vocab_path)
    if lowercase is None:
        lowercase = not vocab_is_cased(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
    return tok, lowercase


def bert_special_layout(num_unused: int = 99) -> list[str]:
    """BERT's first ids: [PAD]=0, [unused0..98]=1..99, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103,
    then [unused99..] when ``num_unused`` > 99 (the original vocab has 994)."""
    layout = ["[PAD]"] + [f"[unused{i}]" for i in range(min(99, num_unused))]
    while len(layout) < 100:  # keep [UNK] at 100 even with fewer unused tokens
        layout.append(f"[unused{len(layout) - 1}]")
    layout += ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    layout += [f"[unused{i}]" for i in range(99, num_unused)]
    return layout


def train_vocab(
    sentences: Iterable[str],
    out_path: str | os.PathLike,
    *,
    vocab_size: int = 30522,
    lowercase: bool = True,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
    num_unused: int = 99,
) -> list[str]:
    """Train a WordPiece vocab and write ``vocab.txt`` (id = line number) with BERT's special ids."""
    specials = bert_special_layout(num_unused)
    if vocab_size <= len(specials) + 10:
        raise ValueError(f"vocab_size {vocab_size} leaves no room after {len(specials)} special tokens")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
        limit_alphabet=limit_alphabet, continuing_subword_prefix="##", show_progress=False,
    )
    tok.train_from_iterator(sentences, trainer=trainer)
    vocab = tok.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    if [i for _, i in by_id] != list(range(len(tokens))) or tokens[: len(specials)] != specials:
        raise RuntimeError("trained vocab does not have BERT's special-token layout")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens) + "\n")
    os.replace(tmp, out_path)
    return tokens


class TokenizerJsonEncoder:
    """Documents through any Hugging Face ``tokenizer.json`` (BPE, WordPiece, Unigram ...): the
    same ``encode_document`` as :class:`data_pipeline.wordpiece.WordPieceEncoder`.

    Each sentence after the first is encoded with the space that separated it from the one before
    (the splitter took it off): a byte-level BPE such as ModernBERT's encodes a word differently at
    the start of a text ("How") than after a space ("ĠHow"), and inside a document it comes after
    one. A tokenizer whose normalizer or pre-tokenizer drops leading spaces is unaffected. Special
    tokens written in the text ("[SEP]") are recognised as the tokenizer's added tokens are."""

    native_reason = "Hugging Face tokenizer.json (the tokenizers library)"

    def __init__(self, path: str):
        from bertdist.data.vocab import _read_bytes

        self.tok = Tokenizer.from_str(_read_bytes(path).decode("utf-8"))
        self.tok.no_truncation()
        self.tok.no_padding()
        size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1  # as TokenizerFile.size
        self.dtype = np.uint16 if size < 65536 else np.uint32

    def encode_document(self, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        texts = [s if i == 0 else " " + s for i, s in enumerate(sentences)]
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        arrays = [a for a in (np.asarray(e.ids, dtype=self.dtype) for e in encs) if a.shape[0]]
        bounds = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.shape[0] for a in arrays], out=bounds[1:])
        return (np.concatenate(arrays) if arrays else np.zeros(0, self.dtype)), bounds


def load_encoder(vocab_path: str, lowercase: bool | None):
    """The document encoder for a build's vocab: WordPiece for a ``vocab.txt``, the tokenizer
    itself for a ``tokenizer.json`` (its own normalizer decides the case)."""
    from bertdist.data.tokenizer_file import is_tokenizer_json

    if is_tokenizer_json(vocab_path):
        return TokenizerJsonEncoder(vocab_path)
    from data_pipeline.wordpiece import WordPieceEncoder

    tok, lowercase = load_tokenizer(vocab_path, lowercase)
    return WordPieceEncoder(tok, lowercase)
