"""The embedding job (``bertdist embed``): a bi-encoder's embeddings of every input text, written
once as Parquet shards with a manifest, for an index (``bertdist index``) to be built from.

Inputs, by extension:

* ``.jsonl``: one object per line with a ``text`` string and an optional ``id`` (a string, or an
  integer stored as its decimal string); other keys are ignored;
* ``.tsv``: ``id<TAB>text`` per line, or any columns under a header line that names ``id`` and
  ``text``;
* anything else: plain text, one text per line (surrounding whitespace stripped).

Blank lines are skipped and counted. A row without an id gets ``<file name>:<line>``. Ids must
be unique across all inputs (they are what a search returns). An empty file, invalid JSON, a
missing or empty text, or a repeated id is a ``DataError`` naming ``file:line``.

The job follows the pseudo-label job (``bertdist.distill.pseudolabel``): rows (every source's, in
order) are cut into shards of ``shard_rows``; rank r of a torchrun world embeds shards r, r +
world, ...; each shard is written to a temporary name and renamed when complete, so a killed job
leaves only whole shards and a rerun embeds only the missing ones. ``plan.json`` (written first)
pins the model (its hash, pooling, normalisation, width, sequence length) and the sources (their
sha256): a rerun with another model or input is refused instead of mixing embeddings.
``manifest.json`` is written last, by rank 0, once every shard is there.

A shard's columns: ``row`` (int64, the global row number), ``id`` and ``text`` (strings), and
``embedding`` (a fixed-size list of float32, the model's width).

The model hash (``model_sha256``) is the sha256 over every weight, config and tokenizer file
under the model directory (relative names included, optimizer states and hidden files left out),
so a copy of the same model elsewhere has the same hash and any change to its weights, pooling
config or vocabulary gives another.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bertdist.data.manifest import file_sha256, path_inside
# the pseudo-label job's shard layout and wait: the same resumable-set mechanism
from bertdist.distill.pseudolabel import shard_name, wait_for_shards
from bertdist.finetune.errors import DataError, not_utf8

FORMAT = "bertdist-embeddings/1"
PLAN = "plan.json"
MANIFEST = "manifest.json"
JSONL_LAYOUT = '{"text": ..., "id": ... (optional)}'
TSV_LAYOUT = "id<TAB>text (or a header line naming id and text columns)"


class EmbeddingSetMismatch(DataError):
    """An embedding directory made by another model, or from other inputs, than the run names."""


# ---------------------------------------------------------------- inputs
@dataclasses.dataclass
class TextSource:
    path: Path
    layout: str  # text | jsonl | tsv
    ids: list[str]
    texts: list[str]
    lines: list[int]  # each row's line number, for messages
    skipped_blank: int = 0


def _lines(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    return text.splitlines()


def _id_value(raw, where: str) -> str:
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise DataError(f"{where}: id must be a string or an integer, got {type(raw).__name__} {raw!r:.80}")
    value = str(raw)
    if not value.strip():
        raise DataError(f"{where}: id is empty")
    return value


def read_texts(path: str | Path) -> TextSource:
    """The rows of one input file (see the module doc for the layouts)."""
    path = Path(path)
    ext = path.suffix.lower()
    layout = {".jsonl": "jsonl", ".tsv": "tsv"}.get(ext, "text")
    src = TextSource(path, layout, [], [], [])
    lines = _lines(path)
    header: tuple[int, int] | None = None  # TSV: the id and text columns a header names
    width = 2
    for n, line in enumerate(lines, 1):
        if not line.strip():
            src.skipped_blank += 1
            continue
        where = f"{path}:{n}"
        if layout == "text":
            rid, text = f"{path.name}:{n}", line.strip()
        elif layout == "jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); expected one object per "
                                f"line: {JSONL_LAYOUT}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a JSON {type(row).__name__}, expected an object {JSONL_LAYOUT}")
            if "text" not in row:
                raise DataError(f"{where}: no 'text' key (the row has {sorted(row)}; expected {JSONL_LAYOUT})")
            text = row["text"]
            if not isinstance(text, str):
                raise DataError(f"{where}: text must be a string, got {type(text).__name__} {text!r:.80}")
            rid = _id_value(row["id"], where) if "id" in row else f"{path.name}:{n}"
        else:
            cells = line.split("\t")
            if header is None and not src.ids and "id" in [c.strip().lower() for c in cells] \
                    and "text" in [c.strip().lower() for c in cells]:
                names = [c.strip().lower() for c in cells]
                header, width = (names.index("id"), names.index("text")), len(cells)
                continue
            if len(cells) != width:
                raise DataError(f"{where}: {len(cells)} tab-separated columns, expected {width}: {TSV_LAYOUT}")
            i_id, i_text = header or (0, 1)
            rid, text = _id_value(cells[i_id].strip(), where), cells[i_text]
        if not text.strip():
            raise DataError(f"{where}: the text is empty")
        src.ids.append(rid)
        src.texts.append(text)
        src.lines.append(n)
    if not src.texts:
        what = f"{src.skipped_blank} blank lines" if src.skipped_blank else "no lines"
        if header is not None:
            what = "a header line only"
        raise DataError(f"{path}:1: empty input: no text to embed ({what})")
    return src


def read_inputs(paths: Sequence[str | Path]) -> list[TextSource]:
    """Every input, checked for ids repeated within or across files."""
    if not paths:
        raise DataError("no input: give --input FILE (plain text, .jsonl or .tsv)")
    sources = [read_texts(p) for p in paths]
    seen: dict[str, str] = {}
    for s in sources:
        for rid, n in zip(s.ids, s.lines):
            here = f"{s.path}:{n}"
            if rid in seen:
                raise DataError(f"{here}: id {rid!r} is already used at {seen[rid]}: ids must be unique across the "
                                "inputs (they name the rows a search returns)")
            seen[rid] = here
    return sources


# ---------------------------------------------------------------- the model's identity
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
    """sha256 over the model's weight, config and tokenizer files, relative names included."""
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


def model_identity(model, path: str | Path, max_seq_length: int | None = None) -> dict:
    """What an embedding set (and an index built from it) records about the model."""
    from bertdist.export.tokenizer import vocab_sha256

    return {"path": str(path), "sha256": model_sha256(path),
            "vocab_sha256": vocab_sha256(model.vocab_file) if model.vocab_file else None,
            "do_lower_case": model.do_lower_case, "pooling": model.pooling, "normalize": model.normalize,
            "truncate_dim": model.truncate_dim, "dim": int(model.dim),
            "max_seq_length": int(max_seq_length or model.max_seq_length),
            "format": getattr(model, "origin", {}).get("format")}


# ---------------------------------------------------------------- plan and shards
def make_plan(model: dict, sources: list[TextSource], shard_rows: int) -> dict:
    rows = sum(len(s.texts) for s in sources)
    return {"format": FORMAT, "model": model,
            "sources": [{"path": str(s.path), "sha256": file_sha256(s.path), "layout": s.layout, "rows": len(s.texts),
                         "skipped_blank_lines": s.skipped_blank} for s in sources],
            "rows": rows, "dim": model["dim"], "normalized": model["normalize"], "dtype": "float32",
            "shard_rows": shard_rows, "num_shards": max(1, -(-rows // shard_rows))}


def plan_diff(have: dict, want: dict) -> list[str]:
    """What differs between two plans, path names aside (a copy of the same model or input is the same)."""
    out = []
    for k in ("format", "model", "sources", "rows", "shard_rows"):
        a, b = have.get(k), want.get(k)
        if k == "model" and isinstance(a, dict) and isinstance(b, dict):
            for kk in sorted((set(a) | set(b)) - {"path"}):
                if a.get(kk) != b.get(kk):
                    out.append(f"model.{kk}: directory has {a.get(kk)!r}, this run has {b.get(kk)!r}")
        elif k == "sources" and isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"sources: directory has {len(a)} input files, this run has {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                if (x.get("sha256"), x.get("rows")) != (y.get("sha256"), y.get("rows")):
                    out.append(f"input {i + 1}: directory has {x.get('path')} ({x.get('rows')} rows, sha256 "
                               f"{x.get('sha256')}), this run has {y.get('path')} ({y.get('rows')} rows, sha256 "
                               f"{y.get('sha256')})")
        elif a != b:
            out.append(f"{k}: directory has {a!r}, this run has {b!r}")
    return out


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _write_shard(path: Path, first_row: int, ids: list[str], texts: list[str], emb: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = pa.array(np.ascontiguousarray(emb, dtype=np.float32).reshape(-1), type=pa.float32())
    table = pa.table({
        "row": pa.array(np.arange(first_row, first_row + len(ids), dtype=np.int64)),
        "id": pa.array(ids, type=pa.string()),
        "text": pa.array(texts, type=pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(flat, emb.shape[1]),
    })
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _process_group():
    import torch

    up = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed if up else None


def _world() -> tuple[int, int]:
    group = _process_group()
    if group:
        return group.get_rank(), group.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed() -> bool:
    """Start a process group under torchrun (gloo on CPU, nccl on GPUs); True when this call started it."""
    import torch

    if int(os.environ.get("WORLD_SIZE", 1)) <= 1 or _process_group():
        return False
    from bertdist.train.distributed import prepare_environment

    prepare_environment()
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def default_device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def run_embedding(model_path: str | Path, inputs: Sequence[str | Path], out_dir: str | Path, *,
                  batch_size: int = 64, max_seq_length: int | None = None, shard_rows: int = 10000,
                  progress: bool = True, model=None, device: str | None = None) -> dict:
    """Embed every row not yet embedded in ``out_dir``; return the manifest (rank 0) or the plan
    with this rank's ``last_run``. ``model``: the bi-encoder already loaded from ``model_path``."""
    from tqdm.auto import tqdm

    for name, v in (("batch_size", batch_size), ("shard_rows", shard_rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"{name} must be a positive integer, got {v!r}")
    if max_seq_length is not None and (isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int)
                                       or max_seq_length < 2):
        raise DataError(f"max_seq_length must be an integer >= 2 ([CLS] and [SEP]), got {max_seq_length!r}")
    sources = read_inputs(inputs)  # input errors before the model is loaded
    if model is None:
        from bertdist.embed.model import load_bi_encoder

        model = load_bi_encoder(model_path, device=device or default_device())
    limit = model.config.max_position_embeddings
    if max_seq_length is not None and max_seq_length > limit:
        raise DataError(f"max_seq_length {max_seq_length} is longer than the model's {limit} positions "
                        f"({model_path})")
    plan = make_plan(model_identity(model, model_path, max_seq_length), sources, shard_rows)
    ids = [i for s in sources for i in s.ids]
    texts = [t for s in sources for t in s.texts]
    rank, world = _world()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / PLAN
    if plan_path.is_file():
        diff = plan_diff(_read_json(plan_path), plan)
        if diff:
            raise EmbeddingSetMismatch(f"{plan_path}: this directory holds embeddings of another model or input; "
                                       + "; ".join(diff) + ". Use another output directory.")
    elif rank == 0:
        _write_json(plan_path, plan)
    n = plan["num_shards"]
    mine = [k for k in range(n) if k % world == rank]
    todo = [k for k in mine if not (out / shard_name(k, n)).is_file()]
    todo_rows = sum(len(texts[k * shard_rows:(k + 1) * shard_rows]) for k in todo)
    t0 = time.time()
    bar = tqdm(total=todo_rows, desc=f"embedding (rank {rank}/{world})", unit="text",
               disable=not progress or rank != 0, dynamic_ncols=True)
    for k in todo:
        lo, hi = k * shard_rows, min((k + 1) * shard_rows, len(texts))
        emb = model.encode(texts[lo:hi], batch_size=batch_size, max_seq_length=plan["model"]["max_seq_length"])
        _write_shard(out / shard_name(k, n), lo, ids[lo:hi], texts[lo:hi], emb)
        bar.update(hi - lo)
    bar.close()
    stats = {"rank": rank, "world_size": world, "shards_embedded": len(todo), "shards_reused": len(mine) - len(todo),
             "rows_embedded": todo_rows, "seconds": round(time.time() - t0, 3)}
    group = _process_group()
    if group:
        group.barrier()  # every rank's shards are written
    if rank == 0:
        wait_for_shards(out, n)
        shards = [{"file": shard_name(k, n), "rows": len(texts[k * shard_rows:(k + 1) * shard_rows])} for k in range(n)]
        manifest = {**plan, "shards": shards, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "last_run": stats}
        _write_json(out / MANIFEST, manifest)
    if group:
        group.barrier()  # the manifest is there for every rank
        return {**read_manifest(out), "last_run": stats}
    return manifest if rank == 0 else {**plan, "last_run": stats}


# ---------------------------------------------------------------- reading a set back
@dataclasses.dataclass
class EmbeddingSet:
    manifest: dict
    ids: list[str]
    texts: list[str]
    vectors: np.ndarray  # [rows, dim] float32


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_manifest(emb_dir: str | Path) -> dict:
    d = Path(emb_dir)
    path = d / MANIFEST
    if not path.is_file():
        state = ("an unfinished embedding job (rerun `bertdist embed` with the same arguments to finish it)"
                 if (d / PLAN).is_file() else "not an embedding directory (`bertdist embed --out`)")
        raise DataError(f"{d}: no {MANIFEST}: {state}")
    m = _read_json(path)
    if m.get("format") != FORMAT:
        raise DataError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}")
    return m


def read_embeddings(emb_dir: str | Path) -> EmbeddingSet:
    """Every row of a finished embedding set, in row order, checked against its manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = Path(emb_dir)
    m = read_manifest(d)
    dim, shards = m.get("dim"), m.get("shards")
    shards_ok = isinstance(shards, list) and all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and _count(s.get("rows")) for s in shards)
    if not (_count(dim) and dim > 0 and _count(m.get("rows")) and isinstance(m.get("model"), dict) and shards_ok):
        raise DataError(f"{d / MANIFEST}: wrong layout: expected dim, rows, model and shards "
                        "([{\"file\", \"rows\"}, ...]) as `bertdist embed` writes them")
    ids: list[str] = []
    texts: list[str] = []
    parts = []
    for shard in m["shards"]:
        path = path_inside(d, shard["file"], d / MANIFEST, DataError)
        try:
            t = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{path}: not a readable embedding shard ({type(e).__name__}: {e}); remove it and run "
                            "`bertdist embed` into this directory again (a rerun embeds the missing shards only)") \
                from None
        if t.num_rows != shard["rows"]:
            raise DataError(f"{path}: {t.num_rows} rows, the manifest {d / MANIFEST} says {shard['rows']}")
        missing = [c for c in ("id", "text", "embedding") if c not in t.column_names]
        if missing:
            raise DataError(f"{path}: no column(s) {missing} (it has {t.column_names})")
        col = t.column("embedding").combine_chunks()
        width = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
        if width != dim:
            raise DataError(f"{path}: embeddings of type {col.type} (width {width}), the manifest {d / MANIFEST} "
                            f"says {dim} float32")
        parts.append(col.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim))
        ids.extend(t.column("id").to_pylist())
        texts.extend(t.column("text").to_pylist())
    vectors = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros((0, dim), np.float32)
    if len(ids) != m["rows"]:
        raise DataError(f"{d}: the shards hold {len(ids)} rows, the manifest says {m['rows']}")
    return EmbeddingSet(m, ids, texts, vectors)
