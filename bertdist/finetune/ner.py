"""CoNLL-2003 NER files (IOB1 as released, or IOB2), read into sentences of (word, tag).

Training always uses IOB2 labels (every entity starts with B-), converted from
IOB1 when needed; entity-level F1 compares entity spans, which don't depend on
the scheme, so predictions are scored against the file's own tags.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from bertdist.finetune.errors import DataError, not_utf8
from bertdist.finetune.metrics import entity_spans

SPLIT_FILES = {  # our split name -> candidate file names (IOB2 conversion, original release)
    "train": ("train.txt", "eng.train"),
    "dev": ("valid.txt", "dev.txt", "eng.testa"),
    "test": ("test.txt", "eng.testb"),
}


@dataclasses.dataclass
class Sentence:
    words: list[str]
    tags: list[str]  # as in the file
    line: int  # first line, for error messages


def read_conll(path: str | Path, limit: int | None = None) -> list[Sentence]:
    """Sentences from a CoNLL file: ``word [POS chunk] TAG`` per line, blank line between sentences."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        return _read_conll_lines(path, limit)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None


def _read_conll_lines(path: Path, limit: int | None) -> list[Sentence]:
    out: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    start = 1
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                if words:
                    out.append(Sentence(words, tags, start))
                    words, tags = [], []
                    if limit is not None and len(out) >= limit:
                        return out
                start = n + 1
                continue
            if parts[0] == "-DOCSTART-":
                continue
            if len(parts) < 2:
                raise DataError(f"{path}:{n}: wrong column layout: expected 'word ... TAG', got {line.strip()!r}")
            tag = parts[-1]
            if tag != "O" and (tag[:2] not in ("B-", "I-") or len(tag) < 3):
                raise DataError(f"{path}:{n}: NER tag {tag!r} is not O, B-TYPE or I-TYPE")
            words.append(parts[0])
            tags.append(tag)
    if words:
        out.append(Sentence(words, tags, start))
    return out


def detect_scheme(sentences: list[Sentence]) -> str:
    """IOB1 if some entity starts with I- (not allowed in IOB2), else IOB2."""
    for s in sentences:
        prev = "O"
        for t in s.tags:
            if t.startswith("I-") and (prev == "O" or prev[2:] != t[2:]):
                return "IOB1"
            prev = t
    return "IOB2"


def to_iob2(tags: list[str], scheme: str) -> list[str]:
    out = ["O"] * len(tags)
    for typ, a, b in entity_spans(tags, scheme):
        out[a] = f"B-{typ}"
        for i in range(a + 1, b):
            out[i] = f"I-{typ}"
    return out


def label_set(sentences: list[Sentence]) -> list[str]:
    """O, then B-/I- for each entity type seen, sorted: a fixed order for the classifier."""
    types = sorted({t[2:] for s in sentences for t in s.tags if t != "O"})
    return ["O"] + [f"{p}-{t}" for t in types for p in ("B", "I")]


def find_split(data_dir: str | Path, split: str) -> Path:
    d = Path(data_dir)
    for name in SPLIT_FILES[split]:
        if (d / name).is_file():
            return d / name
    raise DataError(f"{d}: no {split} file (looked for {list(SPLIT_FILES[split])})")
