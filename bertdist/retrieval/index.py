"""Vector indexes over an embedding set (``bertdist index``), with FAISS (``faiss-cpu``).

Every index scores by inner product on L2-normalised vectors, i.e. cosine similarity: the
stored vectors are normalised when the index is built (a no-op for a normalising model) and
queries when they are searched. Kinds:

* ``flat``: exact search (``IndexFlatIP``), every vector compared; the reference the others are
  measured against;
* ``hnsw``: a graph (``IndexHNSWFlat``): ``m`` neighbours per node, ``ef_construction`` candidates
  while building, ``ef_search`` while searching (more: higher recall, slower). No training;
  the default (the measurement in docs/embeddings.md);
* ``ivf``: an inverted file over ``nlist`` k-means cells (``IndexIVFFlat``), ``nprobe`` cells
  visited per query. Needs training on the vectors; default ``nlist`` = 4 sqrt(N), at most N / 39
  (FAISS wants 39 training points per centroid), ``nprobe`` = nlist / 4.

An index directory holds ``index.faiss`` (the FAISS file), ``rows.parquet`` (each row's ``id`` and
``text``, in the index's order) and ``index.json``, written last: the kind and its parameters,
the dimension, the row count, and the embedding set's model record (its hash among it), so that
``search`` refuses a query model other than the one the documents were embedded with.

``approximate_recall`` measures an approximate index against exact search over the same vectors:
recall@k = |approximate top k ∩ exact top k| / k, averaged over the queries, and queries per second.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from bertdist.data.manifest import file_sha256, path_inside
from bertdist.finetune.errors import DataError

FORMAT = "bertdist-vector-index/1"
KINDS = ("flat", "hnsw", "ivf")
INDEX_FILE = "index.faiss"
ROWS_FILE = "rows.parquet"
META = "index.json"


class IndexModelMismatch(DataError):
    """A query model other than the one the index's documents were embedded with."""


def _faiss():
    import faiss

    return faiss


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def normalized(x: np.ndarray) -> np.ndarray:
    """Row-wise L2-normalised float32 copy (a zero row stays zero)."""
    x = np.array(x, dtype=np.float32, copy=True, ndmin=2)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    np.divide(x, norms, out=x, where=norms > 0)
    return x


def default_nlist(n: int) -> int:
    return max(1, min(int(round(4 * math.sqrt(n))), n // 39))


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise DataError(f"{name} must be a positive integer, got {v!r}")
    return v


def index_params(kind: str, n: int, *, hnsw_m: int = 32, ef_construction: int = 200, ef_search: int = 128,
                 nlist: int | None = None, nprobe: int | None = None) -> dict:
    """The parameters an index of ``kind`` over ``n`` vectors is built and searched with."""
    if kind not in KINDS:
        raise DataError(f"index kind {kind!r} is not one of {list(KINDS)}")
    if kind == "flat":
        return {}
    if kind == "hnsw":
        return {"m": _positive_int("hnsw_m", hnsw_m),
                "ef_construction": _positive_int("ef_construction", ef_construction),
                "ef_search": _positive_int("ef_search", ef_search)}
    nlist = default_nlist(n) if nlist is None else _positive_int("nlist", nlist)
    if nlist > n:
        raise DataError(f"nlist {nlist} is more than the {n} vectors to cluster: at most {n} (FAISS wants 39 "
                        f"vectors per cell: {max(1, n // 39)} here)")
    # nlist/4: recall@10 0.99 on 19k MiniLM vectors (nlist/8 gave 0.98; docs/embeddings.md)
    nprobe = max(1, nlist // 4) if nprobe is None else _positive_int("nprobe", nprobe)
    return {"nlist": nlist, "nprobe": min(nprobe, nlist)}


def make_faiss_index(kind: str, dim: int, params: dict, vectors: np.ndarray):
    """A FAISS index of ``kind`` holding ``vectors`` (already normalised), in their order."""
    faiss = _faiss()
    ip = faiss.METRIC_INNER_PRODUCT
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, params["m"], ip)
        index.hnsw.efConstruction = params["ef_construction"]
        index.hnsw.efSearch = params["ef_search"]
    else:
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, params["nlist"], ip)
        index.cp.seed = 1234  # k-means initialisation: the same vectors give the same index
        index.train(vectors)
        index.nprobe = params["nprobe"]
    index.add(vectors)
    return index


def _write_rows(path: Path, ids: list[str], texts: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(pa.table({"id": pa.array(ids, type=pa.string()), "text": pa.array(texts, type=pa.string())}), tmp)
    os.replace(tmp, path)


def build_index(embeddings_dir: str | Path, out_dir: str | Path, kind: str = "hnsw", *, hnsw_m: int = 32,
                ef_construction: int = 200, ef_search: int = 128, nlist: int | None = None,
                nprobe: int | None = None) -> dict:
    """Build an index of ``kind`` over a finished embedding set into ``out_dir``; returns index.json."""
    from bertdist.retrieval.embed_job import read_embeddings
    from bertdist.stored_set import MANIFEST

    faiss = _faiss()
    emb = read_embeddings(embeddings_dir)
    n, dim = emb.vectors.shape
    if n == 0:
        raise DataError(f"{embeddings_dir}: the embedding set has no rows to index")
    params = index_params(kind, n, hnsw_m=hnsw_m, ef_construction=ef_construction, ef_search=ef_search,
                          nlist=nlist, nprobe=nprobe)
    t0 = time.time()
    vectors = normalized(emb.vectors)
    index = make_faiss_index(kind, dim, params, vectors)
    seconds = time.time() - t0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)  # until the new files are all there, the directory is no index
    tmp = out / f".{INDEX_FILE}.tmp-{os.getpid()}"
    faiss.write_index(index, str(tmp))
    os.replace(tmp, out / INDEX_FILE)
    _write_rows(out / ROWS_FILE, emb.ids, emb.texts)
    meta = {"format": FORMAT, "kind": kind, "params": params, "metric": "cosine (inner product on normalised vectors)",
            "dim": int(dim), "count": int(n), "model": emb.manifest["model"],
            "embeddings": {"path": str(embeddings_dir),
                           "manifest_sha256": file_sha256(Path(embeddings_dir) / MANIFEST),
                           "normalized": emb.manifest.get("normalized")},
            "files": {"index": INDEX_FILE, "rows": ROWS_FILE},
            "index_sha256": file_sha256(out / INDEX_FILE), "build_seconds": round(seconds, 3),
            "faiss_version": _version("faiss-cpu"), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = out / f".{META}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / META)
    return meta


class VectorIndex:
    """A loaded index directory: ``search(vectors, k)`` -> (scores, row positions), ``ids``, ``texts``."""

    def __init__(self, directory: Path, meta: dict, index, ids: list[str], texts: list[str]):
        self.directory = directory
        self.meta = meta
        self.index = index
        self.ids = ids
        self.texts = texts
        self._bm25 = None

    @property
    def kind(self) -> str:
        return self.meta["kind"]

    @property
    def dim(self) -> int:
        return int(self.meta["dim"])

    def __len__(self) -> int:
        return len(self.ids)

    def set_search_params(self, *, ef_search: int | None = None, nprobe: int | None = None) -> None:
        if ef_search is not None:
            if self.kind != "hnsw":
                raise DataError(f"{self.directory}: ef_search is an HNSW parameter; this index is {self.kind}")
            self.index.hnsw.efSearch = _positive_int("ef_search", ef_search)
        if nprobe is not None:
            if self.kind != "ivf":
                raise DataError(f"{self.directory}: nprobe is an IVF parameter; this index is {self.kind}")
            self.index.nprobe = _positive_int("nprobe", nprobe)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``[Q, min(k, N)]`` cosine scores (float32) and row positions (int64), best first. An
        approximate index may find fewer than k: missing places are position -1, score -inf."""
        _positive_int("k", k)
        q = normalized(queries)
        if q.shape[1] != self.dim:
            raise DataError(f"{self.directory}: queries of width {q.shape[1]}, the index holds {self.dim}-wide "
                            "vectors")
        scores, pos = self.index.search(q, min(k, len(self)))
        scores = np.where(pos >= 0, scores, -np.inf).astype(np.float32)
        return scores, pos.astype(np.int64)

    def vectors(self) -> np.ndarray:
        """Every stored (normalised) vector, in row order: the exact reference for an approximate index."""
        index = self.index
        if self.kind == "ivf":
            index.make_direct_map()
        return index.reconstruct_n(0, index.ntotal)

    def bm25(self):
        """A BM25 index over the texts, built on first use (hybrid search)."""
        if self._bm25 is None:
            from bertdist.retrieval.bm25 import BM25Index

            self._bm25 = BM25Index(self.texts)
        return self._bm25


def _check_meta(meta: dict, mpath: Path) -> None:
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    files, model, params = meta.get("files"), meta.get("model"), meta.get("params")
    ok = (meta.get("kind") in KINDS and count(meta.get("dim")) and count(meta.get("count"))
          and isinstance(files, dict) and all(isinstance(files.get(k), str) for k in ("index", "rows"))
          and isinstance(model, dict) and isinstance(model.get("sha256"), str) and isinstance(params, dict))
    if not ok:
        raise DataError(f"{mpath}: wrong layout: expected kind (one of {list(KINDS)}), params, dim, count, model "
                        "(with sha256) and files (index, rows) as `bertdist index` writes them")


def load_index(index_dir: str | Path, *, ef_search: int | None = None, nprobe: int | None = None) -> VectorIndex:
    import pyarrow.parquet as pq

    faiss = _faiss()
    d = Path(index_dir)
    mpath = d / META
    if not mpath.is_file():
        raise DataError(f"{d}: no {META}: not an index directory (`bertdist index --out`), or its build did not finish")
    try:
        meta = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        have = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{mpath}: format {have!r}, expected {FORMAT!r}")
    _check_meta(meta, mpath)
    ipath = path_inside(d, meta["files"]["index"], mpath, DataError)
    rpath = path_inside(d, meta["files"]["rows"], mpath, DataError)
    try:
        index = faiss.read_index(str(ipath))
    except RuntimeError as e:  # FAISS reports a missing or corrupt file this way
        raise DataError(f"{ipath}: not a readable FAISS index ({str(e).splitlines()[0] if str(e) else e}); "
                        "build it again with `bertdist index`") from None
    try:
        rows = pq.read_table(rpath)
    except (OSError, ValueError) as e:
        raise DataError(f"{rpath}: not a readable rows file ({type(e).__name__}: {e})") from None
    if not index.ntotal == rows.num_rows == meta["count"] or index.d != meta["dim"]:
        raise DataError(f"{d}: {ipath.name} holds {index.ntotal} vectors of width {index.d}, {rpath.name} "
                        f"{rows.num_rows} rows, {META} says {meta['count']} of width {meta['dim']}: build the index "
                        "again")
    out = VectorIndex(d, meta, index, rows.column("id").to_pylist(), rows.column("text").to_pylist())
    out.set_search_params(ef_search=ef_search, nprobe=nprobe)
    return out


def _as_index(index) -> VectorIndex:
    return index if isinstance(index, VectorIndex) else load_index(index)


def queries_per_second(index, queries: np.ndarray, k: int = 10, *, batch: int = 1, min_seconds: float = 0.5) -> float:
    """Queries searched per second, ``batch`` queries a call (1: one request at a time), repeated
    over the queries until ``min_seconds`` have passed."""
    vi = _as_index(index)
    q = normalized(queries)
    done, t0 = 0, time.perf_counter()
    while True:
        for i in range(0, len(q), batch):
            vi.index.search(q[i:i + batch], k)
        done += len(q)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return done / elapsed


def approximate_recall(index_dir, queries_embeddings: np.ndarray, k: int = 10, *, ef_search: int | None = None,
                       nprobe: int | None = None, min_seconds: float = 0.5) -> dict:
    """recall@k of the index against exact (flat) search over its own vectors, and queries per
    second of both, one query a call and all in one batch. Ties at the exact top k's cut may count
    as misses; on real embeddings they are rare. ``ef_search``/``nprobe`` set the search width
    (on a loaded index, in place)."""
    vi = _as_index(index_dir)
    vi.set_search_params(ef_search=ef_search, nprobe=nprobe)
    q = normalized(queries_embeddings)
    if len(q) == 0:
        raise DataError("approximate_recall needs at least one query embedding")
    faiss = _faiss()
    exact = faiss.IndexFlatIP(vi.dim)
    exact.add(vi.vectors())
    width = min(k, len(vi))
    _, want = exact.search(q, width)
    _, got = vi.index.search(q, width)
    recall = float(np.mean([len(set(a) & set(b[b >= 0])) / width for a, b in zip(want, got)]))
    exact_vi = VectorIndex(vi.directory, {**vi.meta, "kind": "flat"}, exact, vi.ids, vi.texts)
    return {"kind": vi.kind, "params": {**vi.meta["params"], **_live_params(vi)}, "count": len(vi), "queries": len(q),
            "k": k, f"recall@{k}": recall,
            "queries_per_second": queries_per_second(vi, q, k, batch=1, min_seconds=min_seconds),
            "queries_per_second_batched": queries_per_second(vi, q, k, batch=len(q), min_seconds=min_seconds),
            "exact_queries_per_second": queries_per_second(exact_vi, q, k, batch=1, min_seconds=min_seconds),
            "exact_queries_per_second_batched": queries_per_second(exact_vi, q, k, batch=len(q),
                                                                   min_seconds=min_seconds)}


def _live_params(vi: VectorIndex) -> dict:
    if vi.kind == "hnsw":
        return {"ef_search": int(vi.index.hnsw.efSearch)}
    if vi.kind == "ivf":
        return {"nprobe": int(vi.index.nprobe)}
    return {}
