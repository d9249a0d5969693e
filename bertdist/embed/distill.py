"""Retrieval distillation: a bi-encoder student learns from a teacher's scores or embeddings.

Two teachers, chosen by what ``distill_from`` is:

* a cross-encoder directory -> **margin-MSE** (Hofstätter et al., 2020). For each training triple
  (query, positive, negative), with the student's score ``s(q, d) = scale * cos(q, d)`` (the same
  scaled cosine MNRL uses) and the teacher's logit ``t``:
  ``loss = mean((s(q, p) - s(q, n) - (t(q, p) - t(q, n)))^2)``. Only margins are matched, so the
  student's and the teacher's scores need not share a scale or an offset. The triples are the
  train rows' hard negatives (listed, mined or from a mined set): up to ``num_negatives`` per row,
  one triple each.
* a bi-encoder (a sentence-transformers directory or any encoder checkpoint) -> **embedding MSE**
  (Reimers and Gurevych, 2020): ``mean((P(student(x)) - teacher(x))^2)`` over the train rows'
  queries and positives, ``P`` a learned linear projection when the widths differ (kept in the
  model and exported as a sentence-transformers Dense module, so the served student embeds into
  the teacher's space); the student's output is normalised when the teacher's is.

The teacher runs once. Its outputs are a one-file stored set (``bertdist.stored_set``):
``plan.json`` written first pins what the directory holds (the teacher's ``model_sha256``, its
tokenizer, the train file's sha256 and a sha256 over the exact texts scored); ``manifest.json``
written last marks it complete. A later run reuses a complete set with the same identity (a copy
of the teacher or train file elsewhere is the same), recomputes an unfinished one with the same
plan, and refuses a set of another teacher or other data, naming every difference.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from bertdist.embed.config import EmbedConfig, resolved_negatives
from bertdist.embed.data import TrainData
from bertdist.embed.model import BiEncoder, load_bi_encoder, load_cross_encoder
from bertdist.finetune.errors import DataError
from bertdist.stored_set import SetMismatch, model_sha256, open_or_make as open_or_make_set, source_entry

FORMAT = "bertdist-teacher-scores/1"
ROWS_FILE = "teacher.parquet"
KINDS = {"margin_mse": "cross-encoder", "embedding_mse": "bi-encoder"}


class TeacherSetMismatch(SetMismatch):
    """A stored teacher set made by another teacher or from other data than the run's."""


# ---------------------------------------------------------------- the teacher
def teacher_kind(path: str | Path) -> str:
    """``cross-encoder`` or ``bi-encoder``, by the directory's layout."""
    from bertdist.embed.model import is_cross_encoder_dir

    p = Path(path)
    if not p.exists():
        raise DataError(f"distill_from: the teacher {p} does not exist")
    return "cross-encoder" if is_cross_encoder_dir(p) else "bi-encoder"


def resolve_distill_loss(requested: str, path: str | Path) -> str:
    kind = teacher_kind(path)
    loss = {"cross-encoder": "margin_mse", "bi-encoder": "embedding_mse"}[kind] if requested == "auto" else requested
    if KINDS[loss] != kind:
        raise DataError(f"distill_loss={loss} needs a {KINDS[loss]} teacher, but {path} is a {kind} "
                        f"(config.json's architectures / modules.json); use distill_loss=auto")
    return loss


def teacher_identity(model, path: str | Path) -> dict:
    from bertdist.export.tokenizer import tokenizer_sha256

    ident = {"path": str(path), "sha256": model_sha256(path),
             "vocab_sha256": tokenizer_sha256(model.vocab_file, model.tokenizer_files), "do_lower_case": model.do_lower_case,
             "max_seq_length": model.max_seq_length}
    if hasattr(model, "pooling"):
        ident.update(pooling=model.pooling, normalize=model.normalize, dim=model.dim)
    return ident


def texts_sha256(items: Sequence[Sequence[str]]) -> str:
    """A fingerprint of exactly which texts, in which order and grouping, the teacher scored."""
    h = hashlib.sha256()
    for item in items:
        h.update(json.dumps(list(item), ensure_ascii=False).encode("utf-8") + b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------- the stored set
def make_plan(kind: str, teacher: dict, sources: dict[str, str | Path], content: Sequence[Sequence[str]],
              extra: dict | None = None) -> dict:
    recorded = [source_entry(p, role=role) for role, p in sources.items()]
    return {"format": FORMAT, "kind": kind, "teacher": teacher, "sources": recorded,
            "content_sha256": texts_sha256(content), "rows": len(content), **(extra or {})}


def open_or_make(set_dir: str | Path, plan: dict, compute: Callable[[], dict], rank: int = 0,
                 barrier: Callable[[], None] | None = None) -> tuple[dict, dict]:
    """The teacher set's columns and manifest (``bertdist.stored_set.open_or_make``): reused when
    ``set_dir`` holds a complete set of this plan, else computed by ``compute()`` on rank 0."""
    return open_or_make_set(set_dir, plan, ROWS_FILE, compute, mismatch=TeacherSetMismatch, what="teacher set",
                            advice=f"Use another distill_set directory or remove {set_dir}.", rank=rank,
                            barrier=barrier)


# ---------------------------------------------------------------- teacher outputs
def margin_scores(teacher, triples: Sequence[tuple[str, str, str]], batch_size: int = 64) -> dict:
    """The teacher's logits of each triple's (query, positive) and (query, negative), each
    distinct pair scored once."""
    pairs = list(dict.fromkeys([(q, p) for q, p, _ in triples] + [(q, n) for q, _, n in triples]))
    scores = teacher.score(pairs, batch_size)
    by_pair = dict(zip(pairs, scores.tolist()))
    return {"query": [t[0] for t in triples], "positive": [t[1] for t in triples], "negative": [t[2] for t in triples],
            "teacher_positive": np.array([by_pair[(q, p)] for q, p, _ in triples], dtype=np.float32),
            "teacher_negative": np.array([by_pair[(q, n)] for q, _, n in triples], dtype=np.float32)}


def teacher_embeddings(teacher, texts: Sequence[str], batch_size: int = 64) -> dict:
    import pyarrow as pa

    emb = teacher.encode(list(texts), batch_size)
    return {"text": list(texts), "embedding": pa.array(list(emb), type=pa.list_(pa.float32()))}


# ---------------------------------------------------------------- losses
def margin_mse(q: torch.Tensor, p: torch.Tensor, n: torch.Tensor, teacher_margin: torch.Tensor,
               scale: float) -> torch.Tensor:
    """``mean((scale * (cos(q, p) - cos(q, n)) - teacher_margin)^2)``."""
    from bertdist.embed.losses import cosine_pairs

    student = scale * (cosine_pairs(q, p) - cosine_pairs(q, n))
    return F.mse_loss(student, teacher_margin.to(student.device, student.dtype))


def embedding_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    if student.shape != teacher.shape:
        raise ValueError(f"student embeddings {tuple(student.shape)} and teacher embeddings {tuple(teacher.shape)} "
                         "differ in shape; the projection must map the student to the teacher's width")
    return F.mse_loss(student.float(), teacher.to(student.device, torch.float32))


# ---------------------------------------------------------------- a run's set-up
def prepare_distillation(cfg: EmbedConfig, model: BiEncoder, units: list[dict], data: TrainData, out: Path,
                         rank: int, barrier, device) -> tuple[list[dict], dict, dict]:
    """The teacher's stored outputs for this run's units (computed once), and the units to train
    on: triples for margin-MSE, rows for embedding MSE. Returns (units, what the step loss needs,
    what the run's summary records)."""
    loss = resolve_distill_loss(cfg.distill_loss, cfg.distill_from)
    set_dir = Path(cfg.distill_set) if cfg.distill_set else out / "teacher_scores"
    if loss == "margin_mse":
        return _margin_units(cfg, units, data, set_dir, rank, barrier, device)
    return _embedding_units(cfg, model, units, data, set_dir, rank, barrier, device)


def _margin_units(cfg: EmbedConfig, units: list[dict], data: TrainData, set_dir: Path, rank: int, barrier,
                  device) -> tuple[list[dict], dict, dict]:
    """One unit per (query, positive, negative) triple, with the cross-encoder teacher's margin."""
    loss = "margin_mse"
    triples = [(u["q"], u["p"], n) for u in units for n in u["negs"][:resolved_negatives(cfg)]]
    if not triples:
        raise DataError(f"{data.train_path}: margin-MSE distillation needs (query, positive, negative) "
                        f"triples, but none of the {len(units)} rows has a negative; list negatives in the rows, "
                        "set mine=bm25 or hard_negatives=DIR")
    teacher = load_cross_encoder(cfg.distill_from, kernels=cfg.kernels, device=device)
    plan = make_plan(loss, teacher_identity(teacher, cfg.distill_from), {"train": data.train_path}, triples)
    table, manifest = open_or_make(
        set_dir, plan, lambda: margin_scores(teacher, triples, cfg.eval_batch_size), rank, barrier)
    margins = np.asarray(table["teacher_positive"], np.float32) - np.asarray(table["teacher_negative"], np.float32)
    new_units = [{"q": q, "p": p, "negs": [n], "margin": float(m), "texts": frozenset([q, p, n])}
                 for (q, p, n), m in zip(triples, margins)]
    info = {"loss": loss, "teacher": cfg.distill_from, "teacher_kind": "cross-encoder", "set": str(set_dir),
            "reused": manifest["reused"], "triples": len(triples),
            "rows_without_negatives": sum(not u["negs"] for u in units),
            "teacher_margin_mean": float(margins.mean()), "teacher_margin_std": float(margins.std())}
    del teacher
    return new_units, {"loss": loss}, info


def _embedding_units(cfg: EmbedConfig, model: BiEncoder, units: list[dict], data: TrainData, set_dir: Path, rank: int,
                     barrier, device) -> tuple[list[dict], dict, dict]:
    """The units as they are, each pointing at the bi-encoder teacher's embeddings of its query and
    positive; the student gets a projection to the teacher's width when it has none and the widths differ."""
    loss = "embedding_mse"
    teacher = load_bi_encoder(cfg.distill_from, kernels=cfg.kernels, device=device)
    texts = list(dict.fromkeys([u["q"] for u in units] + [u["p"] for u in units]))
    plan = make_plan(loss, teacher_identity(teacher, cfg.distill_from), {"train": data.train_path},
                     [(t,) for t in texts])
    table, manifest = open_or_make(set_dir, plan, lambda: teacher_embeddings(teacher, texts, cfg.eval_batch_size),
                                   rank, barrier)
    vectors = np.asarray(table["embedding"], dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] != len(texts):
        raise DataError(f"{set_dir}: embeddings of shape {vectors.shape}, expected {len(texts)} rows of one width")
    index = {t: i for i, t in enumerate(table["text"])}
    teacher_dim, teacher_norm = vectors.shape[1], teacher.normalize
    del teacher
    projection = None
    if model.projection is None and teacher_dim != model.full_dim:
        from bertdist.model.bert import init_weights

        model.projection = torch.nn.Linear(model.config.hidden_size, teacher_dim).to(device)
        init_weights(model.projection, model.config.initializer_range)
        projection = [model.config.hidden_size, teacher_dim]
    elif model.full_dim != teacher_dim:
        raise DataError(f"the student {cfg.checkpoint} embeds into {model.full_dim} dimensions (its Dense module), the "
                        f"teacher {cfg.distill_from} into {teacher_dim}")
    if cfg.truncate_dim and cfg.truncate_dim > model.full_dim:
        raise DataError(f"truncate_dim {cfg.truncate_dim} is wider than the student's {model.full_dim} dimensions")
    for u in units:
        u["tq"], u["tp"] = index[u["q"]], index[u["p"]]
    info = {"loss": loss, "teacher": cfg.distill_from, "teacher_kind": "bi-encoder", "set": str(set_dir),
            "reused": manifest["reused"], "texts": len(texts), "teacher_dim": teacher_dim,
            "teacher_normalize": teacher_norm, "projection": projection}
    return units, {"loss": loss, "vectors": vectors, "teacher_normalize": teacher_norm}, info
