"""Pseudo-labelling: the teacher's outputs over unlabelled text, written once as Parquet shards with
a manifest, for any number of students to train on.

A sharded stored set (``bertdist.stored_set``): the rows (tokenized features of every source, in
order) are cut into shards of ``shard_rows``; rank r of a torchrun world labels shards r, r +
world, ...; a killed job leaves only whole shards, and a rerun labels only the missing ones.
``plan.json`` (written first) pins what the directory holds: a rerun with another teacher,
tokenizer, length or source is refused instead of mixing labels (a copy of the same teacher or
source file elsewhere is the same). ``manifest.json`` is written last, by rank 0, once every shard
is there.

Each row stores ``input_ids``, ``token_type_ids``, ``loss_mask`` (token tasks: 1 on the word
pieces that carry a word's tag) and the teacher's outputs, flattened. With full logits (``top_k``
unset): ``logits``, ``[C]`` for classification, ``[1]`` regression, ``[S, C]`` tokens, ``[S, 2]``
spans. With ``top_k: k``: ``top_values`` and ``top_indices``, the k largest logits of each output
distribution in descending order and where they are: ``[k]`` per example for classification,
``[S, k]`` per position for tokens, ``[2, k']`` for spans (the top start positions, then the top end
positions, ``k' = min(k, S)``). A distribution with at most k outputs (a 2-class task, 9 NER tags at
k = 20) is stored whole and the set stays full-logit. Spans are where top-k pays: a SQuAD row at
seq 384 holds 768 logits, ``k = 20`` keeps 40 values and 40 positions. The mass outside the stored
support is dropped: the loss renormalises the teacher over it (``losses.topk_kl``). A top-k set has
format ``/2``: readers that know only full logits refuse it instead of misreading it. Regression has
no distribution to cut and refuses ``top_k``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bertdist.data.manifest import path_inside
from bertdist.finetune.errors import DataError
from bertdist.model import IGNORE_INDEX
from bertdist.stored_set import (SetMismatch, num_shards, plan_diff, read_manifest as read_set_manifest, run_sharded,
                                 source_entry, write_parquet_atomic)

FORMAT = "bertdist-pseudo-labels/1"  # full logits
FORMAT_TOP_K = "bertdist-pseudo-labels/2"  # top-k values and indices
FORMATS = (FORMAT, FORMAT_TOP_K)


class LabelSetMismatch(SetMismatch):
    """A pseudo-label set made by another teacher, tokenizer, task or sources than the run names."""


# ---------------------------------------------------------------- rows
def encode_unlabeled(runner, examples: list, path: Path) -> list[dict]:
    """Model inputs for unlabelled examples, by the task runner's own encoding; no labels."""
    kind = runner.kind
    if kind in ("classification", "regression"):
        feats = runner._encode(examples)
    elif kind == "token":
        feats = runner._encode(examples, path)
        for f in feats:  # the placeholder tags only mark which pieces carry a word's tag
            f["loss_mask"] = [int(x != IGNORE_INDEX) for x in f.pop("labels")]
            f.pop("_first_token", None)
    elif kind == "span":
        feats = runner._features(examples, False).inputs
    else:
        raise DataError(f"task head {kind!r} has no distillation support")
    return [{k: v for k, v in f.items() if k in ("input_ids", "token_type_ids", "attention_mask", "loss_mask")}
            for f in feats]


def tokenizer_identity(teacher, cfg) -> dict:
    ident = {"vocab_sha256": teacher.vocab_sha256, "do_lower_case": teacher.do_lower_case,
             "max_seq_length": cfg.max_seq_length}
    if getattr(cfg, "task", "").startswith("squad"):
        ident.update(doc_stride=cfg.doc_stride, max_query_length=cfg.max_query_length)
    return ident


def effective_top_k(kind: str, n_outputs: int, top_k: int | None, max_seq_length: int) -> int | None:
    """The k a set stores for ``top_k`` on this head, None for full logits: a distribution with at
    most k outputs (classes, or a span's positions) is kept whole."""
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise DataError(f"top_k must be a positive integer or null (full logits), got {top_k!r}")
    if kind == "regression":
        raise DataError(f"top_k={top_k}: a regression head (stsb) has one output, no distribution to cut; "
                        "leave top_k unset (null)")
    size = max_seq_length if kind == "span" else n_outputs
    return top_k if top_k < size else None


def top_k_of(logits: np.ndarray, kind: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits of each output distribution of one row, descending, and their indices:
    ``[C]`` -> ``[k]``; tokens ``[S, C]`` -> ``[S, k]``; spans ``[S, 2]`` -> ``[2, min(k, S)]`` (over
    positions). Ties keep the lower index first."""
    x = np.asarray(logits, dtype=np.float32)
    if kind == "span":
        x = x.T
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, -1), idx.astype(np.int32)


def make_plan(task: str, runner, teacher, cfg, sources: list, n_rows: int, shard_rows: int,
              top_k: int | None = None) -> dict:
    keep = effective_top_k(runner.kind, num_outputs(runner), top_k, cfg.max_seq_length)
    return {
        "format": FORMAT if keep is None else FORMAT_TOP_K, "task": task, "kind": runner.kind,
        "num_outputs": num_outputs(runner),
        "label_names": runner.label_names,
        "teacher": teacher.identity(),
        "tokenizer": tokenizer_identity(teacher, cfg),
        "sources": [source_entry(s.path, rows=len(s.examples), skipped_blank_lines=s.skipped_blank) for s in sources],
        "rows": n_rows, "shard_rows": shard_rows, "num_shards": num_shards(n_rows, shard_rows),
        "logits": "full" if keep is None else "top_k", "top_k": keep, "top_k_requested": top_k,
    }


def num_outputs(runner) -> int:
    """Outputs per distribution of the task head (2 for spans: start and end)."""
    return {"regression": 1, "span": 2}.get(runner.kind, runner.num_labels)


# ---------------------------------------------------------------- the job
def _write_shard(path: Path, rows: list[dict], logits: list[np.ndarray], first_row: int,
                 top_k: int | None = None, kind: str = "classification") -> None:
    import pyarrow as pa

    cols = {
        "row": pa.array(np.arange(first_row, first_row + len(rows), dtype=np.int64)),
        "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
        "token_type_ids": pa.array([r["token_type_ids"] for r in rows], type=pa.list_(pa.int8())),
    }
    if top_k is None:
        cols["logits"] = pa.array([np.asarray(x, dtype=np.float32).reshape(-1) for x in logits],
                                  type=pa.list_(pa.float32()))
    else:
        tops = [top_k_of(x, kind, top_k) for x in logits]
        cols["top_values"] = pa.array([v.reshape(-1) for v, _ in tops], type=pa.list_(pa.float32()))
        # indices are classes or positions (< 2^15 for any head and sequence length here)
        cols["top_indices"] = pa.array([i.reshape(-1).astype(np.int16) for _, i in tops], type=pa.list_(pa.int16()))
    if "loss_mask" in rows[0]:
        cols["loss_mask"] = pa.array([r["loss_mask"] for r in rows], type=pa.list_(pa.int8()))
    write_parquet_atomic(cols, path)


def run_labelling(task: str, runner, teacher, cfg, paths: list[str], out_dir: str | Path, *,
                  shard_rows: int = 4096, batch_size: int = 128, progress: bool = True,
                  top_k: int | None = None) -> dict:
    """Label every row not yet labelled in ``out_dir``; return the manifest (rank 0) or the plan."""
    from bertdist.distill.unlabeled import read_unlabeled
    from bertdist.finetune.train import predict

    effective_top_k(runner.kind, num_outputs(runner), top_k, cfg.max_seq_length)  # refuse a bad top_k before reading
    if not paths:
        raise DataError("no unlabelled input: give --unlabeled PATH (text, JSONL or the task's layout)")
    sources = [read_unlabeled(task, p) for p in paths]
    for s in sources:
        if not s.examples:
            raise DataError(f"{s.path}:1: empty file: no text to label ({s.skipped_blank} blank lines)")
    rows = [f for s in sources for f in encode_unlabeled(runner, s.examples, s.path)]
    plan = make_plan(task, runner, teacher, cfg, sources, len(rows), shard_rows, top_k)
    pcfg = _predict_cfg(cfg, batch_size)

    def write_shard(path: Path, lo: int, hi: int) -> None:
        logits = predict(teacher.model, rows[lo:hi], pcfg, teacher.device)
        _write_shard(path, rows[lo:hi], logits, lo, plan["top_k"], runner.kind)

    return run_sharded(out_dir, plan, write_shard, mismatch=LabelSetMismatch, what="pseudo-labels", verb="labelled",
                       desc=f"pseudo-labelling {task}", unit="row", progress=progress)


def _predict_cfg(cfg, batch_size: int):
    import dataclasses

    return dataclasses.replace(cfg, eval_batch_size=batch_size, precision="fp32")  # the teacher's dtype is set on load


# ---------------------------------------------------------------- reading a set back
def read_manifest(labels_dir: str | Path) -> dict:
    m = read_set_manifest(labels_dir, FORMATS, unfinished="an unfinished pseudo-labelling job (rerun it to finish)",
                          absent="no pseudo-labels")
    m.setdefault("top_k", None)
    return m


def check_label_set(manifest: dict, labels_dir, task: str, teacher, cfg) -> None:
    """Refuse a set made by another teacher, tokenizer or task than this run's."""
    want = {"task": task, "teacher": teacher.identity(), "tokenizer": tokenizer_identity(teacher, cfg)}
    diff = plan_diff(manifest, want)
    if diff:
        raise LabelSetMismatch(f"{Path(labels_dir) / 'manifest.json'}: the pseudo-labels were made by another "
                               "teacher or tokenizer than this run's: " + "; ".join(diff))


def check_sources(manifest: dict, labels_dir, paths: list[str]) -> None:
    """Refuse a set made from other files than ``paths`` (none named: any); a copy of the same
    file elsewhere is the same file."""
    for p in paths:
        if not Path(p).is_file():
            raise DataError(f"{p}: --unlabeled file not found")
    diff = plan_diff(manifest, {"sources": [source_entry(p) for p in paths]}) if paths else []
    if diff:
        raise LabelSetMismatch(f"{Path(labels_dir) / 'manifest.json'}: the pseudo-labels were made from other "
                               f"files than --unlabeled names ({list(paths)}): " + "; ".join(diff)
                               + "; give another labels_dir")


def check_top_k(manifest: dict, labels_dir, want: int | None) -> None:
    """Refuse a set that lacks what the run's ``top_k`` needs: a top-k set cannot give full logits,
    nor a larger k. A full set serves any k (cut when read), a top-k set any smaller k."""
    have = manifest.get("top_k")
    if have is None or (want is not None and want <= have):
        return
    need = "full logits (top_k: null)" if want is None else f"the top {want}"
    raise LabelSetMismatch(f"{Path(labels_dir) / 'manifest.json'}: the set holds the teacher's top {have} "
                           f"logits only, this run needs {need}; set top_k={have} (or less) for this run, "
                           "or label into another directory")


def load_label_rows(labels_dir: str | Path, manifest: dict, top_k: int | None = None) -> list[dict]:
    """The rows of every shard as features: ids, type ids, attention mask, teacher outputs (numpy).
    ``top_k`` (after ``check_top_k``): rows carry ``teacher`` = the top values and ``teacher_idx`` =
    their indices (see ``top_k_of``), cut from full logits or a larger k when the set has them."""
    import pyarrow.parquet as pq

    d = Path(labels_dir)
    c = manifest["num_outputs"]
    kind = manifest["kind"]
    have = manifest.get("top_k")
    out: list[dict] = []
    for name in manifest["shards"]:
        path = path_inside(d, name, d / "manifest.json", DataError)
        try:
            t = pq.read_table(path).to_pydict()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{path}: not a readable pseudo-label shard ({type(e).__name__}: {e}); remove it and "
                            "run `bertdist pseudo-label` into this directory again (a rerun labels the missing "
                            "shards only)") from None
        for i in range(len(t["row"])):
            ids = t["input_ids"][i]
            f = {"input_ids": ids, "token_type_ids": t["token_type_ids"][i], "attention_mask": [1] * len(ids)}
            if have is None:
                lg = np.asarray(t["logits"][i], dtype=np.float32)
                f["teacher"] = lg.reshape(len(ids), c) if kind in ("token", "span") else lg
                if top_k is not None:
                    f["teacher"], f["teacher_idx"] = top_k_of(f["teacher"], kind, top_k)
            else:
                shape = {"token": (len(ids), -1), "span": (2, -1)}.get(kind, (-1,))
                vals = np.asarray(t["top_values"][i], dtype=np.float32).reshape(shape)
                idx = np.asarray(t["top_indices"][i], dtype=np.int32).reshape(shape)
                k = have if top_k is None else top_k  # descending: the first k are the top k
                f["teacher"], f["teacher_idx"] = vals[..., :k], idx[..., :k]
            if "loss_mask" in t:
                f["loss_mask"] = t["loss_mask"][i]
            out.append(f)
    if len(out) != manifest["rows"]:
        raise DataError(f"{d}: the shards hold {len(out)} rows, the manifest says {manifest['rows']}")
    return out
