"""GLUE tasks in the standard ``download_glue_data.py`` TSV layout.

Each task is described by where its text and label columns are (by header
name, or by position for CoLA's header-less train/dev files), its label set
and its metrics. Rows that don't fit the layout, and labels outside the label
set, are errors that name the file, the line and what was expected.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import sys
from pathlib import Path

from bertdist.finetune.metrics import accuracy, binary_f1, matthews_corrcoef, pearson, spearman
from bertdist.finetune.errors import DataError, not_utf8

csv.field_size_limit(sys.maxsize)


@dataclasses.dataclass
class Example:
    guid: str
    text_a: str
    text_b: str | None
    label: str | float | None  # None on test sets


@dataclasses.dataclass(frozen=True)
class GlueTask:
    name: str
    labels: tuple[str, ...]  # empty for regression
    text_a: str | int  # header name, or column index when the file has no header
    text_b: str | int | None
    label: str | int
    header: bool = True
    test_text_a: str | None = None  # test files use other layouts (an `index` column)
    test_text_b: str | None = None
    dev_splits: tuple[str, ...] = ("dev",)
    test_splits: tuple[str, ...] = ("test",)
    submission: tuple[str, ...] = ()  # GLUE leaderboard file name per test split
    n_columns: int | None = None  # exact column count for header-less files

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.labels)

    def metrics(self, preds, labels) -> dict[str, float]:
        if self.is_regression:
            return {"pearson": pearson(preds, labels), "spearman": spearman(preds, labels)}
        out = {"accuracy": accuracy(preds, labels)}
        if self.name == "cola":
            out = {"mcc": matthews_corrcoef(preds, labels), **out}
        if self.name in ("mrpc", "qqp"):
            out = {"f1": binary_f1(preds, labels), **out}
        return out

    @property
    def main_metric(self) -> str:
        return {"cola": "mcc", "stsb": "pearson", "mrpc": "f1", "qqp": "f1"}.get(self.name, "accuracy")


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in [
        GlueTask("cola", ("0", "1"), 3, None, 1, header=False, test_text_a="sentence", n_columns=4,
                 submission=("CoLA",)),
        GlueTask("sst2", ("0", "1"), "sentence", None, "label", test_text_a="sentence", submission=("SST-2",)),
        GlueTask("mrpc", ("0", "1"), "#1 String", "#2 String", "Quality", test_text_a="#1 String",
                 test_text_b="#2 String", submission=("MRPC",)),
        GlueTask("stsb", (), "sentence1", "sentence2", "score", test_text_a="sentence1", test_text_b="sentence2",
                 submission=("STS-B",)),
        GlueTask("qqp", ("0", "1"), "question1", "question2", "is_duplicate", test_text_a="question1",
                 test_text_b="question2", submission=("QQP",)),
        GlueTask("mnli", ("contradiction", "entailment", "neutral"), "sentence1", "sentence2", "gold_label",
                 test_text_a="sentence1", test_text_b="sentence2", dev_splits=("dev_matched", "dev_mismatched"),
                 test_splits=("test_matched", "test_mismatched"), submission=("MNLI-m", "MNLI-mm")),
        GlueTask("qnli", ("entailment", "not_entailment"), "question", "sentence", "label", test_text_a="question",
                 test_text_b="sentence", submission=("QNLI",)),
        GlueTask("rte", ("entailment", "not_entailment"), "sentence1", "sentence2", "label",
                 test_text_a="sentence1", test_text_b="sentence2", submission=("RTE",)),
        GlueTask("wnli", ("0", "1"), "sentence1", "sentence2", "label", test_text_a="sentence1",
                 test_text_b="sentence2", submission=("WNLI",)),
    ]
}
ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli-m": "mnli", "mnli-mm": "mnli"}


def read_tsv(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:  # -sig: MRPC's header starts with a BOM
            return [row for row in csv.reader(f, delimiter="\t", quotechar=None)]
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None


def _col(header: list[str], name: str, path: Path) -> int:
    if name not in header:
        raise DataError(f"{path}: wrong column layout: no column {name!r} in the header {header}")
    return header.index(name)


def read_glue(task: GlueTask, path: str | Path, test: bool = False, limit: int | None = None) -> list[Example]:
    """Examples from one GLUE TSV file; ``test`` files have no labels."""
    path = Path(path)
    rows = read_tsv(path)
    if not rows:
        raise DataError(f"{path}: empty file")
    if test:
        header, body, first_line = rows[0], rows[1:], 2
        ia = _col(header, task.test_text_a, path)
        ib = _col(header, task.test_text_b, path) if task.test_text_b else None
        il = None
        iguid = _col(header, "index", path) if "index" in header else _col(header, "id", path)
    elif task.header:
        header, body, first_line = rows[0], rows[1:], 2
        ia = _col(header, task.text_a, path)
        ib = _col(header, task.text_b, path) if task.text_b is not None else None
        il = _col(header, task.label, path)
        iguid = None
    else:
        header, body, first_line = None, rows, 1
        ia, ib, il, iguid = task.text_a, task.text_b, task.label, None
        if rows and len(rows[0]) != task.n_columns:
            raise DataError(f"{path}: wrong column layout: line 1 has {len(rows[0])} columns, {task.name} "
                            f"train/dev files have {task.n_columns} and no header (source, label, mark, sentence)")
    width = len(header) if header is not None else task.n_columns
    out = []
    for n, row in enumerate(body):
        line = first_line + n
        if not row:
            continue
        if len(row) != width:
            raise DataError(f"{path}:{line}: wrong column layout: {len(row)} columns, expected {width}"
                            + (f" ({header})" if header else ""))
        label = None
        if il is not None:
            raw = row[il].strip()
            if task.is_regression:
                try:
                    label = float(raw)
                except ValueError:
                    label = None
                if label is None or not math.isfinite(label):  # "nan" parses, and poisons the loss
                    raise DataError(f"{path}:{line}: {task.name} label {raw!r} is not a finite number")
            else:
                if raw not in task.labels:
                    raise DataError(f"{path}:{line}: label {raw!r} is not in the {task.name} label set {list(task.labels)}")
                label = raw
        guid = row[iguid] if iguid is not None else str(n)
        out.append(Example(guid, row[ia], row[ib] if ib is not None else None, label))
        if limit is not None and len(out) >= limit:
            break
    return out


def split_file(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / f"{split}.tsv"


def write_submission(path: Path, task: GlueTask, guids: list[str], preds: list) -> None:
    """The GLUE leaderboard format: a header ``index\\tprediction``, one row per test example."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write("index\tprediction\n")
        for g, p in zip(guids, preds):
            f.write(f"{g}\t{p:.3f}\n" if task.is_regression else f"{g}\t{p}\n")
