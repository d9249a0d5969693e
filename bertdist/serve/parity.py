"""Parity of an exported ONNX model with the PyTorch model it came from, measured at export.

* fp32 (and the optimised fp32): the largest absolute output difference against PyTorch on real
  sentences of varied lengths, batched with padding; refused above ``FP32_TOLERANCE``.
* int8: the task metric on a dev set before (fp32 ONNX) and after, refused when it drops by more
  than the tolerance, in points: hundredths of the metric's full scale (1 point = 0.01 accuracy,
  F1 or Spearman as fractions; 1.0 for metrics kept in percent, such as SQuAD and NER F1).
  An encoder, which has no task metric, is judged by the cosine of its sentence embeddings.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from bertdist.serve.card import ExportError

FP32_TOLERANCE = 1e-4
# Encoders: the int8 sentence embeddings' cosine to fp32's, lowest over the sample.
MIN_EMBEDDING_COSINE = 0.98
PERCENT_METRICS = {"f1", "exact_match", "em"}  # SQuAD and NER report these in percent
SAMPLES = Path(__file__).resolve().parents[2] / "data_pipeline" / "samples" / "books"


class ParityError(ExportError):
    pass


def sample_texts(n: int = 48, samples: Path = SAMPLES) -> list[str]:
    """Real sentences of varied lengths (about 3 to 120 words) from the bundled public-domain books."""
    lines = []
    for f in sorted(samples.glob("*.txt")):
        lines += [ln.strip() for ln in f.read_text(encoding="utf-8").splitlines() if len(ln.split()) >= 3]
    if not lines:
        raise ParityError(f"no sample text under {samples}")
    by_len = sorted(set(lines), key=len)
    picks = [by_len[int(i * (len(by_len) - 1) / max(n - 1, 1))] for i in range(n)]
    # long ones: runs of consecutive lines, so the sample reaches a few hundred tokens
    for k in range(4):
        picks[-1 - k] = " ".join(lines[200 * k:200 * k + 12 + 6 * k])
    return picks


def export_tokenizer(model_dir: str | Path):
    """The tokenizer of an export's directory, returning token types for every family (zeros where
    a model, such as ModernBERT, has none), as the features and the PyTorch wrapper expect them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.model_input_names = ["input_ids", "attention_mask", "token_type_ids"]
    return tok


def encode_sample(tok, task: str, texts: list[str], max_length: int) -> list[dict[str, np.ndarray]]:
    """Batches of 8 padded inputs as numpy int64 (choice: 4 endings per row; span: question + context)."""
    out = []
    for i in range(0, len(texts), 8):
        chunk = texts[i:i + 8]
        if task == "choice":
            firsts = [t for t in chunk for _ in range(4)]
            seconds = [texts[(i + j + c + 1) % len(texts)] for j in range(len(chunk)) for c in range(4)]
            enc = tok(firsts, seconds, truncation=True, max_length=max_length, padding=True, return_tensors="np")
            enc = {k: v.reshape(len(chunk), 4, -1) for k, v in enc.items()}
        elif task in ("span", "regression"):
            seconds = [texts[(i + j + 1) % len(texts)] for j in range(len(chunk))]
            enc = tok(chunk, seconds, truncation=True, max_length=max_length, padding=True, return_tensors="np")
        else:
            enc = tok(chunk, truncation=True, max_length=max_length, padding=True, return_tensors="np")
        out.append({k: np.asarray(enc[k], dtype=np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")})
    return out


def run_torch(model, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(*(torch.from_numpy(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def graph_feed(session, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` without the inputs the session's graph does not take (a ModernBERT graph takes no
    token_type_ids; the examples and the PyTorch model carry them for every family)."""
    names = {i.name for i in session.get_inputs()}
    return {k: v for k, v in batch.items() if k in names}


def run_onnx(session, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
    return session.run(None, graph_feed(session, batch))


@dataclasses.dataclass
class OutputDiff:
    max_abs_diff: float
    texts: int
    tokens_min: int
    tokens_max: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def output_diff(model, session, batches: list[dict[str, np.ndarray]]) -> OutputDiff:
    worst = 0.0
    lengths = []
    for b in batches:
        mask = b["attention_mask"]
        lengths += mask.reshape(-1, mask.shape[-1]).sum(-1).tolist()
        for ref, got in zip(run_torch(model, b), run_onnx(session, b)):
            if ref.shape != got.shape:
                raise ParityError(f"output shape {got.shape} from ONNX, {ref.shape} from PyTorch")
            if ref.ndim >= 3 or (ref.ndim == 2 and ref.shape[-1] == mask.shape[-1] and mask.ndim == 2):
                keep = mask.astype(bool) if ref.ndim == 2 else mask.astype(bool)[..., None]
                diff = np.abs(ref - got) * keep  # padded positions are not outputs anyone reads
            else:
                diff = np.abs(ref - got)
            worst = max(worst, float(diff.max()))
    return OutputDiff(worst, len(lengths), int(min(lengths)), int(max(lengths)))


def check_fp32(name: str, diff: OutputDiff, tolerance: float = FP32_TOLERANCE) -> None:
    if not diff.max_abs_diff <= tolerance:
        raise ParityError(f"{name}: max |ONNX - PyTorch| = {diff.max_abs_diff:.3e} over {diff.texts} texts "
                          f"({diff.tokens_min}-{diff.tokens_max} tokens), above the tolerance {tolerance:.0e}")


def embedding_cosines(fp32, int8, batches) -> dict:
    cos = []
    for b in batches:
        a, q = run_onnx(fp32, b)[1], run_onnx(int8, b)[1]
        cos += (np.sum(a * q, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(q, axis=-1))).tolist()
    return {"metric": "embedding_cosine_min", "min_cosine": float(min(cos)), "mean_cosine": float(np.mean(cos)),
            "texts": len(cos), "minimum": MIN_EMBEDDING_COSINE}


# ---------------------------------------------------------------- the task metric on a dev set
def points(metric: str, value: float) -> float:
    """A metric value in points (hundredths of its full scale)."""
    return float(value) if metric in PERCENT_METRICS else 100.0 * float(value)


def dev_runner(task_name: str, dev: str | Path, model_dir: Path, max_length: int, max_examples: int | None,
               max_train_examples: int | None = None):
    """The fine-tuning runner for ``task_name`` over ``dev`` (the task's data directory or its dev file);
    its train features, when the directory has them, are the first ``max_train_examples``."""
    from bertdist.finetune.config import FinetuneConfig
    from bertdist.finetune.tasks import make_runner

    d = Path(dev)
    if not d.exists():
        raise ExportError(f"--dev {d}: no such file or directory")
    data_dir, dev_file = (d, None) if d.is_dir() else (d.parent, str(d))
    cfg = FinetuneConfig(task=task_name, data=str(data_dir), dev_file=dev_file, max_seq_length=max_length,
                         max_eval_examples=max_examples, max_train_examples=max_train_examples)
    if task_name in ("ner",):  # the NER runner reads the train file for its label set and scheme
        cfg.train_file = dev_file
    tok = export_tokenizer(model_dir)
    return make_runner(task_name, data_dir, tok, cfg)


def onnx_logits(session, features: list[dict], batch_size: int = 64) -> list[np.ndarray]:
    """As bertdist.finetune.train.predict, with an ONNX session: logits per feature."""
    from bertdist.finetune.train import batches

    names = [i.name for i in session.get_inputs()]
    out = []
    for idx, batch in batches(features, batch_size):
        feeds = {k: batch[k].numpy() for k in names}
        res = session.run(None, feeds)
        logits = np.stack(res, -1) if len(res) == 2 else res[0]  # span: [B, S, 2] as the fine-tuning heads
        for row, j in enumerate(idx):
            n = len(features[j]["input_ids"])
            out.append(logits[row, :n] if logits.ndim == 3 else logits[row])
    return out


def task_metric(runner, session) -> tuple[str, float]:
    es = runner.eval_sets()[0]
    scores, _ = runner.score(es, onnx_logits(session, es.features))
    return runner.main_metric, float(scores[runner.main_metric])


def judge_int8(metric: str, before: float, after: float, tolerance_points: float, examples: int) -> dict:
    drop = points(metric, before) - points(metric, after)
    return {"metric": metric, "fp32": before, "int8": after, "drop_points": round(drop, 4),
            "tolerance_points": tolerance_points, "examples": examples, "within_tolerance": drop <= tolerance_points}
