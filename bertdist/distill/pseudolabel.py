"""Pseudo-labelling: the teacher's outputs over unlabelled text, written once as Parquet shards with
a manifest, for any number of students to train on.

The rows (tokenized features of every source, in order) are cut into shards of ``shard_rows``;
rank r of a torchrun world labels shards r, r + world, ... Each shard is written to a temporary
name and renamed when complete, so a killed job leaves only whole shards, and a rerun labels only
the shards that are missing. ``plan.json`` (written first) pins what the directory holds: a rerun
with another teacher, tokenizer, length or source is refused instead of mixing labels.
``manifest.json`` is written last, by rank 0, once every shard is there.

Each row stores ``input_ids``, ``token_type_ids``, ``loss_mask`` (token tasks: 1 on the word
pieces that carry a word's tag) and the teacher's full logits, flattened (``[C]`` for
classification, ``[1]`` regression, ``[S, C]`` tokens, ``[S, 2]`` spans). Our tasks have at most a
few dozen outputs per position, so full logits are stored; top-k would lose nothing worth the
complexity here.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from bertdist.finetune.errors import DataError
from bertdist.model import IGNORE_INDEX

FORMAT = "bertdist-pseudo-labels/1"


class LabelSetMismatch(DataError):
    """A pseudo-label set made by another teacher, tokenizer, task or sources than the run names."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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
    from bertdist.export.tokenizer import vocab_sha256

    ident = {"vocab_sha256": vocab_sha256(teacher.vocab_file), "do_lower_case": teacher.do_lower_case,
             "max_seq_length": cfg.max_seq_length}
    if getattr(cfg, "task", "").startswith("squad"):
        ident.update(doc_stride=cfg.doc_stride, max_query_length=cfg.max_query_length)
    return ident


def make_plan(task: str, runner, teacher, cfg, sources: list, n_rows: int, shard_rows: int) -> dict:
    return {
        "format": FORMAT, "task": task, "kind": runner.kind, "num_outputs": _outputs(runner),
        "label_names": runner.label_names,
        "teacher": {k: v for k, v in teacher.identity().items()},
        "tokenizer": tokenizer_identity(teacher, cfg),
        "sources": [{"path": str(s.path), "sha256": file_sha256(s.path), "rows": len(s.examples),
                     "skipped_blank_lines": s.skipped_blank} for s in sources],
        "rows": n_rows, "shard_rows": shard_rows, "num_shards": max(1, -(-n_rows // shard_rows)),
        "logits": "full",
    }


def _outputs(runner) -> int:
    return {"regression": 1, "span": 2}.get(runner.kind, runner.num_labels)


def shard_name(k: int, n: int) -> str:
    return f"shard-{k:05d}-of-{n:05d}.parquet"


def _identity_diff(have: dict, want: dict, keys=("task", "teacher", "tokenizer", "sources", "rows", "shard_rows")) -> list[str]:
    out = []
    for k in keys:
        if have.get(k) != want.get(k):
            if isinstance(want.get(k), dict) and isinstance(have.get(k), dict):
                for kk in sorted(set(want[k]) | set(have[k])):
                    if have[k].get(kk) != want[k].get(kk):
                        out.append(f"{k}.{kk}: set has {have[k].get(kk)!r}, this run has {want[k].get(kk)!r}")
            else:
                out.append(f"{k}: set has {have.get(k)!r}, this run has {want.get(k)!r}")
    return out


# ---------------------------------------------------------------- the job
def _write_shard(path: Path, rows: list[dict], logits: list[np.ndarray], first_row: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {
        "row": pa.array(np.arange(first_row, first_row + len(rows), dtype=np.int64)),
        "input_ids": pa.array([r["input_ids"] for r in rows], type=pa.list_(pa.int32())),
        "token_type_ids": pa.array([r["token_type_ids"] for r in rows], type=pa.list_(pa.int8())),
        "logits": pa.array([np.asarray(x, dtype=np.float32).reshape(-1) for x in logits], type=pa.list_(pa.float32())),
    }
    if "loss_mask" in rows[0]:
        cols["loss_mask"] = pa.array([r["loss_mask"] for r in rows], type=pa.list_(pa.int8()))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.table(cols), tmp)
    os.replace(tmp, path)


def _dist_world() -> tuple[int, int]:
    group = _process_group()
    if group:
        return group.get_rank(), group.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_labelling(task: str, runner, teacher, cfg, paths: list[str], out_dir: str | Path, *,
                  shard_rows: int = 4096, batch_size: int = 128, progress: bool = True) -> dict:
    """Label every row not yet labelled in ``out_dir``; return the manifest (rank 0) or the plan."""
    from tqdm.auto import tqdm

    from bertdist.distill.unlabeled import read_unlabeled
    from bertdist.finetune.train import predict

    out = Path(out_dir)
    if not paths:
        raise DataError("no unlabelled input: give --unlabeled PATH (text, JSONL or the task's layout)")
    sources = [read_unlabeled(task, p) for p in paths]
    for s in sources:
        if not s.examples:
            raise DataError(f"{s.path}:1: empty file: no text to label ({s.skipped_blank} blank lines)")
    rows = [f for s in sources for f in encode_unlabeled(runner, s.examples, s.path)]
    plan = make_plan(task, runner, teacher, cfg, sources, len(rows), shard_rows)
    rank, world = _dist_world()
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    if plan_path.is_file():
        diff = _identity_diff(json.loads(plan_path.read_text()), plan)
        if diff:
            raise LabelSetMismatch(f"{plan_path}: this directory holds pseudo-labels of another run; "
                                   + "; ".join(diff) + ". Use another output directory.")
    elif rank == 0:
        tmp = plan_path.with_name(f".plan.json.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(plan, indent=2) + "\n")
        os.replace(tmp, plan_path)
    n = plan["num_shards"]
    mine = [k for k in range(n) if k % world == rank]
    todo = [k for k in mine if not (out / shard_name(k, n)).is_file()]
    todo_rows = sum(len(rows[k * shard_rows:(k + 1) * shard_rows]) for k in todo)
    t0 = time.time()
    bar = tqdm(total=todo_rows, desc=f"pseudo-labelling {task} (rank {rank}/{world})", unit="row",
               disable=not progress or rank != 0, dynamic_ncols=True)
    pcfg = _predict_cfg(cfg, batch_size)
    for k in todo:
        part = rows[k * shard_rows:(k + 1) * shard_rows]
        logits = predict(teacher.model, part, pcfg, teacher.device)
        _write_shard(out / shard_name(k, n), part, logits, k * shard_rows)
        bar.update(len(part))
    bar.close()
    stats = {"rank": rank, "world_size": world, "shards_labelled": len(todo), "shards_reused": len(mine) - len(todo),
             "rows_labelled": todo_rows, "seconds": time.time() - t0}
    group = _process_group()
    if group:
        group.barrier()  # every rank's shards are written
    if rank == 0:
        _wait_for_shards(out, n)
        manifest = {**plan, "shards": [shard_name(k, n) for k in range(n)],
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "last_run": stats}
        tmp = out / f".manifest.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, out / "manifest.json")
    if group:
        group.barrier()  # the manifest is there for every rank
        return {**read_manifest(out), "last_run": stats}
    return manifest if rank == 0 else {**plan, "last_run": stats}


def _process_group():
    """torch.distributed when a process group is up (torchrun + DeepSpeed or gloo), else None."""
    import torch

    up = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed if up else None


def _predict_cfg(cfg, batch_size: int):
    import dataclasses

    return dataclasses.replace(cfg, eval_batch_size=batch_size, precision="fp32")  # the teacher's dtype is set on load


def _wait_for_shards(out: Path, n: int, timeout_s: float = 3600.0) -> None:
    """Ranks launched without a process group (plain RANK/WORLD_SIZE) finish at their own pace."""
    t0 = time.time()
    while True:
        missing = [k for k in range(n) if not (out / shard_name(k, n)).is_file()]
        if not missing:
            return
        if time.time() - t0 > timeout_s:
            raise DataError(f"{out}: shards {missing[:10]} still missing after {timeout_s:.0f} s")
        time.sleep(1.0)


# ---------------------------------------------------------------- reading a set back
def read_manifest(labels_dir: str | Path) -> dict:
    d = Path(labels_dir)
    path = d / "manifest.json"
    if not path.is_file():
        state = "an unfinished pseudo-labelling job (rerun it to finish)" if (d / "plan.json").is_file() else "no pseudo-labels"
        raise DataError(f"{d}: no manifest.json: {state}")
    m = json.loads(path.read_text())
    if m.get("format") != FORMAT:
        raise DataError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


def check_label_set(manifest: dict, labels_dir, task: str, teacher, cfg) -> None:
    """Refuse a set made by another teacher, tokenizer or task than this run's."""
    want = {"task": task, "teacher": teacher.identity(), "tokenizer": tokenizer_identity(teacher, cfg)}
    have = {k: manifest.get(k) for k in want}
    # the teacher's path may differ (a copy of the same weights): the hashes decide
    have["teacher"] = {**(have["teacher"] or {}), "path": want["teacher"]["path"]}
    diff = _identity_diff(have, want, keys=("task", "teacher", "tokenizer"))
    if diff:
        raise LabelSetMismatch(f"{Path(labels_dir) / 'manifest.json'}: the pseudo-labels were made by another "
                               "teacher or tokenizer than this run's: " + "; ".join(diff))


def load_label_rows(labels_dir: str | Path, manifest: dict) -> list[dict]:
    """The rows of every shard as features: ids, type ids, attention mask, teacher logits (numpy)."""
    import pyarrow.parquet as pq

    d = Path(labels_dir)
    c = manifest["num_outputs"]
    kind = manifest["kind"]
    out: list[dict] = []
    for name in manifest["shards"]:
        t = pq.read_table(d / name).to_pydict()
        for i in range(len(t["row"])):
            ids = t["input_ids"][i]
            f = {"input_ids": ids, "token_type_ids": t["token_type_ids"][i], "attention_mask": [1] * len(ids)}
            lg = np.asarray(t["logits"][i], dtype=np.float32)
            f["teacher"] = lg.reshape(len(ids), c) if kind in ("token", "span") else lg
            if "loss_mask" in t:
                f["loss_mask"] = t["loss_mask"][i]
            out.append(f)
    if len(out) != manifest["rows"]:
        raise DataError(f"{d}: the shards hold {len(out)} rows, the manifest says {manifest['rows']}")
    return out
