"""Training files for embedding and re-ranking models.

* ``read_pairs``: (query, positive, hard negatives) rows. JSONL: one object per line,
  ``{"query": ..., "positive": ..., "negatives": [...]}`` (``negatives`` optional; other keys are
  ignored). TSV: ``query<TAB>positive[<TAB>negative...]``, an optional header line
  ``query<TAB>positive[<TAB>...]``.
* ``read_scored_pairs``: (text_a, text_b, score) rows. JSONL: ``{"text_a", "text_b", "score"}``
  with a JSON number; TSV: exactly three columns, an optional header ``text_a<TAB>text_b<TAB>score``.
* ``read_stsb``: GLUE STS-B's train.tsv/dev.tsv (a header naming ``sentence1``, ``sentence2``,
  ``score`` among its columns; every row as wide as the header).
* ``load_data``: a run's train and dev rows, from ``data`` (``train.jsonl``/``train.tsv``,
  ``dev.jsonl``/``dev.tsv``; sts: STS-B's) or the files ``train_file`` / ``dev_file`` name.

The format comes from the extension (``.jsonl``, ``.tsv``) unless ``fmt`` names it. Blank lines
are skipped. Anything else that does not fit (an empty file, invalid JSON, a missing key or
column, a score that is not a finite number, an empty text) is a ``DataError`` naming ``path:line``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Iterator

from bertdist.embed.config import EmbedConfig
from bertdist.finetune.errors import DataError, not_utf8
from bertdist.finetune.glue import read_tsv

FORMATS = ("jsonl", "tsv")


@dataclasses.dataclass(frozen=True)
class PairExample:
    query: str
    positive: str
    negatives: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ScoredPair:
    text_a: str
    text_b: str
    score: float


def _format(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise DataError(f"{path}: format {fmt!r} is not one of {list(FORMATS)}")
        return fmt
    ext = path.suffix.lower().lstrip(".")
    if ext not in FORMATS:
        raise DataError(f"{path}: cannot tell the format from the extension {path.suffix!r}: name the file "
                        f".jsonl or .tsv, or pass the format ({list(FORMATS)})")
    return ext


def _jsonl_rows(path: Path, expect: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a file with none is an error."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    seen = False
    try:
        with path.open(encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                seen = True
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); expected one "
                                    f"object per line: {expect}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{n}: wrong layout: a JSON {type(row).__name__}, expected an object "
                                    f"{expect}")
                yield n, row
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    if not seen:
        raise DataError(f"{path}:1: empty file: no rows (expected one JSON object per line: {expect})")


def _text(value, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__} {value!r:.80}")
    if not value.strip():
        raise DataError(f"{where}: {what} is empty")
    return value


def _key(row: dict, key: str, where: str, expect: str):
    if key not in row:
        raise DataError(f"{where}: missing key {key!r} (the row has {sorted(row)}; expected {expect})")
    return row[key]


def _score(raw, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise DataError(f"{where}: score {raw!r:.80} is not a number")
    try:
        value = float(raw)
    except ValueError:
        raise DataError(f"{where}: score {raw!r:.80} is not a number") from None
    if not math.isfinite(value):  # "nan" parses, and poisons the loss
        raise DataError(f"{where}: score {raw!r} is not a finite number")
    return value


def _tsv_rows(path: Path, expect: str) -> list[tuple[int, list[str]]]:
    rows = [(n, r) for n, r in enumerate(read_tsv(path), 1) if r and any(c.strip() for c in r)]
    if not rows:
        raise DataError(f"{path}:1: empty file: no rows (expected {expect})")
    return rows


# ---------------------------------------------------------------- (query, positive, negatives)
PAIRS_JSONL = '{"query": ..., "positive": ..., "negatives": [...] (optional)}'
PAIRS_TSV = "query<TAB>positive[<TAB>negative...]"


def read_pairs(path: str | Path, fmt: str | None = None) -> list[PairExample]:
    path = Path(path)
    if _format(path, fmt) == "jsonl":
        out = []
        for n, row in _jsonl_rows(path, PAIRS_JSONL):
            where = f"{path}:{n}"
            q = _text(_key(row, "query", where, PAIRS_JSONL), "query", where)
            p = _text(_key(row, "positive", where, PAIRS_JSONL), "positive", where)
            negs = row.get("negatives", [])
            if not isinstance(negs, list):
                raise DataError(f"{where}: negatives must be a list of strings, got {type(negs).__name__}")
            out.append(PairExample(q, p, tuple(_text(x, f"negatives[{i}]", where) for i, x in enumerate(negs))))
        return out
    rows = _tsv_rows(path, PAIRS_TSV)
    if [c.strip().lower() for c in rows[0][1][:2]] == ["query", "positive"]:
        rows = rows[1:]
        if not rows:
            raise DataError(f"{path}:2: no rows after the header (expected {PAIRS_TSV})")
    out = []
    for n, r in rows:
        where = f"{path}:{n}"
        if len(r) < 2:
            raise DataError(f"{where}: wrong layout: {len(r)} column, expected {PAIRS_TSV}")
        names = ["query", "positive"] + [f"negative {i + 1}" for i in range(len(r) - 2)]
        texts = [_text(c, name, where) for c, name in zip(r, names)]
        out.append(PairExample(texts[0], texts[1], tuple(texts[2:])))
    return out


# ---------------------------------------------------------------- (text_a, text_b, score)
SCORED_JSONL = '{"text_a": ..., "text_b": ..., "score": <number>}'
SCORED_TSV = "text_a<TAB>text_b<TAB>score"


def read_scored_pairs(path: str | Path, fmt: str | None = None) -> list[ScoredPair]:
    path = Path(path)
    if _format(path, fmt) == "jsonl":
        out = []
        for n, row in _jsonl_rows(path, SCORED_JSONL):
            where = f"{path}:{n}"
            a = _text(_key(row, "text_a", where, SCORED_JSONL), "text_a", where)
            b = _text(_key(row, "text_b", where, SCORED_JSONL), "text_b", where)
            raw = _key(row, "score", where, SCORED_JSONL)
            if isinstance(raw, str):  # JSON has numbers: a quoted one is a layout mistake worth naming
                raise DataError(f"{where}: score {raw!r:.80} is a string, expected a JSON number")
            out.append(ScoredPair(a, b, _score(raw, where)))
        return out
    rows = _tsv_rows(path, SCORED_TSV)
    if [c.strip().lower() for c in rows[0][1]] == ["text_a", "text_b", "score"]:
        rows = rows[1:]
        if not rows:
            raise DataError(f"{path}:2: no rows after the header (expected {SCORED_TSV})")
    out = []
    for n, r in rows:
        where = f"{path}:{n}"
        if len(r) != 3:
            raise DataError(f"{where}: wrong layout: {len(r)} columns, expected 3: {SCORED_TSV}")
        try:
            score = _score(r[2].strip(), where)
        except DataError as e:
            if n != rows[0][0]:
                raise
            raise DataError(f"{e} (a header line must read text_a<TAB>text_b<TAB>score)") from None
        out.append(ScoredPair(_text(r[0], "text_a", where), _text(r[1], "text_b", where), score))
    return out


# ---------------------------------------------------------------- GLUE STS-B
STSB_COLUMNS = ("sentence1", "sentence2", "score")


def read_stsb(path: str | Path) -> list[ScoredPair]:
    """STS-B train/dev rows as scored pairs, the score on STS-B's own 0-5 scale."""
    path = Path(path)
    rows = _tsv_rows(path, "GLUE STS-B: a header with sentence1, sentence2 and score columns")
    n0, header = rows[0]
    missing = [c for c in STSB_COLUMNS if c not in header]
    if missing:
        raise DataError(f"{path}:{n0}: missing column(s) {missing} in the header {header} (GLUE STS-B train.tsv/"
                        "dev.tsv; test.tsv has no score)")
    ia, ib, isc = (header.index(c) for c in STSB_COLUMNS)
    if len(rows) == 1:
        raise DataError(f"{path}:{n0 + 1}: no rows after the header")
    out = []
    for n, r in rows[1:]:
        where = f"{path}:{n}"
        if len(r) != len(header):
            raise DataError(f"{where}: wrong layout: {len(r)} columns, the header has {len(header)} ({header})")
        out.append(ScoredPair(_text(r[ia], "sentence1", where), _text(r[ib], "sentence2", where),
                              _score(r[isc].strip(), where)))
    return out


# ---------------------------------------------------------------- a run's files
@dataclasses.dataclass
class TrainData:
    rows: list  # PairExample (embed, rerank) or ScoredPair (sts), sliced to max_train_examples
    all_rows: list  # every row of the train file (the mined corpus is built from all of them)
    train_path: Path
    dev: list | None
    dev_path: Path | None


def _find(data_dir: str, override: str | None, names: tuple[str, ...], what: str, required: bool) -> Path | None:
    if override:
        p = Path(override)
        if not p.is_file():
            raise DataError(f"{p}: {what} file not found")
        return p
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"data directory not found: {d}")
    for n in names:
        if (d / n).is_file():
            return d / n
    if required:
        raise DataError(f"{d}: no {what} file (looked for {list(names)})")
    return None


def read_task_file(task: str, path: Path) -> list:
    """A train or dev file of an embedding task: scored pairs for ``sts`` (STS-B's TSV or JSONL),
    else pairs (with their negatives)."""
    if task != "sts":
        return read_pairs(path)
    return read_scored_pairs(path) if path.suffix.lower() == ".jsonl" else read_stsb(path)


def load_data(cfg: EmbedConfig) -> TrainData:
    names = {"sts": (("train.tsv",), ("dev.tsv",))}.get(cfg.task, (("train.jsonl", "train.tsv"),
                                                                   ("dev.jsonl", "dev.tsv")))
    train_path = _find(cfg.data, cfg.train_file, names[0], "train", True)
    dev_path = _find(cfg.data, cfg.dev_file, names[1], "dev", False)
    all_rows = read_task_file(cfg.task, train_path)
    rows = all_rows[:cfg.max_train_examples] if cfg.max_train_examples else all_rows
    dev = None
    if dev_path is not None:
        dev = read_task_file(cfg.task, dev_path)
        dev = dev[:cfg.max_eval_examples] if cfg.max_eval_examples else dev
    return TrainData(rows, all_rows, train_path, dev, dev_path)
