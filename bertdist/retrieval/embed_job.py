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

The set is a sharded stored set (``bertdist.stored_set``), as the pseudo-labels are: rows (every
source's, in order) are cut into shards of ``shard_rows``; rank r of a torchrun world embeds
shards r, r + world, ...; a killed job leaves only whole shards and a rerun embeds only the
missing ones. ``plan.json`` (written first) pins the model (its hash, pooling, normalisation,
width, sequence length) and the sources (their sha256): a rerun with another model or input is
refused instead of mixing embeddings; a copy of the same model or input elsewhere is the same.
``manifest.json`` is written last, by rank 0, once every shard is there.

A shard's columns: ``row`` (int64, the global row number), ``id`` and ``text`` (strings), and
``embedding`` (a fixed-size list of float32, the model's width).

The model is identified by ``bertdist.stored_set.model_sha256``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from bertdist.data.manifest import path_inside
from bertdist.finetune.errors import DataError, not_utf8
from bertdist.stored_set import (MANIFEST, SetMismatch, model_sha256, num_shards, read_manifest as read_set_manifest,
                                 run_sharded, source_entry, write_parquet_atomic)

FORMAT = "bertdist-embeddings/1"
JSONL_LAYOUT = '{"text": ..., "id": ... (optional)}'
TSV_LAYOUT = "id<TAB>text (or a header line naming id and text columns)"


class EmbeddingSetMismatch(SetMismatch):
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
def model_identity(model, path: str | Path, max_seq_length: int | None = None) -> dict:
    """What an embedding set (and an index built from it) records about the model."""
    from bertdist.export.tokenizer import tokenizer_sha256

    own = getattr(model, "tokenizer_files", [])  # a ModernBERT's tokenizer.json, fingerprinted in its place
    return {"path": str(path), "sha256": model_sha256(path),
            "vocab_sha256": tokenizer_sha256(model.vocab_file, own) if model.vocab_file or own else None,
            "do_lower_case": model.do_lower_case, "pooling": model.pooling, "normalize": model.normalize,
            "truncate_dim": model.truncate_dim, "dim": int(model.dim),
            "max_seq_length": int(max_seq_length or model.max_seq_length),
            "format": getattr(model, "origin", {}).get("format")}


# ---------------------------------------------------------------- plan and shards
def make_plan(model: dict, sources: list[TextSource], shard_rows: int) -> dict:
    rows = sum(len(s.texts) for s in sources)
    return {"format": FORMAT, "model": model,
            "sources": [source_entry(s.path, layout=s.layout, rows=len(s.texts), skipped_blank_lines=s.skipped_blank)
                        for s in sources],
            "rows": rows, "dim": model["dim"], "normalized": model["normalize"], "dtype": "float32",
            "shard_rows": shard_rows, "num_shards": num_shards(rows, shard_rows)}


def _write_shard(path: Path, first_row: int, ids: list[str], texts: list[str], emb: np.ndarray) -> None:
    import pyarrow as pa

    flat = pa.array(np.ascontiguousarray(emb, dtype=np.float32).reshape(-1), type=pa.float32())
    write_parquet_atomic({
        "row": pa.array(np.arange(first_row, first_row + len(ids), dtype=np.int64)),
        "id": pa.array(ids, type=pa.string()),
        "text": pa.array(texts, type=pa.string()),
        "embedding": pa.FixedSizeListArray.from_arrays(flat, emb.shape[1]),
    }, path)


def run_embedding(model_path: str | Path, inputs: Sequence[str | Path], out_dir: str | Path, *,
                  batch_size: int = 64, max_seq_length: int | None = None, shard_rows: int = 10000,
                  progress: bool = True, model=None, device: str | None = None) -> dict:
    """Embed every row not yet embedded in ``out_dir``; return the manifest (rank 0) or the plan
    with this rank's ``last_run``. ``model``: the bi-encoder already loaded from ``model_path``."""
    from bertdist.train.distributed import local_device

    for name, v in (("batch_size", batch_size), ("shard_rows", shard_rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"{name} must be a positive integer, got {v!r}")
    if max_seq_length is not None and (isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int)
                                       or max_seq_length < 2):
        raise DataError(f"max_seq_length must be an integer >= 2 ([CLS] and [SEP]), got {max_seq_length!r}")
    sources = read_inputs(inputs)  # input errors before the model is loaded
    if model is None:
        from bertdist.embed.model import load_bi_encoder

        model = load_bi_encoder(model_path, device=device or local_device())
    limit = model.config.max_position_embeddings
    if max_seq_length is not None and max_seq_length > limit:
        raise DataError(f"max_seq_length {max_seq_length} is longer than the model's {limit} positions "
                        f"({model_path})")
    plan = make_plan(model_identity(model, model_path, max_seq_length), sources, shard_rows)
    ids = [i for s in sources for i in s.ids]
    texts = [t for s in sources for t in s.texts]

    def write_shard(path: Path, lo: int, hi: int) -> None:
        emb = model.encode(texts[lo:hi], batch_size=batch_size, max_seq_length=plan["model"]["max_seq_length"])
        _write_shard(path, lo, ids[lo:hi], texts[lo:hi], emb)

    return run_sharded(out_dir, plan, write_shard, mismatch=EmbeddingSetMismatch, what="embeddings",
                       verb="embedded", desc="embedding", unit="text", progress=progress,
                       shard_entry=lambda name, lo, hi: {"file": name, "rows": hi - lo})


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
    return read_set_manifest(
        emb_dir, (FORMAT,), absent="not an embedding directory (`bertdist embed --out`)",
        unfinished="an unfinished embedding job (rerun `bertdist embed` with the same arguments to finish it)")


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
