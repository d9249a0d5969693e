"""Small task files in their real formats, for the tasks that ../shared/data does not have
(MNLI, QNLI, QQP, WNLI, SWAG, SQuAD v2.0). Content is templated; the layouts are the released ones."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

SUBJECTS = ["the man", "a woman", "the dog", "two children", "the chef", "a pilot", "the old farmer", "a student"]
VERBS = ["is cooking dinner", "is reading a book", "runs across the field", "plays the guitar", "is sleeping",
         "drives a red car", "paints the fence", "writes a letter"]
NEG = {"is cooking dinner": "is not cooking", "is reading a book": "has never read a book",
       "runs across the field": "sits still indoors", "plays the guitar": "cannot play any instrument",
       "is sleeping": "is wide awake", "drives a red car": "walks everywhere", "paints the fence": "ignores the fence",
       "writes a letter": "is not writing"}


def _pair(rng: random.Random, label: str) -> tuple[str, str]:
    s, v = rng.choice(SUBJECTS), rng.choice(VERBS)
    premise = f"{s.capitalize()} {v} in the afternoon."
    if label == "entailment":
        return premise, f"{s.capitalize()} {v}."
    if label == "contradiction":
        return premise, f"{s.capitalize()} {NEG[v]}."
    return premise, f"{s.capitalize()} {v} because it is raining."


def _tsv(path: Path, header: list[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


def write_mnli(d: Path, n_train: int = 48, n_dev: int = 12) -> Path:
    rng = random.Random(0)
    labels = ["entailment", "neutral", "contradiction"]
    head = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
            "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
    def rows(n, extra_labels):
        out = []
        for i in range(n):
            lab = labels[i % 3]
            a, b = _pair(rng, lab)
            out.append([i, 1000 + i, f"{1000 + i}e", "fiction", "( x )", "( y )", "(ROOT x)", "(ROOT y)", a, b]
                       + [lab] * extra_labels)
        return out
    _tsv(d / "train.tsv", head + ["label1", "gold_label"], rows(n_train, 2))
    dev_head = head + ["label1", "label2", "label3", "label4", "label5", "gold_label"]
    _tsv(d / "dev_matched.tsv", dev_head, rows(n_dev, 6))
    _tsv(d / "dev_mismatched.tsv", dev_head, rows(n_dev, 6))
    _tsv(d / "test_matched.tsv", head, rows(n_dev, 0))
    _tsv(d / "test_mismatched.tsv", head, rows(n_dev, 0))
    return d


def write_pair_task(d: Path, kind: str, n_train: int = 40, n_dev: int = 12) -> Path:
    """QNLI, QQP or WNLI in their GLUE layouts."""
    rng = random.Random(1)
    def rows(n, with_label, start=0):
        out = []
        for i in range(start, start + n):
            yes = i % 2 == 0
            a, b = _pair(rng, "entailment" if yes else "contradiction")
            if kind == "qnli":
                out.append([i, f"What does {a[:-1].lower()}?", b] + (["entailment" if yes else "not_entailment"] if with_label else []))
            elif kind == "qqp":
                q = f"Why {a[:-1].lower()}?"
                out.append([i] + ([2 * i, 2 * i + 1] if with_label else []) + [q, q if yes else f"Who {b[:-1].lower()}?"]
                           + ([int(yes)] if with_label else []))
            else:  # wnli
                out.append([i, a, b] + ([int(yes)] if with_label else []))
        return out
    if kind == "qnli":
        h = ["index", "question", "sentence"]
        _tsv(d / "train.tsv", h + ["label"], rows(n_train, True))
        _tsv(d / "dev.tsv", h + ["label"], rows(n_dev, True, 500))
        _tsv(d / "test.tsv", h, rows(n_dev, False, 900))
    elif kind == "qqp":
        _tsv(d / "train.tsv", ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], rows(n_train, True))
        _tsv(d / "dev.tsv", ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], rows(n_dev, True, 500))
        _tsv(d / "test.tsv", ["id", "question1", "question2"], rows(n_dev, False, 900))
    else:
        h = ["index", "sentence1", "sentence2"]
        _tsv(d / "train.tsv", h + ["label"], rows(n_train, True))
        _tsv(d / "dev.tsv", h + ["label"], rows(n_dev, True, 500))
        _tsv(d / "test.tsv", h, rows(n_dev, False, 900))
    return d


def write_swag(d: Path, n_train: int = 24, n_dev: int = 8) -> Path:
    rng = random.Random(2)
    header = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
              "ending0", "ending1", "ending2", "ending3", "label"]
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.csv", n_train), ("val.csv", n_dev), ("test.csv", n_dev)):
        with (d / name).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header if name != "test.csv" else header[:-1])
            for i in range(n):
                s, v = rng.choice(SUBJECTS), rng.choice(VERBS)
                endings = [f"{v} happily.", "flies to the moon.", "turns into a teapot.", "dissolves in the rain."]
                label = i % 4
                endings[0], endings[label] = endings[label], endings[0]
                sent1 = f"{s.capitalize()} walks into the room."
                row = [i, f"lsmdc{i:04d}", i, f"{sent1} {s.capitalize()}", sent1, s.capitalize(), "gold", *endings]
                w.writerow(row + ([label] if name != "test.csv" else []))
    return d


def write_squad_v2(path: Path, n_paragraphs: int = 6) -> Path:
    rng = random.Random(3)
    paragraphs = []
    for p in range(n_paragraphs):
        s, v = rng.choice(SUBJECTS), rng.choice(VERBS)
        year = 1900 + rng.randrange(100)
        ctx = (f"In {year}, {s} from the village {v} near the river. Many visitors came to see it, "
               f"and the local paper wrote about the event for weeks.")
        qas = [
            {"id": f"p{p}q0", "question": "In which year did it happen?", "is_impossible": False,
             "answers": [{"text": str(year), "answer_start": ctx.index(str(year))}]},
            {"id": f"p{p}q1", "question": "Who wrote a book about the mountain?", "is_impossible": True,
             "answers": [], "plausible_answers": [{"text": "the local paper", "answer_start": ctx.index("the local paper")}]},
        ]
        paragraphs.append({"context": ctx, "qas": qas})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "Fixture", "paragraphs": paragraphs}]}))
    return path


def squad_slice(src: Path, dst: Path, articles: slice, max_paragraphs: int = 3) -> Path:
    """A few real articles of SQuAD dev as a file of its own (a temp file; never committed)."""
    data = json.loads(src.read_text())
    arts = []
    for a in data["data"][articles]:
        arts.append({"title": a["title"], "paragraphs": a["paragraphs"][:max_paragraphs]})
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps({"version": data["version"], "data": arts}))
    return dst


def tiny_hf_checkpoint(out: Path, vocab: Path, **config) -> Path:
    """A randomly initialised (seed 0) tiny BERT written as a Hugging Face directory at ``out``;
    ``config`` overrides preset fields (e.g. dropout)."""
    import torch

    from bertdist.export import write_hf_dir
    from bertdist.model import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    cfg = BertConfig.from_preset("tiny", kernels="reference", **config)
    write_hf_dir(out, cfg, BertForPreTraining(cfg, device_type="cpu").state_dict(), vocab)
    return out

