"""BM25 retrieval (the ``bm25s`` library) and BM25-mined hard negatives.

``BM25Index(texts)`` indexes a corpus with bm25s's tokenizer (lower-cased, words of two or more
word characters, English stop words removed, no stemming) and its Lucene BM25 (k1 = 1.5,
b = 0.75). ``search`` returns each query's top ``k`` document indices and scores. The top k is
taken here from bm25s's scores, ordering equal scores by document index: bm25s's own selection
orders ties arbitrarily, and mined negatives must not change between two runs.

``mine_hard_negatives`` takes each query's negatives from a window of its BM25 ranking: the
query's positives are removed from the ranking, the first ``skip_top`` of the rest are skipped
(the documents that score above the positive are often unlabelled positives), and up to ``k``
negatives come from the next ``depth`` ranks (``depth`` defaults to ``k``). With ``margin`` m,
a candidate is kept only when its score is at most (1 - m) times the positive's score (the
lowest-scoring positive's, when a query has several). Documents that share no term with the
query (score 0) are never taken: they are not hard, and their order is arbitrary. A query may
so end up with fewer than k negatives; the counts say how many did.

A mined set is one Parquet file and a manifest (written last, through a temporary name, as the
pseudo-label sets are): the method and its parameters, k, the window, the counts, and the
sha256 of the source files it was mined from, so that ``read_negative_set`` refuses a set made
from another queries or corpus file than the one a run names.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from bertdist.data.manifest import file_sha256, path_inside
from bertdist.finetune.errors import DataError

FORMAT = "bertdist-hard-negatives/1"
MANIFEST = "manifest.json"
ROWS_FILE = "negatives.parquet"


class NegativeSetMismatch(DataError):
    """A mined set made from other source files than the ones a run names."""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores, best first, equal scores by ascending index."""
    n = len(scores)
    k = min(k, n)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    if k < n:
        kth = np.partition(scores, n - k)[n - k]
        cand = np.flatnonzero(scores >= kth)  # every tie at the cut, in index order
    else:
        cand = np.arange(n)
    return cand[np.argsort(-scores[cand], kind="stable")[:k]].astype(np.int64)


class BM25Index:
    """A BM25 index over ``texts``; documents are their positions in ``texts``."""

    def __init__(self, texts: Sequence[str], *, k1: float = 1.5, b: float = 0.75, method: str = "lucene",
                 stopwords: str | list[str] | None = "en", lower: bool = True):
        import bm25s
        from bm25s.tokenization import Tokenizer

        texts = list(texts)
        if not texts:
            raise ValueError("BM25Index needs at least one document")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"document {bad} is a {type(texts[bad]).__name__}, not text")
        self.params = {"library": "bm25s", "library_version": _version("bm25s"), "k1": k1, "b": b,
                       "method": method, "stopwords": stopwords, "lower": lower, "stemmer": None}
        self.tokenizer = Tokenizer(lower=lower, stopwords=stopwords)
        ids = self.tokenizer.tokenize(texts, update_vocab=True, return_as="ids", show_progress=False)
        vocab = self.tokenizer.get_vocab_dict()
        self._empty = vocab.get("")  # bm25s's token for a text with no words: never a query term here
        self.retriever = bm25s.BM25(k1=k1, b=b, method=method)
        self.retriever.index((ids, vocab), show_progress=False)
        self.size = len(texts)

    def _query_ids(self, queries: Sequence[str]) -> list[list[int]]:
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        return [[t for t in q if t != self._empty] for q in ids]  # unknown words are already dropped

    def iter_scores(self, queries: Sequence[str]):
        """Each query's ``[N]`` BM25 scores over the corpus (0 where no term is shared), in order."""
        zeros = np.zeros(self.size, dtype=np.float32)
        for q in self._query_ids(queries):
            yield self.retriever.get_scores_from_ids(q).astype(np.float32, copy=False) if q else zeros

    def scores(self, queries: Sequence[str]) -> np.ndarray:
        """``[Q, N]`` scores of every document for every query."""
        return np.stack(list(self.iter_scores(queries))) if len(queries) else np.zeros((0, self.size), np.float32)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """``ids [Q, min(k, N)]`` (int64, best first) and their ``scores`` (float32)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        width = min(k, self.size)
        ids = np.zeros((len(queries), width), dtype=np.int64)
        scores = np.zeros((len(queries), width), dtype=np.float32)
        for i, s in enumerate(self.iter_scores(queries)):
            ids[i] = top_k(s, width)
            scores[i] = s[ids[i]]
        return ids, scores


# ---------------------------------------------------------------- hard negatives
@dataclasses.dataclass(frozen=True)
class MinedRow:
    query_index: int
    positive_ids: tuple[int, ...]
    positive_score: float  # the lowest BM25 score among the positives (the margin's reference)
    negative_ids: tuple[int, ...]
    negative_scores: tuple[float, ...]


@dataclasses.dataclass
class MinedSet:
    rows: list[MinedRow]
    method: dict
    k: int
    window: dict
    counts: dict
    manifest: dict | None = None  # set when read back


def mine_hard_negatives(queries: Sequence[str], positive_ids: Sequence[Iterable[int]],
                        corpus: Sequence[str] | BM25Index, k: int, *, skip_top: int = 0, depth: int | None = None,
                        margin: float | None = None) -> MinedSet:
    """Up to ``k`` BM25 hard negatives per query from the rank window (see the module doc).
    ``positive_ids[i]``: the corpus indices of query i's positives (at least one); ``corpus``: the
    texts, or an index already built over them."""
    index = corpus if isinstance(corpus, BM25Index) else BM25Index(corpus)
    n = index.size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if isinstance(skip_top, bool) or not isinstance(skip_top, int) or skip_top < 0:
        raise ValueError(f"skip_top must be a non-negative integer, got {skip_top!r}")
    depth = k if depth is None else depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < k:
        raise ValueError(f"depth must be an integer >= k = {k}, got {depth!r}")
    if margin is not None and not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1) (a fraction of the positive's score), got {margin!r}")
    if len(queries) != len(positive_ids):
        raise ValueError(f"{len(queries)} queries but {len(positive_ids)} positive-id lists")
    positives = []
    for i, p in enumerate(positive_ids):
        p = tuple(int(x) for x in p)
        if not p:
            raise ValueError(f"query {i} has no positive document")
        out_of_range = [x for x in p if not 0 <= x < n]
        if out_of_range:
            raise ValueError(f"query {i}: positive ids {out_of_range} are outside the corpus (0..{n - 1})")
        positives.append(p)

    rows = []
    for i, scores in enumerate(index.iter_scores(queries)):
        pos = set(positives[i])
        ranking = [d for d in top_k(scores, skip_top + depth + len(pos)) if d not in pos]
        window = ranking[skip_top:skip_top + depth]
        pos_score = float(min(scores[d] for d in pos))
        keep = []
        for d in window:
            s = float(scores[d])
            if s <= 0.0 or (margin is not None and s > (1.0 - margin) * pos_score):
                continue
            keep.append(int(d))
            if len(keep) == k:
                break
        rows.append(MinedRow(i, positives[i], pos_score, tuple(keep), tuple(float(scores[d]) for d in keep)))
    got = [len(r.negative_ids) for r in rows]
    counts = {"queries": len(rows), "corpus": n, "negatives": int(sum(got)),
              "queries_with_k": sum(g == k for g in got), "queries_short": sum(0 < g < k for g in got),
              "queries_without": sum(g == 0 for g in got)}
    window = {"skip_top": skip_top, "depth": depth, "margin": margin, "positives_removed": True,
              "zero_scores_removed": True}
    return MinedSet(rows, {"name": "bm25", **index.params}, k, window, counts)


def _sources(sources: Mapping[str, str | os.PathLike]) -> list[dict]:
    out = []
    for role, path in sources.items():
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{p}: the {role} file is not there (the manifest records each source's sha256)")
        out.append({"role": role, "path": str(p), "sha256": file_sha256(p)})
    return out


def write_negative_set(out_dir: str | Path, mined: MinedSet, sources: Mapping[str, str | os.PathLike]) -> dict:
    """``negatives.parquet`` and ``manifest.json`` in ``out_dir``; ``sources``: role -> the file
    the queries, positives or corpus came from (e.g. ``{"queries": ..., "corpus": ...}``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not sources:
        raise ValueError("name the source files the set was mined from (role -> path): the manifest pins them")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recorded = _sources(sources)
    rows = mined.rows
    table = pa.table({
        "query_index": pa.array([r.query_index for r in rows], type=pa.int64()),
        "positive_ids": pa.array([list(r.positive_ids) for r in rows], type=pa.list_(pa.int64())),
        "positive_score": pa.array([r.positive_score for r in rows], type=pa.float32()),
        "negative_ids": pa.array([list(r.negative_ids) for r in rows], type=pa.list_(pa.int64())),
        "negative_scores": pa.array([list(r.negative_scores) for r in rows], type=pa.list_(pa.float32())),
    })
    tmp = out / f".{ROWS_FILE}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, out / ROWS_FILE)
    manifest = {"format": FORMAT, "file": ROWS_FILE, "method": mined.method, "k": mined.k, "window": mined.window,
                "counts": mined.counts, "sources": recorded, "created_by": f"bertdist {_version('bertdist')}",
                "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    tmp = out / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def read_negative_set(out_dir: str | Path, sources: Mapping[str, str | os.PathLike] | None = None) -> MinedSet:
    """The set in ``out_dir``; with ``sources`` (role -> path), refused unless each named file has
    the sha256 the manifest recorded for that role."""
    import pyarrow.parquet as pq

    d = Path(out_dir)
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise DataError(f"{d}: no {MANIFEST}: not a mined negative set, or its mining did not finish")
    try:
        m = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DataError(f"{mpath}: format {m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT!r}")
    recorded = {s["role"]: s for s in m.get("sources", [])}
    for role, path in (sources or {}).items():
        if role not in recorded:
            raise NegativeSetMismatch(f"{mpath}: the set records no {role} file (it has {sorted(recorded)}); "
                                      f"it was not mined for {path}")
        have = file_sha256(path) if Path(path).is_file() else None
        if have is None:
            raise DataError(f"{path}: the {role} file is not there")
        if have != recorded[role]["sha256"]:
            raise NegativeSetMismatch(
                f"{mpath}: mined from the {role} file {recorded[role]['path']} with sha256 "
                f"{recorded[role]['sha256']}, but {path} has sha256 {have}: the negatives' ids would point at "
                "other rows; mine them again for this file")
    path = path_inside(d, m.get("file", ROWS_FILE), mpath, DataError)
    try:
        t = pq.read_table(path).to_pydict()
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable negative set ({type(e).__name__}: {e})") from None
    rows = [MinedRow(int(q), tuple(p), float(ps), tuple(n), tuple(s)) for q, p, ps, n, s in
            zip(t["query_index"], t["positive_ids"], t["positive_score"], t["negative_ids"], t["negative_scores"])]
    want = m.get("counts", {}).get("queries")
    if want != len(rows):
        raise DataError(f"{path}: {len(rows)} rows, the manifest {mpath} says {want}")
    return MinedSet(rows, m["method"], m["k"], m["window"], m["counts"], manifest=m)


def training_triples(mined: MinedSet, queries: Sequence[str], corpus: Sequence[str]) -> list[dict]:
    """``{"query", "positive", "negatives"}`` rows (the JSONL layout ``bertdist.embed.data`` reads),
    one per (query, positive); queries without negatives keep an empty list."""
    out = []
    for r in mined.rows:
        negs = [corpus[d] for d in r.negative_ids]
        for p in r.positive_ids:
            out.append({"query": queries[r.query_index], "positive": corpus[p], "negatives": negs})
    return out
