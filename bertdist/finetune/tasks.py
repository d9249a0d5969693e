"""One runner per task family: it turns the task's files into model inputs, and
the model's outputs back into the task's metrics and prediction files.

``make_runner(task, data_dir, tokenizer, cfg)`` is the only entry the training
loop needs. Features are unpadded python lists; the loop pads per batch.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from bertdist.finetune import glue, metrics, ner, squad, swag
from bertdist.finetune.errors import DataError
from bertdist.model import IGNORE_INDEX

TASKS = tuple(glue.GLUE_TASKS) + ("squad", "squad2", "ner", "swag")


@dataclasses.dataclass
class EvalSet:
    name: str  # split name, e.g. dev, dev_matched, test
    features: list[dict]
    context: Any  # what scoring needs (examples, feature mapping)
    labelled: bool


class Runner:
    kind: str
    num_labels: int
    main_metric: str
    label_names: list[str] | None = None

    def train_features(self) -> list[dict]: ...
    def eval_sets(self) -> list[EvalSet]: ...
    def test_sets(self) -> list[EvalSet]: return []
    def score(self, es: EvalSet, logits: list[np.ndarray]) -> tuple[dict, list[dict]]: ...
    def write_test(self, out_dir: Path, es: EvalSet, logits: list[np.ndarray]) -> Path | None: return None


def _file(data_dir: Path, override: str | None, names: tuple[str, ...], what: str, required: bool = True) -> Path | None:
    if override:
        return Path(override)
    for n in names:
        if (data_dir / n).is_file():
            return data_dir / n
    if required:
        raise DataError(f"{data_dir}: no {what} file (looked for {list(names)})")
    return None


class GlueRunner(Runner):
    def __init__(self, name: str, data_dir: Path, tok, cfg):
        self.task = glue.GLUE_TASKS[name]
        self.data_dir, self.tok, self.cfg = data_dir, tok, cfg
        self.kind = "regression" if self.task.is_regression else "classification"
        self.num_labels = self.task.num_labels
        self.main_metric = self.task.main_metric
        self.label_names = list(self.task.labels) or None

    def _encode(self, examples: list[glue.Example]) -> list[dict]:
        enc = self.tok([e.text_a for e in examples], [e.text_b for e in examples] if self.task.text_b is not None else None,
                       truncation=True, max_length=self.cfg.max_seq_length)
        feats = []
        for i, e in enumerate(examples):
            f = {k: enc[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")}
            if e.label is not None:
                f["labels"] = float(e.label) if self.task.is_regression else self.task.labels.index(e.label)
            feats.append(f)
        return feats

    def train_features(self) -> list[dict]:
        path = _file(self.data_dir, self.cfg.train_file, ("train.tsv",), "train")
        return self._encode(glue.read_glue(self.task, path, limit=self.cfg.max_train_examples))

    def eval_sets(self) -> list[EvalSet]:
        out = []
        for split in self.task.dev_splits:
            path = Path(self.cfg.dev_file) if self.cfg.dev_file and len(self.task.dev_splits) == 1 else \
                glue.split_file(self.data_dir, split)
            ex = glue.read_glue(self.task, path, limit=self.cfg.max_eval_examples)
            out.append(EvalSet(split, self._encode(ex), ex, True))
        return out

    def test_sets(self) -> list[EvalSet]:
        out = []
        for split in self.task.test_splits:
            path = glue.split_file(self.data_dir, split)
            if path.is_file():
                ex = glue.read_glue(self.task, path, test=True, limit=self.cfg.max_eval_examples)
                out.append(EvalSet(split, self._encode(ex), ex, False))
        return out

    def _predict(self, logits: list[np.ndarray]) -> list:
        if self.task.is_regression:
            return [float(np.clip(x, 0.0, 5.0)) for x in np.asarray(logits).reshape(-1)]
        return [int(np.argmax(x)) for x in logits]

    def score(self, es, logits):
        preds = self._predict(logits)
        gold = [e.label if self.task.is_regression else self.task.labels.index(e.label) for e in es.context]
        scores = self.task.metrics(preds, gold)
        rows = [{"guid": e.guid, "prediction": p if self.task.is_regression else self.task.labels[p],
                 "label": e.label, "logits": np.asarray(lg, dtype=float).reshape(-1).tolist()}
                for e, p, lg in zip(es.context, preds, logits)]
        return scores, rows

    def write_test(self, out_dir, es, logits):
        preds = self._predict(logits)
        names = preds if self.task.is_regression else [self.task.labels[p] for p in preds]
        i = self.task.test_splits.index(es.name)
        path = out_dir / "glue_submission" / f"{self.task.submission[i]}.tsv"
        glue.write_submission(path, self.task, [e.guid for e in es.context], names)
        return path


class NerRunner(Runner):
    kind = "token"
    main_metric = "f1"

    def __init__(self, data_dir: Path, tok, cfg):
        self.data_dir, self.tok, self.cfg = data_dir, tok, cfg
        self.train = ner.read_conll(_file(data_dir, cfg.train_file, ner.SPLIT_FILES["train"], "train"),
                                  limit=cfg.max_train_examples)
        self.scheme = detect_scheme_or(cfg.ner_scheme, self.train)
        self.label_names = ner.label_set([ner.Sentence(s.words, ner.to_iob2(s.tags, self.scheme), 0) for s in self.train])
        self.num_labels = len(self.label_names)
        self.truncated_words = 0

    def _encode(self, sents: list[ner.Sentence], path: Path) -> list[dict]:
        enc = self.tok([as_running_text(s.words) for s in sents], is_split_into_words=True, truncation=True,
                       max_length=self.cfg.max_seq_length)
        feats = []
        for i, s in enumerate(sents):
            tags = ner.to_iob2(s.tags, self.scheme)
            for t in tags:
                if t not in self.label_names:
                    raise DataError(f"{path}:{s.line}: label {t!r} is not in the label set from the training "
                                    f"file {self.label_names}")
            word_ids = enc.word_ids(i)
            labels, first_token, prev = [], {}, None
            for j, w in enumerate(word_ids):
                if w is None or w == prev:
                    labels.append(IGNORE_INDEX)  # special tokens and continuation pieces are not predicted
                else:
                    labels.append(self.label_names.index(tags[w]))
                    first_token[w] = j
                prev = w if w is not None else prev
            f = {k: enc[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")}
            f["labels"] = labels
            f["_first_token"] = [first_token.get(w) for w in range(len(s.words))]
            feats.append(f)
        return feats

    def train_features(self):
        return self._encode(self.train, self.data_dir)

    def eval_sets(self):
        path = _file(self.data_dir, self.cfg.dev_file, ner.SPLIT_FILES["dev"], "dev")
        sents = ner.read_conll(path, limit=self.cfg.max_eval_examples)
        return [EvalSet("dev", self._encode(sents, path), sents, True)]

    def score(self, es, logits):
        pred_tags, gold_tags, rows = [], [], []
        for f, s, lg in zip(es.features, es.context, logits):
            # words cut off by max_seq_length get "O" (counted in `truncated_words`)
            tags = [self.label_names[int(np.argmax(lg[j]))] if j is not None else "O" for j in f["_first_token"]]
            pred_tags.append(tags)
            gold_tags.append(s.tags)
            rows.append({"words": s.words, "prediction": tags, "gold": s.tags})
        # gold keeps the file's own scheme; predictions are IOB2; spans compare across both
        scores = metrics.entity_f1(pred_tags, [ner.to_iob2(g, self.scheme) for g in gold_tags], "IOB2")
        scores["truncated_words"] = sum(f["_first_token"].count(None) for f in es.features)
        scores["scheme"] = self.scheme
        return scores, rows


def as_running_text(words: list[str]) -> list[str]:
    """Pre-split words as running text tokenizes them: each after the first behind a space. A
    byte-level BPE (ModernBERT's) tokenizes a word that follows a space as its own token ("Ġword");
    without the space every word would look like the start of a text. WordPiece drops the space."""
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def detect_scheme_or(scheme: str, sents: list[ner.Sentence]) -> str:
    return ner.detect_scheme(sents) if scheme == "auto" else scheme


class SquadRunner(Runner):
    kind = "span"
    num_labels = 2
    main_metric = "f1"

    def __init__(self, version_2: bool, data_dir: Path, tok, cfg):
        self.v2, self.data_dir, self.tok, self.cfg = version_2, data_dir, tok, cfg
        v = "v2.0" if version_2 else "v1.1"
        self.names = {"train": (f"train-{v}.json", "train.json"), "dev": (f"dev-{v}.json", "dev.json")}

    def _read(self, split: str, override: str | None, limit: int | None):
        path = _file(self.data_dir, override, self.names[split], split)
        ex, version = squad.read_squad(path)
        if any(e.is_impossible for e in ex) and not self.v2:
            raise DataError(f"{path}: has unanswerable questions (SQuAD v2.0); use the task 'squad2'")
        return ex[:limit] if limit is not None else ex

    def _features(self, ex, train):
        return squad.make_features(ex, self.tok, self.cfg.max_seq_length, self.cfg.doc_stride, self.cfg.max_query_length,
                               train=train)

    def train_features(self):
        feats = self._features(self._read("train", self.cfg.train_file, self.cfg.max_train_examples), True)
        return feats.inputs

    def eval_sets(self):
        ex = self._read("dev", self.cfg.dev_file, self.cfg.max_eval_examples)
        feats = self._features(ex, False)
        return [EvalSet("dev", feats.inputs, (ex, feats), True)]

    def score(self, es, logits):
        ex, feats = es.context
        preds, nbest = squad.decode_predictions(
            ex, feats, [lg[:, 0] for lg in logits], [lg[:, 1] for lg in logits], n_best=self.cfg.n_best,
            max_answer_length=self.cfg.max_answer_length, version_2=self.v2, null_threshold=self.cfg.null_threshold)
        gold = {e.qid: [a[0] for a in e.answers] for e in ex}
        scores = metrics.squad_scores(preds, gold)
        rows = [{"id": e.qid, "prediction": preds[e.qid], "answers": gold[e.qid], "nbest": nbest[e.qid][:5]}
                for e in ex]
        return scores, rows

    def main_rows_to_official(self, rows):  # {qid: answer}, the official predictions.json
        return {r["id"]: r["prediction"] for r in rows}


class SwagRunner(Runner):
    kind = "choice"
    num_labels = 4
    main_metric = "accuracy"

    def __init__(self, data_dir: Path, tok, cfg):
        self.data_dir, self.tok, self.cfg = data_dir, tok, cfg

    def _encode(self, ex: list[swag.ChoiceExample]) -> list[dict]:
        firsts = [e.context for e in ex for _ in range(4)]
        seconds = [f"{e.start} {end}" for e in ex for end in e.endings]
        enc = self.tok(firsts, seconds, truncation=True, max_length=self.cfg.max_seq_length)
        feats = []
        for i, e in enumerate(ex):
            f = {k: [enc[k][4 * i + c] for c in range(4)] for k in ("input_ids", "token_type_ids", "attention_mask")}
            if e.label is not None:
                f["labels"] = e.label
            feats.append(f)
        return feats

    def train_features(self):
        path = _file(self.data_dir, self.cfg.train_file, (swag.SPLIT_FILES["train"],), "train")
        return self._encode(swag.read_swag(path, limit=self.cfg.max_train_examples))

    def eval_sets(self):
        path = _file(self.data_dir, self.cfg.dev_file, (swag.SPLIT_FILES["dev"],), "dev")
        ex = swag.read_swag(path, limit=self.cfg.max_eval_examples)
        return [EvalSet("dev", self._encode(ex), ex, True)]

    def score(self, es, logits):
        preds = [int(np.argmax(x)) for x in logits]
        gold = [e.label for e in es.context]
        return {"accuracy": metrics.accuracy(preds, gold)}, [{"guid": e.guid, "prediction": p, "label": e.label}
                                                         for e, p in zip(es.context, preds)]


def canonical_task(name: str) -> str:
    n = name.lower()
    n = glue.ALIASES.get(n, n)
    n = {"squad1": "squad", "squad-v1.1": "squad", "squad-v2.0": "squad2", "squad_v2": "squad2",
         "conll2003": "ner", "conll": "ner"}.get(n, n)
    if n not in TASKS:
        raise DataError(f"unknown task {name!r}; choose from {list(TASKS)}")
    return n


def make_runner(task: str, data_dir: str | Path, tok, cfg) -> Runner:
    name = canonical_task(task)
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"data directory not found: {d}")
    if name in glue.GLUE_TASKS:
        return GlueRunner(name, d, tok, cfg)
    if name == "ner":
        return NerRunner(d, tok, cfg)
    if name in ("squad", "squad2"):
        return SquadRunner(name == "squad2", d, tok, cfg)
    return SwagRunner(d, tok, cfg)


def dump_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
