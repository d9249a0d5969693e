"""Unlabelled text for pseudo-labelling, read into the task runner's own example types.

Accepted layouts, per task family (labels, where a file has them, are never read):

* GLUE: a TSV in the task's layout (header naming the task's text columns; the label column may
  be absent), JSONL (the task's column names as keys, or ``text``/``text_a``/``text_b``), or, for
  single-sentence tasks, plain text with one sentence per line;
* NER: CoNLL layout (``word [POS chunk] [TAG]`` per line, blank line between sentences), or JSONL
  (``words`` list or ``text`` string);
* SQuAD: SQuAD JSON (answers ignored) or JSONL with ``question`` and ``context`` (and ``id``).

Blank lines of plain text and JSONL are skipped and counted; anything else that does not fit is an
error naming the file and line.
"""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from bertdist.finetune import glue, ner, squad
from bertdist.finetune.errors import DataError


@dataclasses.dataclass
class UnlabeledSource:
    path: Path
    examples: list  # glue.Example / ner.Sentence / squad.SquadExample
    skipped_blank: int = 0


def _nonempty(path: Path) -> str:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    text = path.read_text(encoding="utf-8-sig")
    if not text.strip():
        raise DataError(f"{path}:1: empty file: no text to label")
    return text


def _jsonl(path: Path, text: str) -> tuple[list[tuple[int, dict]], int]:
    """(line number, object) per non-blank line, and the count of blank lines."""
    rows, blank = [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            blank += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: wrong layout: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{n}: wrong layout: expected a JSON object, got {type(obj).__name__}")
        rows.append((n, obj))
    return rows, blank


def _field(obj: dict, names: tuple, path: Path, n: int, what: str) -> str:
    for k in names:
        if k in obj and isinstance(obj[k], str):
            return obj[k]
    raise DataError(f"{path}:{n}: wrong layout: no {what} field (expected one of {list(names)}), keys {sorted(obj)}")


def read_glue_unlabeled(task: glue.GlueTask, path: Path) -> UnlabeledSource:
    text = _nonempty(path)
    pair = task.text_b is not None
    a_names = tuple(str(x) for x in (task.text_a, task.test_text_a, "text_a", "text", "sentence") if isinstance(x, str))
    b_names = tuple(str(x) for x in (task.text_b, task.test_text_b, "text_b") if isinstance(x, str))
    out: list[glue.Example] = []
    if path.suffix == ".jsonl":
        rows, blank = _jsonl(path, text)
        for n, obj in rows:
            a = _field(obj, a_names, path, n, "first text")
            b = _field(obj, b_names, path, n, "second text") if pair else None
            out.append(glue.Example(str(obj.get("id", n)), a, b, None))
        return UnlabeledSource(path, out, blank)
    if path.suffix == ".tsv":
        rows = list(csv.reader(text.splitlines(), delimiter="\t", quotechar=None))
        header = rows[0]
        ia = next((header.index(c) for c in a_names if c in header), None)
        ib = next((header.index(c) for c in b_names if c in header), None) if pair else None
        if ia is None or (pair and ib is None):
            want = [task.text_a] + ([task.text_b] if pair else [])
            raise DataError(f"{path}:1: wrong layout: the header {header} lacks the {task.name} text column(s) {want}")
        blank = 0
        for n, row in enumerate(rows[1:], 2):
            if not row:
                blank += 1
                continue
            if len(row) < len(header) - 1 or len(row) > len(header):  # the label column may be absent
                raise DataError(f"{path}:{n}: wrong layout: {len(row)} columns, the header has {len(header)} {header}")
            if ia >= len(row) or (ib is not None and ib >= len(row)):
                raise DataError(f"{path}:{n}: wrong layout: {len(row)} columns, no text in column {max(ia, ib or 0) + 1}")
            out.append(glue.Example(str(n), row[ia], row[ib] if ib is not None else None, None))
        return UnlabeledSource(path, out, blank)
    if pair:
        raise DataError(f"{path}:1: wrong layout: {task.name} takes sentence pairs: give a .tsv with the columns "
                        f"{[task.text_a, task.text_b]} or a .jsonl, not plain text")
    blank = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            blank += 1
            continue
        out.append(glue.Example(str(n), line.strip(), None, None))
    return UnlabeledSource(path, out, blank)


def read_ner_unlabeled(path: Path) -> UnlabeledSource:
    text = _nonempty(path)
    out: list[ner.Sentence] = []
    if path.suffix == ".jsonl":
        rows, blank = _jsonl(path, text)
        for n, obj in rows:
            words = obj.get("words")
            if words is None and isinstance(obj.get("text"), str):
                words = obj["text"].split()
            if not isinstance(words, list) or not words or not all(isinstance(w, str) for w in words):
                raise DataError(f"{path}:{n}: wrong layout: expected 'words' (a list of strings) or 'text'")
            out.append(ner.Sentence(words, ["O"] * len(words), n))
        return UnlabeledSource(path, out, blank)
    words: list[str] = []
    start = 1
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            if words:
                out.append(ner.Sentence(words, ["O"] * len(words), start))
                words = []
            start = n + 1
            continue
        if parts[0] == "-DOCSTART-":
            continue
        if len(parts) > 4:
            raise DataError(f"{path}:{n}: wrong layout: {len(parts)} columns; CoNLL files have one word per line "
                            f"('word [POS chunk] [TAG]', blank line between sentences), or use .jsonl")
        words.append(parts[0])
    if words:
        out.append(ner.Sentence(words, ["O"] * len(words), start))
    return UnlabeledSource(path, out, 0)


def read_squad_unlabeled(path: Path) -> UnlabeledSource:
    text = _nonempty(path)
    out: list[squad.SquadExample] = []
    if path.suffix == ".jsonl":
        rows, blank = _jsonl(path, text)
        for n, obj in rows:
            q = _field(obj, ("question",), path, n, "question")
            c = _field(obj, ("context",), path, n, "context")
            out.append(squad.SquadExample(str(obj.get("id", n)), q, c, [], False))
        return UnlabeledSource(path, out, blank)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: wrong layout: not valid JSON ({e.msg}); expected SQuAD JSON or .jsonl") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise DataError(f"{path}:1: wrong layout: not a SQuAD file (no top-level 'data' list)")
    for a in data["data"]:
        for p in a.get("paragraphs", []):
            for q in p.get("qas", []):
                out.append(squad.SquadExample(str(q.get("id", len(out))), q["question"], p["context"], [], False))
    return UnlabeledSource(path, out, 0)


def read_unlabeled(task: str, path: str | Path) -> UnlabeledSource:
    """The examples of one unlabelled file for the canonical task name ``task``."""
    p = Path(path)
    if task in glue.GLUE_TASKS:
        return read_glue_unlabeled(glue.GLUE_TASKS[task], p)
    if task == "ner":
        return read_ner_unlabeled(p)
    if task in ("squad", "squad2"):
        return read_squad_unlabeled(p)
    raise DataError(f"task {task!r} has no distillation reader (GLUE, ner, squad, squad2)")
