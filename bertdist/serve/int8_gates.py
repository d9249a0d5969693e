"""What an int8 model must keep, and the inputs it is calibrated and timed on.

A gate measures the int8 session against the fp32 one on a dev set:

* a fine-tuning task (``--task sst2``, ``ner``, ``squad``...): the task's main metric, refused when
  it drops by more than the tolerance in points (bertdist.serve.parity);
* ``--task sts`` on an encoder: the STS Spearman of its sentence embeddings' cosines (STS-B's
  dev.tsv or scored-pair JSONL); ``--task embed``: retrieval nDCG@10 of the dev queries over the
  dev corpus; ``--task rerank`` on a one-score model: re-ranking nDCG@10 (bertdist.embed.evaluate);
* an encoder without a dev set: the cosine of its int8 sentence embeddings to fp32's, at least
  ``parity.MIN_EMBEDDING_COSINE`` on every sample sentence.

Examples are single inputs as numpy arrays without a batch axis (``[S]``, or ``[C, S]`` for
multiple choice); ``batch_feeds`` pads and stacks them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np

from bertdist.serve.card import ExportError

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EMBED_TASKS = ("sts", "embed", "rerank")
EMBED_METRICS = {"sts": "spearman", "embed": "ndcg@10", "rerank": "ndcg@10"}


# ---------------------------------------------------------------- examples and batches
def batch_feeds(examples: list[dict[str, np.ndarray]], size: int) -> list[dict[str, np.ndarray]]:
    """Batches of ``size`` examples, each padded (id 0, mask 0) to its longest."""
    out = []
    for i in range(0, len(examples), size):
        chunk = examples[i:i + size]
        width = max(e["input_ids"].shape[-1] for e in chunk)
        feed = {}
        for k in INPUTS:
            pad = [np.pad(e[k], [(0, 0)] * (e[k].ndim - 1) + [(0, width - e[k].shape[-1])]) for e in chunk]
            feed[k] = np.stack(pad).astype(np.int64)
        out.append(feed)
    return out


def feature_examples(features: list[dict]) -> list[dict[str, np.ndarray]]:
    """A fine-tuning runner's features as examples."""
    return [{k: np.asarray(f[k], dtype=np.int64) for k in INPUTS} for f in features]


def text_examples(tok, texts: list, max_length: int) -> list[dict[str, np.ndarray]]:
    """Texts (or ``(first, second)`` pairs) tokenised one by one."""
    out = []
    for t in texts:
        enc = tok(*t, truncation=True, max_length=max_length) if isinstance(t, tuple) else \
            tok(t, truncation=True, max_length=max_length)
        out.append({k: np.asarray(enc[k], dtype=np.int64) for k in INPUTS})
    return out


# ---------------------------------------------------------------- gates
@dataclasses.dataclass
class Gate:
    """``measure(session)`` -> the metric; ``judge`` -> the verdict dict the card records."""

    name: str  # what the log and the errors call it: "sst2 dev accuracy"
    metric: str
    fp32: float
    measure: Callable
    judge: Callable[[float], dict]
    examples: int


def drop_gate(name: str, metric: str, fp32: float, measure, tolerance_points: float, examples: int) -> Gate:
    from bertdist.serve import parity

    return Gate(name, metric, fp32, measure,
                lambda v: parity.judge_int8(metric, fp32, v, tolerance_points, examples), examples)


def cosine_gate(fp32_session, sample) -> Gate:
    """An encoder without a dev set: the lowest cosine of int8 to fp32 sentence embeddings."""
    from bertdist.serve import parity

    def judge(v: float) -> dict:
        return {"metric": "embedding_cosine_min", "fp32": 1.0, "int8": v, "min_cosine": v,
                "minimum": parity.MIN_EMBEDDING_COSINE, "examples": sum(len(b["input_ids"]) for b in sample),
                "within_tolerance": v >= parity.MIN_EMBEDDING_COSINE}

    return Gate("sentence-embedding cosine to fp32 (lowest)", "embedding_cosine_min", 1.0,
                lambda s: parity.embedding_cosines(fp32_session, s, sample)["min_cosine"], judge,
                sum(len(b["input_ids"]) for b in sample))


class OnnxEncoder:
    """bertdist.embed.evaluate's bi-encoder (``encode``) and cross-encoder (``score``) over a session."""

    def __init__(self, session, tok, max_length: int):
        self.session, self.tok, self.max_length = session, tok, max_length

    def _run(self, texts: list, batch_size: int, output: int) -> np.ndarray:
        from bertdist.serve.parity import run_onnx

        examples = text_examples(self.tok, texts, self.max_length)
        return np.concatenate([run_onnx(self.session, f)[output] for f in batch_feeds(examples, batch_size)])

    def encode(self, texts, batch_size=64, max_seq_length=None) -> np.ndarray:
        return self._run(list(texts), batch_size, 1)

    def score(self, pairs, batch_size=64, max_seq_length=None) -> np.ndarray:
        return self._run([tuple(p) for p in pairs], batch_size, 0).reshape(-1)


@dataclasses.dataclass
class Int8Inputs:
    """The gate (None: unchecked), the examples to calibrate and measure sensitivity on, and those to
    time on (a task's dev examples: the texts it serves, where training rows may be phrases)."""

    gate: Gate | None
    calibration: list[dict[str, np.ndarray]]
    timing: list[dict[str, np.ndarray]] | None = None

    @property
    def timed(self) -> list[dict[str, np.ndarray]]:
        return self.timing or self.calibration


def check_task(task: str | None, src_task: str) -> None:
    """Refuse at once a bi- or cross-encoder metric asked of the other kind of model."""
    if task not in EMBED_TASKS:
        return
    want = "regression" if task == "rerank" else "encoder"
    if src_task != want:
        raise ExportError(f"--task {task} measures a{'' if want == 'regression' else 'n'} {want} model "
                          f"({'a cross-encoder' if want == 'regression' else 'a bi-encoder'}); this one is {src_task}")


def embed_rows(task: str, dev: str | Path) -> list:
    from bertdist.embed.data import read_task_file

    d = Path(dev)
    if d.is_dir():
        names = ("dev.tsv",) if task == "sts" else ("dev.jsonl", "dev.tsv")
        found = [d / n for n in names if (d / n).is_file()]
        if not found:
            raise ExportError(f"--dev {d}: no {' or '.join(names)} for --task {task}")
        d = found[0]
    if not d.is_file():
        raise ExportError(f"--dev {d}: no such file or directory")
    return read_task_file(task, d)


def embed_inputs(task: str, dev: str | Path, tok, max_length: int, fp32_session,
                 tolerance_points: float, max_examples: int | None, calibration: int) -> Int8Inputs:
    """STS Spearman, retrieval or re-ranking nDCG@10 on the dev rows; calibration on their texts."""
    from bertdist.embed import evaluate

    rows = embed_rows(task, dev)[:max_examples or None]
    if task == "sts":
        texts: list = [t for r in rows for t in (r.text_a, r.text_b)]
        measure = lambda s: evaluate.sts_eval(OnnxEncoder(s, tok, max_length), rows)["spearman"]  # noqa: E731
    elif task == "embed":
        rdev = evaluate.build_retrieval_dev(rows)
        texts = rdev.queries + rdev.corpus
        measure = lambda s: evaluate.retrieval_eval(OnnxEncoder(s, tok, max_length), rdev)["ndcg@10"]  # noqa: E731
    else:
        kdev = evaluate.build_rerank_dev(rows)
        texts = [(q, c) for q, cands in zip(kdev.queries, kdev.candidates) for c in cands]
        measure = lambda s: evaluate.rerank_eval(OnnxEncoder(s, tok, max_length), kdev)["ndcg@10"]  # noqa: E731
    metric = EMBED_METRICS[task]
    examples = text_examples(tok, texts[:calibration], max_length)
    gate = drop_gate(f"{task} dev {metric}", metric, measure(fp32_session), measure, tolerance_points, len(rows))
    return Int8Inputs(gate, examples)


def int8_inputs(src_task: str, opts, stage: Path, fp32_session, sample, max_length: int) -> Int8Inputs:
    """The gate and calibration examples for an export's options (see the module docstring)."""
    from bertdist.serve import parity

    tok = parity.export_tokenizer(stage)
    n_cal = opts.calibration
    if opts.task in EMBED_TASKS and opts.dev and not opts.skip_metric_check:
        return embed_inputs(opts.task, opts.dev, tok, max_length, fp32_session, opts.tolerance_points,
                            opts.max_eval_examples, n_cal)
    if src_task == "encoder" or opts.skip_metric_check or not (opts.task and opts.dev):
        examples = text_examples(tok, parity.sample_texts(), max_length)
        examples = (examples * (n_cal // len(examples) + 1))[:n_cal]
        gate = None if opts.skip_metric_check or src_task != "encoder" else cosine_gate(fp32_session, sample)
        return Int8Inputs(gate, examples)
    runner = parity.dev_runner(opts.task, opts.dev, stage, max_length, opts.max_eval_examples,
                               max_train_examples=n_cal)
    es = runner.eval_sets()[0]
    metric, before = parity.task_metric(runner, fp32_session)
    gate = drop_gate(f"{opts.task} dev {metric}", metric, before, lambda s: parity.task_metric(runner, s)[1],
                     opts.tolerance_points, len(es.features))
    return Int8Inputs(gate, feature_examples(calibration_features(runner, es, n_cal)), feature_examples(es.features))


def calibration_features(runner, es, n: int) -> list[dict]:
    """The first ``n`` training features when the task's data directory has its train file, else dev's."""
    from bertdist.finetune.errors import DataError

    try:
        train = runner.train_features()
    except (DataError, FileNotFoundError, OSError):
        train = []
    return (train or es.features)[:n]
