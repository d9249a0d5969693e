"""Search an index (``bertdist search``): dense retrieval, optionally fused with BM25 and re-ranked
by a cross-encoder.

``search(index, queries, k)`` returns, per query, the top k ``Hit``s (id, score, text):

1. dense: the queries are embedded with the model the index's documents were embedded with (the
   index's, unless another directory *with the same hash* is named: any other model is refused,
   since its vectors live in another space) and searched, cosine score;
2. ``hybrid="bm25"``: the dense ranking and a BM25 ranking over the index's texts, each
   ``fusion_depth`` deep (BM25 documents that share no term with the query are left out: their
   order is arbitrary), fused by reciprocal rank fusion (``metrics.reciprocal_rank_fusion``,
   constant ``rrf_k`` = 60); the score is the fused one;
3. ``rerank``: a cross-encoder scores (query, text) for the first ``rerank_top`` candidates, which
   are re-ordered by that score (its raw logit); the score is the cross-encoder's.

Each hit also carries ``scores``: every stage's score for it (``dense``, ``bm25``, ``rrf``,
``rerank``) where that stage ran and saw it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from bertdist.finetune.errors import DataError
from bertdist.retrieval.index import IndexModelMismatch, VectorIndex, load_index

HYBRID = ("bm25",)


@dataclasses.dataclass
class Hit:
    id: str
    score: float
    text: str
    row: int  # the document's position in the index
    scores: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "score": self.score, "text": self.text, "scores": self.scores}


@dataclasses.dataclass
class QueryModel:
    """A bi-encoder with the identity of the directory it was loaded from."""
    model: object
    path: Path
    sha256: str


def load_query_model(path: str | Path, device: str = "cpu") -> QueryModel:
    from bertdist.embed.model import load_bi_encoder
    from bertdist.stored_set import model_sha256

    p = Path(path)
    return QueryModel(load_bi_encoder(p, device=device), p, model_sha256(p))


def check_query_model(index: VectorIndex, qm: QueryModel) -> None:
    """Refuse a query model that is not the one the index's documents were embedded with."""
    want = index.meta["model"]
    where = index.directory / "index.json"
    if qm.sha256 != want["sha256"]:
        raise IndexModelMismatch(
            f"{where}: the documents were embedded with {want['path']} (model sha256 {want['sha256']}), the query "
            f"model {qm.path} has sha256 {qm.sha256}: its vectors are not comparable; search with the index's model "
            "or embed and index the documents again with this one")
    m = qm.model
    have = {"pooling": m.pooling, "normalize": m.normalize, "truncate_dim": m.truncate_dim, "dim": int(m.dim)}
    diff = [f"{k}: index has {want.get(k)!r}, query model has {v!r}" for k, v in have.items() if want.get(k) != v]
    if diff:
        raise IndexModelMismatch(f"{where}: the query model {qm.path} is loaded differently from the one the "
                                 "documents were embedded with: " + "; ".join(diff))


def _check_args(k, rerank_top, fusion_depth, hybrid, rerank) -> None:
    for name, v in (("k", k), ("rerank_top", rerank_top), ("fusion_depth", fusion_depth)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise DataError(f"{name} must be a positive integer, got {v!r}")
    if hybrid is not None and hybrid not in HYBRID:
        raise DataError(f"hybrid {hybrid!r} is not one of {list(HYBRID)}")
    if rerank is not None and rerank_top < k:
        raise DataError(f"rerank_top {rerank_top} is less than k {k}: the re-ranked list would hold only "
                        f"{rerank_top} hits; re-rank at least k")
    if hybrid is not None and fusion_depth < k:
        raise DataError(f"fusion_depth {fusion_depth} is less than k {k}: fuse at least k of each ranking")


def search(index: VectorIndex | str | Path, queries: Sequence[str], k: int = 10, *,
           model: QueryModel | str | Path | None = None, query_embeddings: np.ndarray | None = None,
           rerank=None, rerank_top: int = 20, hybrid: str | None = None, rrf_k: float = 60,
           fusion_depth: int = 100, batch_size: int = 64, max_seq_length: int | None = None) -> list[list[Hit]]:
    """The top ``k`` hits of each query (see the module doc). ``model``: a ``QueryModel``, a model
    directory, or None for the one the index names; ``query_embeddings``: the queries' vectors,
    already computed with the index's model (the model is then not loaded; benchmarks);
    ``rerank``: a cross-encoder (``score(pairs)``) or its directory."""
    from bertdist.retrieval.metrics import reciprocal_rank_fusion

    vi = index if isinstance(index, VectorIndex) else load_index(index)
    queries = list(queries)
    if not queries:
        raise DataError("no query: give --query TEXT or --query-file FILE")
    bad = next((i for i, q in enumerate(queries) if not isinstance(q, str) or not q.strip()), None)
    if bad is not None:
        raise DataError(f"query {bad + 1} is empty or not text: {queries[bad]!r:.80}")
    _check_args(k, rerank_top, fusion_depth, hybrid, rerank)
    if query_embeddings is None:
        if model is None:
            named = Path(vi.meta["model"]["path"])
            if not named.exists():
                raise DataError(f"{vi.directory / 'index.json'}: the index's model {named} is not there; name a copy "
                                "of it with --model")
            model = named
        qm = model if isinstance(model, QueryModel) else load_query_model(model)
        check_query_model(vi, qm)
        query_embeddings = qm.model.encode(queries, batch_size=batch_size, max_seq_length=max_seq_length)
    q = np.asarray(query_embeddings, dtype=np.float32)
    if q.ndim != 2 or len(q) != len(queries):
        raise DataError(f"{len(queries)} queries but query embeddings of shape {tuple(q.shape)}")
    depth = max(k, rerank_top if rerank is not None else 0, fusion_depth if hybrid else 0)
    dense_scores, dense_rows = vi.search(q, depth)
    candidates: list[list[Hit]] = []
    for qi in range(len(queries)):
        keep = dense_rows[qi] >= 0
        rows, scores = dense_rows[qi][keep], dense_scores[qi][keep]
        candidates.append([Hit(vi.ids[r], float(s), vi.texts[r], int(r), {"dense": float(s)})
                           for r, s in zip(rows, scores)])
    if hybrid == "bm25":
        bm25 = vi.bm25()
        b_rows, b_scores = bm25.search(queries, min(fusion_depth, len(vi)))
        fused_lists = []
        for qi, hits in enumerate(candidates):
            dense = {h.row: h for h in hits[:fusion_depth]}
            lexical = {int(r): float(s) for r, s in zip(b_rows[qi], b_scores[qi]) if s > 0}
            fused = reciprocal_rank_fusion([list(dense), list(lexical)], k=rrf_k)
            out = []
            for row, score in fused:
                h = dense.get(row) or Hit(vi.ids[row], 0.0, vi.texts[row], row, {})
                h.score = float(score)
                h.scores["rrf"] = float(score)
                if row in lexical:
                    h.scores["bm25"] = lexical[row]
                out.append(h)
            fused_lists.append(out)
        candidates = fused_lists
    if rerank is not None:
        ce = rerank
        if isinstance(rerank, (str, Path)):
            from bertdist.embed.model import load_cross_encoder

            ce = load_cross_encoder(rerank)
        pools = [hits[:rerank_top] for hits in candidates]
        pairs = [(queries[qi], h.text) for qi, hits in enumerate(pools) for h in hits]
        ce_scores = np.asarray(ce.score(pairs), dtype=np.float32).reshape(-1) if pairs else np.zeros(0)
        if len(ce_scores) != len(pairs):
            raise DataError(f"the cross-encoder returned {len(ce_scores)} scores for {len(pairs)} pairs")
        at = 0
        for qi, hits in enumerate(pools):
            for h in hits:
                h.score = h.scores["rerank"] = float(ce_scores[at])
                at += 1
            candidates[qi] = sorted(hits, key=lambda h: -h.score)  # stable: ties keep the retrieval order
    return [hits[:k] for hits in candidates]


def format_hits(queries: Sequence[str], results: Sequence[Sequence[Hit]], width: int = 100) -> str:
    """The hits as text: a line per query, then ``rank  score  id  text`` per hit."""
    lines = []
    for q, hits in zip(queries, results):
        lines.append(f"query: {q}")
        for rank, h in enumerate(hits, 1):
            text = " ".join(h.text.split())
            text = text if len(text) <= width else text[:width - 3] + "..."
            lines.append(f"{rank:>3}  {h.score:9.4f}  {h.id}  {text}")
        if not hits:
            lines.append("  (no hits)")
    return "\n".join(lines)
