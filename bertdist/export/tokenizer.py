"""The WordPiece vocab and its tokenizer: loading, casing, fingerprint, HF tokenizer files.

The tokenizer is always ``transformers.BertTokenizerFast`` built from a local
``vocab.txt`` (never downloaded). Casing matters as much as the vocab: an
uncased vocab with a cased tokenizer maps most capitalised words to [UNK].
"""
from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def read_vocab(vocab_file: str | Path) -> list[str]:
    p = Path(vocab_file)
    if not p.is_file():
        raise FileNotFoundError(f"vocab file not found: {p}")
    with p.open(encoding="utf-8") as f:
        tokens = [line.rstrip("\n") for line in f]
    while tokens and tokens[-1] == "":
        tokens.pop()
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ValueError(f"{p}: not a BERT WordPiece vocab, missing special tokens {missing}")
    return tokens


def vocab_sha256(vocab_file: str | Path) -> str:
    """Fingerprint of the token list (independent of a trailing newline)."""
    return hashlib.sha256("\n".join(read_vocab(vocab_file)).encode("utf-8")).hexdigest()


def infer_do_lower_case(vocab_file: str | Path) -> bool:
    """An uncased vocab has (almost) no tokens with capitals apart from the [SPECIAL] ones.

    bert-base-uncased has 0 such tokens, bert-base-cased thousands; 1% is a safe line.
    """
    tokens = read_vocab(vocab_file)
    capitals = sum(1 for t in tokens if not (t.startswith("[") and t.endswith("]")) and t != t.lower())
    return capitals < 0.01 * len(tokens)


def bert_tokenizer(vocab_file: str | Path, do_lower_case: bool | None = None):
    """A ``BertTokenizerFast`` over a local vocab file (transformers 4.x and 5.x)."""
    from transformers import BertTokenizerFast

    if do_lower_case is None:
        do_lower_case = infer_do_lower_case(vocab_file)
    params = inspect.signature(BertTokenizerFast.__init__).parameters
    if "vocab" in params:  # transformers 5: takes the token -> id mapping
        vocab = {t: i for i, t in enumerate(read_vocab(vocab_file))}
        return BertTokenizerFast(vocab=vocab, do_lower_case=do_lower_case)
    return BertTokenizerFast(vocab_file=str(vocab_file), do_lower_case=do_lower_case)


def write_tokenizer_files(out_dir: str | Path, vocab_file: str | Path, do_lower_case: bool, max_length: int) -> None:
    """vocab.txt, tokenizer.json and tokenizer_config.json (with the casing) for ``AutoTokenizer``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = bert_tokenizer(vocab_file, do_lower_case)
    tok.model_max_length = max_length
    tok.save_pretrained(str(out))
    shutil.copyfile(vocab_file, out / "vocab.txt")
    # transformers 4.x writes its own special_tokens_map; 5.x keeps them in tokenizer_config.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["do_lower_case"] = do_lower_case
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def read_tokenizer_casing(hf_dir: str | Path) -> bool | None:
    """``do_lower_case`` from an HF dir's tokenizer_config.json, or None when it does not say."""
    p = Path(hf_dir) / "tokenizer_config.json"
    if not p.is_file():
        return None
    value = json.loads(p.read_text()).get("do_lower_case")
    return bool(value) if value is not None else None


def fast_tokenizer(tokenizer_json: str | Path):
    """A checkpoint's own fast tokenizer from its ``tokenizer.json`` (ModernBERT's byte-level BPE),
    with the ``tokenizer_config.json`` beside it when there is one; never downloaded.

    It returns ``token_type_ids`` for every input (zeros for one text), as BERT's tokenizer does,
    so the code that turns encodings into features is the same for both (ModernBERT ignores them)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(tokenizer_json)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {p}")
    tok = None
    if (p.parent / "tokenizer_config.json").is_file():
        try:
            tok = AutoTokenizer.from_pretrained(str(p.parent), local_files_only=True)
        except (OSError, ValueError, KeyError):
            tok = None  # a config AutoTokenizer cannot place (no tokenizer_class, no config.json)
    if tok is None or not getattr(tok, "is_fast", False):
        special = {}
        if (p.parent / "tokenizer_config.json").is_file():
            conf = json.loads((p.parent / "tokenizer_config.json").read_text())
            special = {k: conf[k] for k in ("cls_token", "sep_token", "pad_token", "unk_token", "mask_token",
                                            "model_max_length") if isinstance(conf.get(k), (str, int))}
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p), **special)
    tok.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    trim_byte_level_offsets(tok.backend_tokenizer)
    return tok


def write_checkpoint_tokenizer(out_dir: str | Path, w, vocab_file: str | Path | None, do_lower_case: bool | None,
                               max_length: int) -> None:
    """The tokenizer files of a model made from the checkpoint ``w`` (a ``PretrainedWeights``): its
    own tokenizer files as they were (ModernBERT), else the WordPiece ``vocab_file`` with its casing."""
    own = next((Path(f) for f in w.tokenizer_files if Path(f).name == "tokenizer.json"), None)
    if own is not None:
        for f in w.tokenizer_files:
            shutil.copyfile(f, Path(out_dir) / Path(f).name)
        write_special_tokens_config(out_dir, own, max_length)
        return
    if vocab_file is None:
        raise ValueError("the checkpoint names neither tokenizer files nor a vocab file to write its tokenizer from")
    write_tokenizer_files(out_dir, vocab_file, bool(do_lower_case), max_length)


def write_special_tokens_config(out_dir: str | Path, tokenizer_json: str | Path, max_length: int) -> bool:
    """A tokenizer_config.json naming the special tokens of a bare ``tokenizer.json`` (one built for
    the data pipeline needs none: it reads them from the post-processor), so that ``AutoTokenizer``
    has [CLS], [MASK] and [PAD] as the records had them. A config already in ``out_dir`` is kept;
    False when there was one, or the tokenizer names no full set of special tokens."""
    from bertdist.config import ConfigError
    from bertdist.data.tokenizer_file import SPECIAL_ROLES, load_tokenizer_file

    out = Path(out_dir) / "tokenizer_config.json"
    if out.is_file():
        return False
    try:
        tf = load_tokenizer_file(tokenizer_json)
    except ConfigError:
        return False  # not one the pipeline could have used either; carried as it is
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
            **{f"{role}_token": tok.id_to_token(tf.special[role]) for role in SPECIAL_ROLES},
            "model_input_names": ["input_ids", "attention_mask"]}
    out.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return True


def write_modernbert_tokenizer(out_dir: str | Path, w) -> list[str]:
    """Beside a ModernBERT's weights (its tokenizer.json files already copied there): the
    tokenizer_config.json a bare tokenizer.json lacks, or for a ModernBERT pretrained on a WordPiece
    vocab its BERT tokenizer files. Returns the names written."""
    max_length = w.config.max_position_embeddings
    if w.tokenizer_json is not None:
        return ["tokenizer_config.json"] if write_special_tokens_config(out_dir, w.tokenizer_json, max_length) else []
    if w.vocab_file is None:
        return []
    lower = w.do_lower_case if w.do_lower_case is not None else infer_do_lower_case(w.vocab_file)
    write_tokenizer_files(out_dir, w.vocab_file, lower, max_length)
    # ModernBERT takes no token types: the tokenizer's output goes into the model as it is
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    conf = json.loads(cfg_path.read_text())
    conf["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return ["vocab.txt", "tokenizer.json", "tokenizer_config.json"]


def tokenizer_sha256(vocab_file: str | Path | None, tokenizer_files=()) -> str:
    """Fingerprint of a model's tokenizer: its WordPiece vocab's (``vocab_sha256``), or for a model
    with its own tokenizer files (ModernBERT's) the sha256 of its tokenizer.json."""
    if vocab_file is not None:
        return vocab_sha256(vocab_file)
    own = next((Path(f) for f in tokenizer_files if Path(f).name == "tokenizer.json"), None)
    if own is None:
        raise ValueError("a model with neither a vocab file nor a tokenizer.json has no tokenizer to fingerprint")
    return hashlib.sha256(own.read_bytes()).hexdigest()


def trim_byte_level_offsets(tok) -> None:
    """A byte-level BPE (ModernBERT's) counts the space before a word into its first token's
    character span; keep each span to the word's own characters (ids are unchanged), so answer
    spans and served word spans do not start with a space. ``tok``: a ``tokenizers.Tokenizer``."""
    from tokenizers import pre_tokenizers, processors

    if not isinstance(tok.pre_tokenizer, pre_tokenizers.ByteLevel):
        return
    post = json.loads(tok.to_str()).get("post_processor") or {}
    if "ByteLevel" in (post.get("type"), *(p.get("type") for p in post.get("processors", []))):
        return  # spans already trimmed (or the tokenizer trims them itself)
    steps = [processors.ByteLevel(trim_offsets=True)] + ([tok.post_processor] if tok.post_processor else [])
    tok.post_processor = processors.Sequence(steps)
