"""Dev-set evaluation of bi-encoders and cross-encoders.

* ``sts_eval``: Spearman (the STS-B metric) and Pearson correlation of the cosine similarity of
  each pair's two embeddings with the gold score.
* ``retrieval_eval``: every dev query against one corpus, the distinct texts of all dev positives
  and listed negatives; a query's relevant documents are the positives of every dev row with that
  query text. nDCG@10 (the main metric), Recall@1/5/20 and MRR@10 (``bertdist.retrieval.metrics``),
  ranking by cosine similarity.
* ``rerank_eval``: each dev query's candidates re-ranked by the cross-encoder: its positive and
  listed negatives, or, for a query that lists none, BM25's top ``k`` over the dev positives with
  the positive added when BM25 missed it (as sentence-transformers' re-ranking evaluator does by
  default; ``candidate_recall`` says how often BM25 had it). ``bm25_ndcg@10`` is BM25's own order
  of the same queries, the baseline a re-ranker must beat.

Corpus and candidate orders are shuffled once with a fixed seed, so that a model giving equal
scores gains nothing from where the positives happen to sit in the files.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

import numpy as np

from bertdist.embed.data import PairExample, ScoredPair
from bertdist.retrieval.metrics import mrr_at_k, ndcg_at_k, recall_at_k

MAIN_METRIC = {"embed": "ndcg@10", "sts": "spearman", "rerank": "ndcg@10"}


def sts_eval(model, pairs: Sequence[ScoredPair], batch_size: int = 64, max_seq_length: int | None = None) -> dict:
    from scipy.stats import pearsonr, spearmanr

    a = model.encode([p.text_a for p in pairs], batch_size, max_seq_length)
    b = model.encode([p.text_b for p in pairs], batch_size, max_seq_length)
    cos = cosine_rows(a, b)
    gold = np.array([p.score for p in pairs], dtype=np.float64)
    return {"spearman": float(spearmanr(cos, gold).statistic), "pearson": float(pearsonr(cos, gold).statistic),
            "pairs": len(pairs)}


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(1) / np.maximum(den, 1e-12)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


# ---------------------------------------------------------------- retrieval
@dataclasses.dataclass
class RetrievalDev:
    queries: list[str]
    corpus: list[str]
    relevant: list[set[int]]  # corpus indices per query


def build_retrieval_dev(rows: Sequence[PairExample], seed: int = 0) -> RetrievalDev:
    texts: list[str] = []
    for r in rows:
        texts.append(r.positive)
        texts.extend(r.negatives)
    corpus = list(dict.fromkeys(texts))  # distinct, first appearance
    random.Random(seed).shuffle(corpus)
    index = {t: i for i, t in enumerate(corpus)}
    queries: dict[str, set[int]] = {}
    for r in rows:
        queries.setdefault(r.query, set()).add(index[r.positive])
    return RetrievalDev(list(queries), corpus, list(queries.values()))


def rank_by_similarity(q: np.ndarray, c: np.ndarray, k: int, chunk: int = 1024) -> list[list[int]]:
    """Each query's top ``k`` corpus rows by cosine, best first (queries in chunks: the full
    similarity matrix of a large dev set would not fit in memory)."""
    qn, cn = _unit(q.astype(np.float32)), _unit(c.astype(np.float32))
    k = min(k, c.shape[0])
    out = []
    for lo in range(0, len(qn), chunk):
        for row in qn[lo:lo + chunk] @ cn.T:
            top = np.argpartition(-row, k - 1)[:k] if k < len(row) else np.arange(len(row))
            out.append(top[np.argsort(-row[top], kind="stable")].tolist())
    return out


def retrieval_metrics(ranked: list[list[int]], relevant: list[set[int]]) -> dict:
    return {"ndcg@10": ndcg_at_k(ranked, relevant, 10), "recall@1": recall_at_k(ranked, relevant, 1),
            "recall@5": recall_at_k(ranked, relevant, 5), "recall@20": recall_at_k(ranked, relevant, 20),
            "mrr@10": mrr_at_k(ranked, relevant, 10)}


def retrieval_eval(model, dev: RetrievalDev, batch_size: int = 64, max_seq_length: int | None = None) -> dict:
    q = model.encode(dev.queries, batch_size, max_seq_length)
    c = model.encode(dev.corpus, batch_size, max_seq_length)
    ranked = rank_by_similarity(q, c, 20)
    return {**retrieval_metrics(ranked, dev.relevant), "queries": len(dev.queries), "corpus": len(dev.corpus)}


# ---------------------------------------------------------------- re-ranking
@dataclasses.dataclass
class RerankDev:
    queries: list[str]
    candidates: list[list[str]]
    relevant: list[set[int]]  # indices into the query's candidates
    bm25: dict  # BM25's own metrics on the queries it found candidates for; empty when none needed it


def build_rerank_dev(rows: Sequence[PairExample], k: int = 20, seed: int = 0) -> RerankDev:
    from bertdist.retrieval.bm25 import BM25Index

    rng = random.Random(seed)
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r.query, {"positives": [], "negatives": []})
        g["positives"].append(r.positive)
        g["negatives"].extend(r.negatives)
    pool_texts = list(dict.fromkeys(r.positive for r in rows))
    pool_index = {t: i for i, t in enumerate(pool_texts)}
    need = [q for q, g in groups.items() if not g["negatives"]]
    bm25_ranked, bm25_rel, found = [], [], 0
    if need:
        index = BM25Index(pool_texts)
        ids, _ = index.search(need, k)
        for q, top in zip(need, ids):
            pos_ids = {pool_index[p] for p in groups[q]["positives"]}
            top = [int(d) for d in top]
            bm25_ranked.append(top)
            bm25_rel.append(pos_ids)
            found += bool(pos_ids & set(top))
            groups[q]["bm25"] = [pool_texts[d] for d in top]
    queries, candidates, relevant = [], [], []
    for q, g in groups.items():
        cands = list(dict.fromkeys(g.get("bm25", []) + g["positives"] + g["negatives"]))
        rng.shuffle(cands)
        pos = set(g["positives"])
        queries.append(q)
        candidates.append(cands)
        relevant.append({i for i, t in enumerate(cands) if t in pos})
    bm25 = {}
    if need:
        bm25 = {"bm25_ndcg@10": ndcg_at_k(bm25_ranked, bm25_rel, 10), "candidate_recall": found / len(need),
                "bm25_queries": len(need)}
    return RerankDev(queries, candidates, relevant, bm25)


def rerank_eval(model, dev: RerankDev, batch_size: int = 64, max_seq_length: int | None = None) -> dict:
    pairs = [(q, c) for q, cands in zip(dev.queries, dev.candidates) for c in cands]
    scores = model.score(pairs, batch_size, max_seq_length)
    ranked, start = [], 0
    for cands in dev.candidates:
        s = scores[start:start + len(cands)]
        start += len(cands)
        ranked.append(np.argsort(-s, kind="stable").tolist())
    return {"ndcg@10": ndcg_at_k(ranked, dev.relevant, 10), "mrr@10": mrr_at_k(ranked, dev.relevant, 10),
            "recall@1": recall_at_k(ranked, dev.relevant, 1), "recall@5": recall_at_k(ranked, dev.relevant, 5),
            "queries": len(dev.queries), "candidates": len(pairs), **dev.bm25}
