"""A Hugging Face ``tokenizer.json`` as the records' vocabulary: its size, its special token ids and
its word-continuation table, read from the file (and a ``tokenizer_config.json`` beside it, as a
Hugging Face checkpoint folder has one), never guessed from a model name.

The data pipeline tokenizes with it (``data_pipeline.tokenization``), the manifest records what
this module reads, and the trainer's loader masks with it. A ``vocab.txt`` (BERT WordPiece, id =
line number) stays the business of :mod:`bertdist.data.vocab`.

Special tokens, each the first that names one that the tokenizer knows:
  1. ``tokenizer_config.json`` beside the file: ``cls_token``, ``sep_token``, ``pad_token``,
     ``mask_token``, ``unk_token`` (ModernBERT's and BERT's checkpoints have one);
  2. the post-processor: BertProcessing / RobertaProcessing's ``cls`` and ``sep``, or a
     TemplateProcessing's special tokens before and after ``$A``; the model's ``unk_token``; the
     padding's ``pad_token``;
  3. the conventional names among the tokenizer's added special tokens ([CLS] or <s>, ...).
A tokenizer without one of the five is refused, naming what it does have.

Word boundaries (whole-word and span masking): a token continues a word when the model marks it
so in its vocabulary, as WordPiece does with ``##`` (a BPE with a ``continuing_subword_prefix``
too). A byte-level BPE such as ModernBERT's (OLMo's, GPT-2's) marks word *starts* instead: a token
that begins with the space its pre-tokenizer encodes as ``Ġ`` starts a word, every other token
continues one (SentencePiece's Metaspace marks them with ``▁`` alike). Words are then what
whitespace separates, as fairseq's whole-word masking for GPT-2's BPE has them: punctuation and
digits the pre-tokenizer splits off a word without a space ("end" "." in "end.") mask with it,
and where a run of spaces leaves one space token alone, that token is a word of its own.
The first word of a text has no space before it; it follows [CLS] or [SEP], and a token after a
special one always starts a word (bertdist.data.masking, bertdist.train.masking). A tokenizer with
neither kind of mark gets no table, and whole-word and span masking with it are refused
(:func:`require_continuation`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from bertdist.config import ConfigError

SPECIAL_ROLES = ("pad", "unk", "cls", "sep", "mask")
_CONVENTIONAL = {"cls": ("[CLS]", "<s>", "<cls>"), "sep": ("[SEP]", "</s>", "<sep>"), "pad": ("[PAD]", "<pad>"),
                 "mask": ("[MASK]", "<mask>"), "unk": ("[UNK]", "<unk>")}
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


def is_tokenizer_json(path: str | os.PathLike) -> bool:
    """Whether a vocab path names a Hugging Face tokenizer file (a ``.json``) rather than a WordPiece
    ``vocab.txt``."""
    return os.fspath(path).endswith(".json")


@dataclass(frozen=True)
class TokenizerFile:
    """What the records and the loader need of a ``tokenizer.json``."""

    path: str
    model_type: str  # BPE, WordPiece, Unigram, WordLevel
    size: int  # highest id + 1, added tokens included (the model's embedding may be padded beyond it)
    special: dict[str, int]  # pad / unk / cls / sep / mask -> id
    special_ids: tuple[int, ...]  # every id the tokenizer flags special, the five included (sorted)
    continuation: np.ndarray | None = field(repr=False, compare=False)  # bool [size]; None: no word marks
    continuation_why: str = ""  # why there is no table (None above)
    word_marks: str = ""  # what the table was read from: "'##' continuation pieces", "'Ġ' word starts"

    def manifest_entry(self) -> dict:
        """The manifest's extra ``vocab`` keys for a tokenizer.json."""
        return {"kind": "tokenizer.json", "model": self.model_type, "special_ids": list(self.special_ids),
                "word_boundaries": self.continuation is not None}


def _token_content(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):  # {"content": "[CLS]", "__type": "AddedToken", ...}
        return value.get("content")
    return None


def _from_post_processor(pp: dict | None) -> dict[str, str]:
    """cls / sep token strings named by a post-processor (recursing into a Sequence)."""
    if not isinstance(pp, dict):
        return {}
    kind = pp.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return {role: pp[role][0] for role in ("cls", "sep") if isinstance(pp.get(role), list)}
    if kind == "TemplateProcessing":
        found: dict[str, str] = {}
        seen_sequence = False
        for piece in pp.get("single", []):
            if "Sequence" in piece:
                seen_sequence = True
            elif "SpecialToken" in piece:
                role = "sep" if seen_sequence else "cls"
                found.setdefault(role, piece["SpecialToken"]["id"])
        return found
    if kind == "Sequence":
        found = {}
        for sub in pp.get("processors", []):
            for k, v in _from_post_processor(sub).items():
                found.setdefault(k, v)
        return found
    return {}


def _read_text(path: str) -> str:
    from bertdist.data.vocab import _read_bytes

    return _read_bytes(path).decode("utf-8")


def _sibling_config(path: str) -> dict:
    """``tokenizer_config.json`` beside a local tokenizer.json, or {}."""
    if "://" in path:
        return {}
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), TOKENIZER_CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        return {}
    try:
        data = json.loads(open(cfg_path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_path}: unreadable ({e}); fix or remove it (the special tokens come from it)") from None
    return data if isinstance(data, dict) else {}


BYTE_LEVEL_SPACE = "\u0120"  # "Ġ": the space byte as a byte-level BPE writes it


def _pre_tokenizers(pre: dict | None) -> list[dict]:
    """A pre-tokenizer and, for a Sequence, the ones inside it."""
    if not isinstance(pre, dict):
        return []
    return [pre] + [p for sub in pre.get("pretokenizers", []) for p in _pre_tokenizers(sub)]


def word_start_marker(spec: dict) -> str | None:
    """The mark a tokenizer puts at the start of a word's first token: ``Ġ`` for a byte-level
    pre-tokenizer, a Metaspace's replacement character (``▁``); None when it marks none."""
    for pre in _pre_tokenizers(spec.get("pre_tokenizer")):
        if pre.get("type") == "ByteLevel":
            return BYTE_LEVEL_SPACE
        if pre.get("type") == "Metaspace":
            return pre.get("replacement") or "\u2581"
    return None


def _continuation(spec: dict, vocab: dict[str, int], size: int, special_ids) -> tuple[np.ndarray | None, str, str]:
    """(the table, why there is none, what marks it was read from)."""
    model = spec.get("model") or {}
    kind = model.get("type", "?")
    prefix = model.get("continuing_subword_prefix")
    if kind == "WordPiece" and prefix is None:
        prefix = "##"
    table = np.zeros(size, bool)
    if prefix:
        marks = f"{prefix!r} continuation pieces"
        for tok, i in vocab.items():
            table[i] = tok.startswith(prefix) and len(tok) > len(prefix)
    else:
        start = word_start_marker(spec)
        if start is None:
            pre = (spec.get("pre_tokenizer") or {}).get("type", "none")
            return None, (f"its model ({kind}, pre-tokenizer {pre}) marks neither word-continuation pieces "
                          "(no continuing_subword_prefix) nor word starts (no ByteLevel or Metaspace "
                          "pre-tokenizer), so word boundaries cannot be read from token ids"), ""
        marks = f"{start!r} word starts"
        for tok, i in vocab.items():
            table[i] = not tok.startswith(start)
    table[list(special_ids)] = False
    return table, "", marks


def _parse(path: str, text: str) -> TokenizerFile:
    from tokenizers import Tokenizer

    try:
        spec = json.loads(text)
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - json's and the Rust parser's errors alike
        raise ConfigError(f"{path}: not a Hugging Face tokenizer.json ({type(e).__name__}: {e})") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise ConfigError(f"{path}: the tokenizer has an empty vocabulary")
    size = max(vocab.values()) + 1
    flagged = {int(i): t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    names: dict[str, str] = {}
    config = _sibling_config(path)
    for role in SPECIAL_ROLES:
        name = _token_content(config.get(f"{role}_token"))
        if name in vocab:
            names[role] = name
    for role, name in _from_post_processor(spec.get("post_processor")).items():
        if name in vocab:
            names.setdefault(role, name)
    unk = (spec.get("model") or {}).get("unk_token")
    if unk in vocab:
        names.setdefault("unk", unk)
    pad = (spec.get("padding") or {}).get("pad_token")
    if pad in vocab:
        names.setdefault("pad", pad)
    for role, candidates in _CONVENTIONAL.items():
        for name in candidates:
            if role not in names and name in vocab and vocab[name] in flagged:
                names[role] = name
    missing = [r for r in SPECIAL_ROLES if r not in names]
    if missing:
        raise ConfigError(
            f"{path}: no {', '.join(missing)} token found (found {names or 'none'}; special tokens of the "
            f"tokenizer: {sorted(flagged.values())[:20]}). Put a {TOKENIZER_CONFIG_NAME} beside it naming "
            f"{', '.join(f'{r}_token' for r in missing)}, as a Hugging Face checkpoint has")
    special = {role: int(vocab[names[role]]) for role in SPECIAL_ROLES}
    special_ids = tuple(sorted(set(flagged) | set(special.values())))
    table, why, marks = _continuation(spec, vocab, size, special_ids)
    return TokenizerFile(path, (spec.get("model") or {}).get("type", "?"), size, special, special_ids, table, why,
                         marks)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float) -> TokenizerFile:
    return _parse(path, _read_text(path))


def load_tokenizer_file(path: str | os.PathLike) -> TokenizerFile:
    """Read ``path`` (a local path or a URL on any Beam filesystem); ConfigError when it is not a
    usable tokenizer.json."""
    p = os.fspath(path)
    if "://" not in p and not os.path.isfile(p):
        raise ConfigError(f"{p}: no such tokenizer file")
    return _load_cached(p, os.path.getmtime(p) if "://" not in p else 0.0)


def require_continuation(tf: TokenizerFile, masking_mode: str, where: str = "masking_mode") -> np.ndarray | None:
    """The continuation table for ``masking_mode``: None for token masking; ConfigError for
    whole-word or span masking with a tokenizer that has no word marks."""
    if masking_mode == "token":
        return None
    if tf.continuation is None:
        raise ConfigError(f"{where} {masking_mode!r} needs word boundaries, and the tokenizer {tf.path} has none: "
                          f"{tf.continuation_why}. Use masking_mode: token with it (ModernBERT trains with token "
                          "masking), or a tokenizer whose vocabulary marks continuation pieces (WordPiece '##') or word "
                          "starts (a byte-level BPE's 'Ġ', SentencePiece's '▁')")
    return tf.continuation


def replacement_ids(size: int, special_ids) -> np.ndarray:
    """The ids a random replacement draws from: the vocabulary without its special tokens."""
    keep = np.ones(size, bool)
    keep[np.asarray(list(special_ids), np.int64)] = False
    return np.flatnonzero(keep)
