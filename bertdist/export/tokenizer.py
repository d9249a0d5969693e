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
