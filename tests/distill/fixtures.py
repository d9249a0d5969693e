"""Tiny teachers and task files for the distillation tests, made here (no ../shared needed).

A small word-level vocabulary, templated task files in the real layouts (SST-2, RTE, STS-B, CoNLL,
SQuAD v1.1), and ``teacher(...)``: a tiny BERT fine-tuned for a few steps by ``bertdist finetune``
with ``save_model`` (a real task-model directory)."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

POS = ["good", "great", "lovely", "fine", "happy", "superb"]
NEG = ["bad", "awful", "poor", "sad", "dull", "terrible"]
NOUNS = ["film", "movie", "story", "actor", "plot", "music", "city", "river", "paris", "john", "smith", "london"]
FILL = ["the", "a", "was", "is", "very", "and", "in", "of", "it", "who", "what", "where", "did", "go", "to",
        "lives", "met", "year", "when", "happen", "visited"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(path: Path, extra: list[str] = ()) -> Path:
    words = SPECIAL + sorted(set(POS + NEG + NOUNS + FILL + list(extra))) + list(".,?!") + [str(d) for d in range(10)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(words) + "\n")
    return path


def _sentence(rng: random.Random, positive: bool) -> str:
    adj = rng.choice(POS if positive else NEG)
    return f"the {rng.choice(NOUNS)} was very {adj} and {rng.choice(FILL)} {rng.choice(NOUNS)} ."


def _tsv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, escapechar="\\", lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
    return path


def write_sst2(d: Path, n_train: int = 32, n_dev: int = 16) -> Path:
    rng = random.Random(0)
    _tsv(d / "train.tsv", ["sentence", "label"], [[_sentence(rng, i % 2 == 0), int(i % 2 == 0)] for i in range(n_train)])
    _tsv(d / "dev.tsv", ["sentence", "label"], [[_sentence(rng, i % 2 == 0), int(i % 2 == 0)] for i in range(n_dev)])
    return d


def write_unlabeled_text(path: Path, n: int = 64, seed: int = 1) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(_sentence(rng, rng.random() < 0.5) for _ in range(n)) + "\n")
    return path


def write_rte(d: Path, n_train: int = 32, n_dev: int = 12) -> Path:
    rng = random.Random(2)

    def rows(n, start):
        out = []
        for i in range(start, start + n):
            a = _sentence(rng, True)
            yes = i % 2 == 0
            out.append([i, a, a if yes else _sentence(rng, False), "entailment" if yes else "not_entailment"])
        return out
    _tsv(d / "train.tsv", ["index", "sentence1", "sentence2", "label"], rows(n_train, 0))
    _tsv(d / "dev.tsv", ["index", "sentence1", "sentence2", "label"], rows(n_dev, 100))
    return d


def write_stsb(d: Path, n_train: int = 32, n_dev: int = 12) -> Path:
    rng = random.Random(3)
    head = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]

    def rows(n, start):
        out = []
        for i in range(start, start + n):
            a, b = _sentence(rng, True), _sentence(rng, i % 3 == 0)
            out.append([i, "main-captions", "x", "2012", i, "none", "none", a, b, f"{(i % 6) * 1.0:.3f}"])
        return out
    _tsv(d / "train.tsv", head, rows(n_train, 0))
    _tsv(d / "dev.tsv", head, rows(n_dev, 100))
    return d


def _conll_sentences(rng: random.Random, n: int) -> list[list[tuple[str, str]]]:
    out = []
    for _ in range(n):
        out.append([("john", "B-PER"), ("smith", "I-PER"), ("visited", "O"), (rng.choice(["paris", "london"]), "B-LOC"),
                    (rng.choice(["in", "and"]), "O"), ("it", "O"), (".", "O")])
    return out


def write_conll(d: Path, n_train: int = 24, n_dev: int = 8) -> Path:
    rng = random.Random(4)
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.txt", n_train), ("valid.txt", n_dev)):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for s in _conll_sentences(rng, n):
            lines += [f"{w} NN O {t}" for w, t in s] + [""]
        (d / name).write_text("\n".join(lines) + "\n")
    return d


def write_conll_unlabeled(path: Path, n: int = 30) -> Path:
    """Words only, one per line, blank line between sentences (the tag column absent)."""
    rng = random.Random(5)
    lines = []
    for s in _conll_sentences(rng, n):
        lines += [w for w, _ in s] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path


def _squad_paragraphs(rng: random.Random, n: int, answers: bool) -> list[dict]:
    paragraphs = []
    for p in range(n):
        year = str(1900 + rng.randrange(100))
        city = rng.choice(["paris", "london"])
        ctx = f"john smith visited {city} in {year} and it was very good ."
        qas = [{"id": f"q{p}a", "question": "when did john visit ?"},
               {"id": f"q{p}b", "question": "where did john go ?"}]
        if answers:
            qas[0]["answers"] = [{"text": year, "answer_start": ctx.index(year)}]
            qas[1]["answers"] = [{"text": city, "answer_start": ctx.index(city)}]
        paragraphs.append({"context": ctx, "qas": qas})
    return paragraphs


def write_squad(d: Path, n_train: int = 8, n_dev: int = 4) -> Path:
    rng = random.Random(6)
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train-v1.1.json", n_train), ("dev-v1.1.json", n_dev)):
        (d / name).write_text(json.dumps({"version": "1.1", "data": [
            {"title": "t", "paragraphs": _squad_paragraphs(rng, n, True)}]}))
    return d


def write_squad_unlabeled(path: Path, n: int = 10) -> Path:
    rng = random.Random(7)
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "u", "paragraphs": _squad_paragraphs(rng, n, False)}]}))
    return path


def tiny_base(out: Path, vocab: Path, seed: int = 0, **config) -> Path:
    """A randomly initialised tiny BERT (2 layers, hidden 128) as a Hugging Face directory."""
    import torch

    from bertdist.export import write_hf_dir
    from bertdist.model import BertConfig, BertForPreTraining

    n = len(vocab.read_text().splitlines())
    torch.manual_seed(seed)
    cfg = BertConfig.from_preset("tiny", kernels="reference", vocab_size=n, max_position_embeddings=128, **config)
    write_hf_dir(out, cfg, BertForPreTraining(cfg, device_type="cpu").state_dict(), vocab)
    return out


def teacher(tmp: Path, task: str, data: Path, vocab: Path, steps: int = 12, seed: int = 0, **config) -> Path:
    """A tiny task model fine-tuned by `finetune` with save_model (its `model/` directory)."""
    from bertdist.finetune import FinetuneConfig, run_finetune

    base = tiny_base(tmp / f"base_{task}_{seed}", vocab, seed=seed, **config)
    cfg = FinetuneConfig(task=task, checkpoint=str(base), data=str(data), output_dir=str(tmp / f"teacher_{task}_{seed}"),
                         max_seq_length=48, batch_size=8, max_steps=steps, learning_rate=1e-3, progress=False,
                         kernels="reference", save_model=True, predict_test=False, tensorboard=False, seed=seed,
                         doc_stride=16, max_query_length=16)
    run_finetune(cfg)
    return tmp / f"teacher_{task}_{seed}" / "model"


def distill_config(task: str, teacher_dir: Path, data: Path, unlabeled: list[Path], out: Path, **kw):
    from bertdist.distill.config import DistillConfig
    from bertdist.finetune.config import FinetuneConfig

    train = FinetuneConfig(max_seq_length=48, batch_size=8, max_steps=kw.pop("steps", 6), learning_rate=1e-3,
                           progress=False, kernels="reference", predict_test=False, tensorboard=False,
                           doc_stride=16, max_query_length=16)
    return DistillConfig(task=task, teacher=str(teacher_dir), data=str(data), unlabeled=[str(u) for u in unlabeled],
                         output_dir=str(out), shard_rows=kw.pop("shard_rows", 16), bench_repeats=1,
                         bench_seq_length=32, train=train, **kw)
