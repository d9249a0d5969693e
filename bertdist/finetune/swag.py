"""SWAG multiple choice, in the released CSV layout (``train.csv``, ``val.csv``, ``test.csv``):
a context ``sent1``, the start of the next sentence ``sent2`` and four endings; ``label`` is the right one."""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

from bertdist.finetune.errors import DataError, not_utf8

REQUIRED = ("sent1", "sent2", "ending0", "ending1", "ending2", "ending3")
SPLIT_FILES = {"train": "train.csv", "dev": "val.csv", "test": "test.csv"}


@dataclasses.dataclass
class ChoiceExample:
    guid: str
    context: str
    start: str
    endings: list[str]
    label: int | None


def read_swag(path: str | Path, test: bool = False, limit: int | None = None) -> list[ChoiceExample]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        return _read_swag_rows(path, test, limit)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    except csv.Error as e:  # a NUL byte, a field over csv's limit
        raise DataError(f"{path}: not a readable CSV file ({e})") from None


def _read_swag_rows(path: Path, test: bool, limit: int | None) -> list[ChoiceExample]:
    out = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in REQUIRED + (() if test else ("label",)) if c not in header]
        if missing:
            raise DataError(f"{path}: wrong column layout: missing columns {missing}; header is {header}")
        for n, row in enumerate(reader, 2):
            if None in row or any(row[c] is None for c in REQUIRED):
                raise DataError(f"{path}:{n}: wrong column layout: {len(header)} columns expected")
            label = None
            if not test:
                raw = (row["label"] or "").strip()
                if raw not in ("0", "1", "2", "3"):
                    raise DataError(f"{path}:{n}: label {raw!r} is not in the SWAG label set ['0', '1', '2', '3']")
                label = int(raw)
            guid = row.get("video-id") or row.get("") or str(n - 2)
            out.append(ChoiceExample(f"{guid}-{n - 2}", row["sent1"], row["sent2"],
                                     [row[f"ending{i}"] for i in range(4)], label))
            if limit is not None and len(out) >= limit:
                break
    return out
