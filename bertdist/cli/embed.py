"""`bertdist embed`: a bi-encoder's embeddings of text files, as Parquet shards + manifest (data
parallel under torchrun, resumable); `bertdist index`: a FAISS index over them; `bertdist search`:
the top k of queries, optionally hybrid with BM25 and re-ranked by a cross-encoder."""
from __future__ import annotations

import json
import os
import sys

from bertdist.cli.export import add_trust_flag


def _errors():
    from bertdist.export.hf import ExportError
    from bertdist.finetune.errors import DataError

    return (DataError, ExportError, FileNotFoundError)


def run_embed(args) -> int:
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.retrieval.embed_job import run_embedding
    from bertdist.train.distributed import start_process_group

    started = False
    try:
        started = int(os.environ.get("WORLD_SIZE", 1)) > 1 and start_process_group()
        with trust_checkpoints(args.trust_checkpoint):
            m = run_embedding(args.model, args.input, args.out, batch_size=args.batch_size,
                              max_seq_length=args.max_seq_length, shard_rows=args.shard_rows,
                              progress=not args.no_progress, device=args.device)
    except _errors() as e:
        print(f"bertdist embed: {e}", file=sys.stderr)
        return 2
    finally:
        if started:
            import torch

            torch.distributed.destroy_process_group()
    if "shards" in m and m["last_run"]["rank"] == 0:
        s = m["last_run"]
        print(f"{m['rows']} texts, {m['dim']}-wide embeddings, in {m['num_shards']} shards ({s['shards_embedded']} "
              f"embedded now, {s['shards_reused']} already there) -> {args.out}/manifest.json")
    return 0


def run_index(args) -> int:
    from bertdist.retrieval.index import build_index

    try:
        meta = build_index(args.embeddings, args.out, args.kind, hnsw_m=args.hnsw_m,
                           ef_construction=args.ef_construction, ef_search=args.ef_search, nlist=args.nlist,
                           nprobe=args.nprobe)
    except _errors() as e:
        print(f"bertdist index: {e}", file=sys.stderr)
        return 2
    params = ", ".join(f"{k}={v}" for k, v in meta["params"].items())
    print(f"{meta['kind']} index{f' ({params})' if params else ''} over {meta['count']} {meta['dim']}-wide vectors "
          f"in {meta['build_seconds']:.1f} s -> {args.out}/index.json")
    return 0


def _queries(args) -> list[str]:
    from pathlib import Path

    from bertdist.finetune.errors import DataError

    out = list(args.query)
    if args.query_file:
        p = Path(args.query_file)
        if not p.is_file():
            raise DataError(f"{p}: query file not found")
        out += [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    return out


def run_search(args) -> int:
    from bertdist.export.safe_load import trust_checkpoints
    from bertdist.retrieval.index import load_index
    from bertdist.retrieval.search import format_hits, search

    try:
        queries = _queries(args)
        index = load_index(args.index, ef_search=args.ef_search, nprobe=args.nprobe)
        with trust_checkpoints(args.trust_checkpoint):
            results = search(index, queries, args.k, model=args.model, rerank=args.rerank,
                             rerank_top=args.rerank_top, hybrid=args.hybrid, batch_size=args.batch_size)
    except _errors() as e:
        print(f"bertdist search: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"query": q, "hits": [h.to_dict() for h in hits]} for q, hits in zip(queries, results)],
                         indent=2, ensure_ascii=False))
    else:
        print(format_hits(queries, results))
    return 0


def register(sub) -> None:
    p = sub.add_parser("embed", help="embed text files with a bi-encoder: Parquet shards + manifest, resumable, "
                                     "data parallel under torchrun")
    p.add_argument("--model", required=True,
                   help="a bi-encoder: our export or any sentence-transformers directory, or an encoder checkpoint "
                        "(mean pooling, normalised)")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="plain text (one text per line), .jsonl ({\"text\": ..., \"id\": ... optional}) or .tsv "
                        "(id<TAB>text, or a header naming id and text)")
    p.add_argument("--out", required=True, help="the embedding directory (a rerun fills in missing shards)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-seq-length", type=int, default=None,
                   help="truncate texts to this many tokens (default: the model's)")
    p.add_argument("--shard-rows", type=int, default=10000, help="texts per Parquet shard (the unit of resumption)")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when a GPU is there, else cpu")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_trust_flag(p)
    p.set_defaults(func=run_embed)

    q = sub.add_parser("index", help="build a FAISS vector index (flat, hnsw, ivf; cosine) over an embedding directory")
    q.add_argument("--embeddings", required=True, help="a finished `bertdist embed` directory")
    q.add_argument("--out", required=True, help="the index directory")
    q.add_argument("--kind", choices=["flat", "hnsw", "ivf"], default="hnsw",
                   help="flat: exact; hnsw (default): graph, no training; ivf: k-means cells")
    q.add_argument("--hnsw-m", type=int, default=32, help="HNSW: neighbours per node")
    q.add_argument("--ef-construction", type=int, default=200, help="HNSW: candidates while building")
    q.add_argument("--ef-search", type=int, default=128, help="HNSW: candidates while searching (search may override)")
    q.add_argument("--nlist", type=int, default=None, help="IVF: k-means cells (default 4 sqrt(N), at most N/39)")
    q.add_argument("--nprobe", type=int, default=None, help="IVF: cells visited per query (default nlist/4)")
    q.set_defaults(func=run_index)

    s = sub.add_parser("search", help="the top k documents of an index for queries (optionally BM25-hybrid, re-ranked)")
    s.add_argument("--index", required=True, help="a `bertdist index` directory")
    s.add_argument("--query", action="append", default=[], metavar="TEXT", help="a query (repeatable)")
    s.add_argument("--query-file", default=None, help="a file of queries, one per line")
    s.add_argument("--k", type=int, default=10)
    s.add_argument("--model", default=None,
                   help="the query model (default: the one the index names; another must have the same hash)")
    s.add_argument("--rerank", default=None, metavar="CROSS_ENCODER_DIR", help="re-rank with this cross-encoder")
    s.add_argument("--rerank-top", type=int, default=20, help="how many candidates the cross-encoder re-scores")
    s.add_argument("--hybrid", choices=["bm25"], default=None,
                   help="bm25: reciprocal-rank fusion (k=60) of the dense ranking with BM25 over the index's texts")
    s.add_argument("--ef-search", type=int, default=None, help="HNSW: override the index's ef_search")
    s.add_argument("--nprobe", type=int, default=None, help="IVF: override the index's nprobe")
    s.add_argument("--batch-size", type=int, default=64, help="queries embedded per batch")
    s.add_argument("--json", action="store_true", help="print JSON: [{query, hits: [{id, score, text, scores}]}]")
    add_trust_flag(s)
    s.set_defaults(func=run_search)
