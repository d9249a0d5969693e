"""Stored sets: what a job computes once and later runs read back (pseudo-labels, a retrieval
teacher's scores or embeddings, an embedding job's vectors), and the model identity they record.

Every set is a directory with ``plan.json``, written first, pinning what the directory holds (the
model, the sources' sha256, the settings), the rows in Parquet, and ``manifest.json``, written
last, marking it complete. JSON and Parquet files are written to a temporary name and renamed,
so a killed job leaves only whole files.

One rule decides whether a directory holds this run's set: its plan (or manifest) agrees with
this run's plan on every key the run's plan has, at any depth, ``path`` entries aside. A copy of
the same model or input file elsewhere is the same (its sha256 decides); anything else is refused,
naming every difference.

Two layouts:

* sharded (``run_sharded``): rows cut into shards of ``shard_rows``; rank r of a world computes
  shards r, r + world, ...; a rerun computes only the missing shards; rank 0 writes the manifest
  once every shard is there;
* one file (``open_or_make``): computed by rank 0 in one go, the other ranks wait.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from bertdist.data.manifest import file_sha256, path_inside
from bertdist.finetune.errors import DataError

PLAN = "plan.json"
MANIFEST = "manifest.json"
IGNORED_KEYS = frozenset({"path"})  # where a file lies is not what it is


class SetMismatch(DataError):
    """A directory holding a stored set of another run (another model, other sources or settings);
    each kind of set raises its own subclass, the message names every difference."""


# ---------------------------------------------------------------- files
def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_parquet_atomic(columns: dict, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.table(columns), tmp)
    os.replace(tmp, path)


def read_manifest(set_dir: str | Path, formats: tuple[str, ...], unfinished: str, absent: str) -> dict:
    """The manifest of a finished set of one of ``formats``; ``unfinished`` / ``absent``: what the
    message says when only the plan is there / when neither is."""
    d = Path(set_dir)
    path = d / MANIFEST
    if not path.is_file():
        raise DataError(f"{d}: no {MANIFEST}: {unfinished if (d / PLAN).is_file() else absent}")
    m = read_json(path)
    if m.get("format") not in formats:
        raise DataError(f"{path}: format {m.get('format')!r}, expected one of {list(formats)}")
    return m


# ---------------------------------------------------------------- the one rule
def plan_diff(have: dict, want: dict) -> list[str]:
    """What differs between a stored plan or manifest (``have``) and this run's plan (``want``),
    over every key ``want`` has, at any depth, ``path`` entries aside; empty when they are the same."""
    out = []
    for k in want:
        if k not in IGNORED_KEYS:
            out += _diff(have.get(k), want[k], k)
    return out


def _diff(a, b, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [m for k in sorted(set(b) - IGNORED_KEYS) for m in _diff(a.get(k), b[k], f"{where}.{k}")]
        if out and a.get("path") != b.get("path"):  # name both files: which copy is which
            out = [f"{m} (the set's {where} is {a.get('path')}, this run's {b.get('path')})" for m in out]
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in _diff(x, y, f"{where}[{i}]")]
    if isinstance(a, list) and isinstance(b, list) and a and b and isinstance(b[0], dict):
        return [f"{where}: {len(a)} in the set, {len(b)} in this run"]
    return [] if a == b else [f"{where}: set has {a!r}, this run has {b!r}"]


def refuse_other(path: Path, plan: dict, mismatch: type[SetMismatch], what: str, advice: str) -> None:
    """Raise ``mismatch`` when the plan or manifest at ``path`` differs from ``plan``."""
    diff = plan_diff(read_json(path), plan)
    if diff:
        raise mismatch(f"{path}: {what} of another run: " + "; ".join(diff) + f". {advice}")


# ---------------------------------------------------------------- sharded sets
def shard_name(k: int, n: int) -> str:
    return f"shard-{k:05d}-of-{n:05d}.parquet"


def num_shards(rows: int, shard_rows: int) -> int:
    return max(1, -(-rows // shard_rows))


def wait_for_shards(out: Path, n: int, timeout_s: float = 3600.0) -> None:
    """Ranks launched without a process group (plain RANK/WORLD_SIZE) finish at their own pace."""
    t0 = time.time()
    while True:
        missing = [k for k in range(n) if not (out / shard_name(k, n)).is_file()]
        if not missing:
            return
        if time.time() - t0 > timeout_s:
            raise DataError(f"{out}: shards {missing[:10]} of {n} still missing after {timeout_s:.0f} s")
        time.sleep(1.0)


def run_sharded(out_dir: str | Path, plan: dict, write_shard: Callable[[Path, int, int], None], *,
                mismatch: type[SetMismatch], what: str, verb: str, desc: str, unit: str, progress: bool = True,
                shard_entry: Callable[[str, int, int], object] | None = None) -> dict:
    """Compute this rank's missing shards of the set ``plan`` pins (``rows``, ``shard_rows``,
    ``num_shards``): ``write_shard(path, lo, hi)`` writes rows ``lo:hi`` to ``path`` atomically.
    Returns the manifest (rank 0, or every rank of a process group) or the plan, with this rank's
    ``last_run``. ``shard_entry(name, lo, hi)``: a shard's entry in the manifest (default: its name);
    ``what``: the rows, in messages; ``verb``: the stats' name for computing a shard; ``desc``: the
    progress bar's."""
    from bertdist.train.distributed import process_group, rank_and_world

    out = Path(out_dir)
    rank, world = rank_and_world(launcher_env=True)
    out.mkdir(parents=True, exist_ok=True)
    if (out / PLAN).is_file():
        refuse_other(out / PLAN, plan, mismatch, f"this directory holds {what}", "Use another output directory.")
    elif rank == 0:
        write_json_atomic(out / PLAN, plan)
    bar = dict(desc=f"{desc} (rank {rank}/{world})", unit=unit, disable=not progress or rank != 0)
    stats = _write_missing_shards(out, plan, write_shard, rank, world, verb, bar)
    group = process_group()
    if group:
        group.barrier()  # every rank's shards are written
    if rank == 0:
        wait_for_shards(out, plan["num_shards"])
        entry = shard_entry or (lambda name, lo, hi: name)
        shards = [entry(shard_name(k, plan["num_shards"]), *_bounds(plan, k)) for k in range(plan["num_shards"])]
        manifest = {**plan, "shards": shards, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "last_run": stats}
        write_json_atomic(out / MANIFEST, manifest)
    if group:
        group.barrier()  # the manifest is there for every rank
        return {**read_json(out / MANIFEST), "last_run": stats}
    return manifest if rank == 0 else {**plan, "last_run": stats}


def _bounds(plan: dict, k: int) -> tuple[int, int]:
    """Shard k's rows, ``lo:hi``."""
    return k * plan["shard_rows"], min((k + 1) * plan["shard_rows"], plan["rows"])


def _write_missing_shards(out: Path, plan: dict, write_shard: Callable[[Path, int, int], None], rank: int,
                          world: int, verb: str, bar: dict) -> dict:
    """Rank r's shards (r, r + world, ...) that are not there yet; returns this run's counts."""
    from tqdm.auto import tqdm

    n = plan["num_shards"]
    mine = [k for k in range(n) if k % world == rank]
    todo = [k for k in mine if not (out / shard_name(k, n)).is_file()]
    todo_rows = sum(hi - lo for lo, hi in (_bounds(plan, k) for k in todo))
    t0 = time.time()
    with tqdm(total=todo_rows, dynamic_ncols=True, **bar) as progress:
        for k in todo:
            lo, hi = _bounds(plan, k)
            write_shard(out / shard_name(k, n), lo, hi)
            progress.update(hi - lo)
    return {"rank": rank, "world_size": world, f"shards_{verb}": len(todo), "shards_reused": len(mine) - len(todo),
            f"rows_{verb}": todo_rows, "seconds": round(time.time() - t0, 3)}


# ---------------------------------------------------------------- one-file sets
def open_or_make(set_dir: str | Path, plan: dict, rows_file: str, compute: Callable[[], dict], *,
                 mismatch: type[SetMismatch], what: str, advice: str, rank: int = 0,
                 barrier: Callable[[], None] | None = None) -> tuple[dict, dict]:
    """The set's columns and manifest: reused when ``set_dir`` holds a complete set of this plan,
    else computed by ``compute()`` (rank 0; the others wait at ``barrier``) into ``rows_file``. A
    set or an unfinished plan of another run is refused; ``what``: the set, in messages."""
    import pyarrow.parquet as pq

    d = Path(set_dir)
    mpath, ppath = d / MANIFEST, d / PLAN
    for path, state in ((mpath, what), (ppath, f"an unfinished {what}")):
        if path.is_file():
            refuse_other(path, plan, mismatch, state, advice)
            break
    reused = mpath.is_file()
    if not reused and rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        write_json_atomic(ppath, plan)
        t0 = time.time()
        write_parquet_atomic(compute(), d / rows_file)
        write_json_atomic(mpath, {**plan, "file": rows_file, "seconds": round(time.time() - t0, 3),
                                  "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if barrier is not None:
        barrier()
    manifest = read_json(mpath)
    path = path_inside(d, manifest.get("file", rows_file), mpath, DataError)
    try:
        table = pq.read_table(path).to_pydict()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable {what} ({type(e).__name__}: {e}); remove {d} to recompute it") \
            from None
    n = len(next(iter(table.values()))) if table else 0
    if n != plan["rows"]:
        raise DataError(f"{path}: {n} rows, its manifest {mpath} says {plan['rows']}")
    return table, {**manifest, "reused": reused}


# ---------------------------------------------------------------- model identity
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".yaml", ".yml")
_MODEL_NAMES = ("vocab.txt", "latest")  # the tokenizer's vocabulary; DeepSpeed's tag pointer


def model_files(path: str | Path) -> list[Path]:
    """The files ``model_sha256`` covers, sorted by relative name."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise DataError(f"{p}: model directory not found")
    out = []
    for f in p.rglob("*"):
        rel = f.relative_to(p)
        if not f.is_file() or any(part.startswith(".") for part in rel.parts) or "optim_states" in f.name:
            continue
        if f.suffix.lower() in _MODEL_SUFFIXES or f.name in _MODEL_NAMES:
            out.append(f)
    return sorted(out, key=lambda f: f.relative_to(p).as_posix())


def model_sha256(path: str | Path) -> str:
    """A model's identity, the one every stored set, index and query check records: the sha256
    over every file that decides what the model computes, each with its name relative to the model
    directory: the weights (``.safetensors``, ``.bin``, ``.pt``, ``.pth``, sharded or not), the
    configs (``.json``, ``.yaml``, ``.yml``: architecture, task head, pooling, Dense layers,
    tokenizer settings), the vocabulary (``vocab.txt``) and DeepSpeed's ``latest`` tag. Hidden
    files and optimizer states are left out. A copy of the model elsewhere has the same hash; a
    change to its weights, head, pooling or vocabulary gives another. A single file is hashed
    under its own name."""
    p = Path(path)
    files = model_files(p)
    if not files:
        raise DataError(f"{p}: no weight or config files (.safetensors, .bin, .pt, .json, .yaml) to identify the "
                        "model by")
    h = hashlib.sha256()
    for f in files:
        rel = f.name if p.is_file() else f.relative_to(p).as_posix()
        h.update(rel.encode() + b"\0" + file_sha256(f).encode() + b"\0")
    return h.hexdigest()


def source_entry(path: str | Path, **fields) -> dict:
    """What a plan records about one input file: where it was read (ignored when plans are
    compared) and its sha256 (what makes two files the same)."""
    return {"path": str(path), "sha256": file_sha256(path), **fields}
