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

The teacher runs once. Its outputs are stored as one Parquet file with a manifest, by the
pseudo-label sets' conventions (``bertdist.distill.pseudolabel``): ``plan.json`` written first
pins what the directory holds (the teacher's weights sha256, its tokenizer, the train file's
sha256 and a sha256 over the exact texts scored); ``manifest.json`` written last marks it
complete. A later run reuses a complete set with the same identity, recomputes an unfinished one
with the same plan, and refuses a set of another teacher or other data, naming every difference.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from bertdist.data.manifest import file_sha256, path_inside
from bertdist.finetune.errors import DataError

FORMAT = "bertdist-teacher-scores/1"
PLAN = "plan.json"
MANIFEST = "manifest.json"
ROWS_FILE = "teacher.parquet"
KINDS = {"margin_mse": "cross-encoder", "embedding_mse": "bi-encoder"}


class TeacherSetMismatch(DataError):
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


def dir_weights_sha256(path: str | Path) -> str:
    """sha256 over every weight file and module config under ``path`` (relative names included)."""
    p = Path(path)
    names = ("model.safetensors", "pytorch_model.bin", "config.json", "modules.json", "bertdist_model.pt")
    files = sorted(f for f in p.rglob("*") if f.is_file() and (f.name in names or f.name.endswith(".safetensors")))
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(p).as_posix().encode() + b"\0" + file_sha256(f).encode() + b"\0")
    return h.hexdigest()


def teacher_identity(model, path: str | Path) -> dict:
    from bertdist.export.tokenizer import vocab_sha256

    ident = {"path": str(path), "weights_sha256": dir_weights_sha256(path),
             "vocab_sha256": vocab_sha256(model.vocab_file), "do_lower_case": model.do_lower_case,
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
def _diff(have: dict, want: dict) -> list[str]:
    out = []
    for k in ("format", "kind", "teacher", "sources", "content_sha256", "rows"):
        a, b = have.get(k), want.get(k)
        if k == "teacher" and isinstance(a, dict) and isinstance(b, dict):
            for kk in sorted((set(a) | set(b)) - {"path"}):  # a copy of the same weights is the same teacher
                if a.get(kk) != b.get(kk):
                    out.append(f"teacher.{kk}: set has {a.get(kk)!r}, this run has {b.get(kk)!r}")
        elif k == "sources":
            sa = {s.get("role"): s.get("sha256") for s in a or []}
            sb = {s.get("role"): s.get("sha256") for s in b or []}
            for role in sorted(set(sa) | set(sb)):
                if sa.get(role) != sb.get(role):
                    out.append(f"the {role} file: set has sha256 {sa.get(role)}, this run's has {sb.get(role)}")
        elif a != b:
            out.append(f"{k}: set has {a!r}, this run has {b!r}")
    return out


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


def make_plan(kind: str, teacher: dict, sources: dict[str, str | Path], content: Sequence[Sequence[str]],
              extra: dict | None = None) -> dict:
    recorded = [{"role": role, "path": str(p), "sha256": file_sha256(p)} for role, p in sources.items()]
    return {"format": FORMAT, "kind": kind, "teacher": teacher, "sources": recorded,
            "content_sha256": texts_sha256(content), "rows": len(content), **(extra or {})}


def open_or_make(set_dir: str | Path, plan: dict, compute: Callable[[], dict], rank: int = 0,
                 barrier: Callable[[], None] | None = None) -> tuple[dict, dict]:
    """The set's columns and manifest: reused when ``set_dir`` holds a complete set of this plan,
    else computed by ``compute()`` (rank 0; the others wait at ``barrier``) and written. A set or
    an unfinished plan of another identity is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = Path(set_dir)
    mpath, ppath = d / MANIFEST, d / PLAN
    for path, what in ((mpath, "a teacher set"), (ppath, "an unfinished teacher set")):
        if path.is_file():
            diff = _diff(_read_json(path), plan)
            if diff:
                raise TeacherSetMismatch(f"{path}: {what} of another teacher or other data than this run's: "
                                         + "; ".join(diff) + f". Use another distill_set directory or remove {d}.")
            break
    reused = mpath.is_file()
    if not reused and rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        _write_json(ppath, plan)
        t0 = time.time()
        columns = compute()
        tmp = d / f".{ROWS_FILE}.tmp-{os.getpid()}"
        pq.write_table(pa.table(columns), tmp)
        os.replace(tmp, d / ROWS_FILE)
        _write_json(mpath, {**plan, "file": ROWS_FILE, "seconds": round(time.time() - t0, 3),
                            "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if barrier is not None:
        barrier()
    manifest = _read_json(mpath)
    path = path_inside(d, manifest.get("file", ROWS_FILE), mpath, DataError)
    try:
        table = pq.read_table(path).to_pydict()
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable teacher set ({type(e).__name__}: {e}); remove {d} to recompute it") \
            from None
    n = len(next(iter(table.values()))) if table else 0
    if n != plan["rows"]:
        raise DataError(f"{path}: {n} rows, its manifest {mpath} says {plan['rows']}")
    return table, {**manifest, "reused": reused}


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
