"""Hard negatives for a run's train rows: a row's listed negatives first, topped up to
``num_negatives`` from a mined set (``hard_negatives: DIR``, or ``mine: bm25`` mined here over the
distinct positives of the train file and saved under ``OUT/negatives``). Never the row's positive
nor a positive of another row with the same query."""
from __future__ import annotations

import json
from pathlib import Path

from bertdist.embed.config import EmbedConfig, resolved_mine, resolved_negatives
from bertdist.embed.data import PairExample, TrainData
from bertdist.finetune.errors import DataError


def positives_corpus(rows: list[PairExample]) -> list[str]:
    """The distinct positives of ``rows``, in order of first appearance: the corpus a set mined
    from a train file's own positives indexes (a prefix of the rows gives a prefix of it)."""
    return list(dict.fromkeys(r.positive for r in rows))


def _read_corpus_file(path: Path) -> list[str]:
    """A corpus a mined set names: JSONL rows with a "text" key, or one passage per line."""
    from bertdist.finetune.errors import not_utf8

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None
    if path.suffix.lower() != ".jsonl":
        return [x for x in lines if x.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); a corpus JSONL has one "
                            '{"text": ...} per line') from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataError(f"{path}:{n}: expected an object with a \"text\" string")
        out.append(row["text"])
    return out


def _mine(cfg: EmbedConfig, data: TrainData, out: Path, rank: int, barrier) -> Path:
    """Mine BM25 negatives for every train row (rank 0) and write the set under OUT/negatives."""
    from bertdist.retrieval.bm25 import mine_hard_negatives, write_negative_set

    set_dir = out / "negatives"
    if rank == 0:
        corpus = positives_corpus(data.all_rows)
        index = {t: i for i, t in enumerate(corpus)}
        by_query: dict[str, set[int]] = {}
        for r in data.all_rows:
            by_query.setdefault(r.query, set()).add(index[r.positive])
        k = resolved_negatives(cfg)
        mined = mine_hard_negatives([r.query for r in data.rows], [sorted(by_query[r.query]) for r in data.rows],
                                    corpus, k, skip_top=cfg.mine_skip_top, depth=cfg.mine_depth or k,
                                    margin=cfg.mine_margin)
        write_negative_set(set_dir, mined, {"queries": data.train_path, "corpus": data.train_path})
    if barrier is not None:
        barrier()
    return set_dir


def _mined_negatives(set_dir: str | Path, data: TrainData) -> tuple[dict[int, list[str]], dict]:
    """Row index -> mined negative texts from a set made for this train file."""
    from bertdist.data.manifest import file_sha256
    from bertdist.retrieval.bm25 import NegativeSetMismatch, read_negative_set

    mined = read_negative_set(set_dir, {"queries": data.train_path})
    recorded = {s["role"]: s for s in mined.manifest.get("sources", [])}
    corpus_src = recorded.get("corpus")
    if corpus_src is None or corpus_src["sha256"] == recorded["queries"]["sha256"]:
        corpus = positives_corpus(data.all_rows)
    else:
        cpath = Path(corpus_src["path"])
        if not cpath.is_file():
            raise DataError(f"{Path(set_dir) / 'manifest.json'}: the set's corpus file {cpath} is not there")
        if file_sha256(cpath) != corpus_src["sha256"]:
            raise NegativeSetMismatch(f"{Path(set_dir) / 'manifest.json'}: mined from the corpus file {cpath} with "
                                      f"sha256 {corpus_src['sha256']}, but it now has sha256 {file_sha256(cpath)}")
        corpus = _read_corpus_file(cpath)
    out: dict[int, list[str]] = {}
    for r in mined.rows:
        if r.query_index >= len(data.rows):
            continue
        bad = [d for d in r.negative_ids if not 0 <= d < len(corpus)]
        if bad:
            raise DataError(f"{Path(set_dir) / 'negatives.parquet'}: query {r.query_index} names documents {bad[:5]} "
                            f"outside its corpus of {len(corpus)} texts")
        out[r.query_index] = [corpus[d] for d in r.negative_ids]
    info = {"set": str(set_dir), "method": mined.method.get("name"), "k": mined.k, "window": mined.window,
            "counts": mined.counts}
    return out, info


def row_negatives(cfg: EmbedConfig, data: TrainData, out: Path, rank: int, barrier) -> tuple[list[list[str]], dict]:
    """Each train row's negative pool: its listed negatives, then mined ones up to num_negatives;
    never the row's positive nor a positive of another row with the same query."""
    k = resolved_negatives(cfg)
    mine = resolved_mine(cfg)
    set_dir = cfg.hard_negatives
    if mine == "bm25":
        set_dir = _mine(cfg, data, out, rank, barrier)
    mined, info = ({}, {"set": None})
    if set_dir is not None:
        mined, info = _mined_negatives(set_dir, data)
    positives: dict[str, set[str]] = {}
    for r in data.all_rows:
        positives.setdefault(r.query, set()).add(r.positive)
    pools, listed, topped, without = [], 0, 0, 0
    for i, r in enumerate(data.rows):
        own = [n for n in dict.fromkeys(r.negatives) if n not in positives[r.query]]
        pool = list(own)
        if len(pool) < k:
            extra = [n for n in mined.get(i, []) if n not in positives[r.query] and n not in pool]
            pool += extra[:k - len(pool)]
            topped += bool(extra)
        listed += bool(own)
        without += not pool
        pools.append(pool)
    info.update(num_negatives=k, mine=mine, rows=len(data.rows), rows_with_listed_negatives=listed,
                rows_with_mined_negatives=topped, rows_without_negatives=without)
    return pools, info
