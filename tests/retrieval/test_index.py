"""`bertdist index`: flat search is exact cosine, HNSW and IVF find (nearly) the same neighbours on
random unit vectors and on real-text embeddings, and a damaged index directory is refused."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from bertdist.finetune.errors import DataError
from bertdist.retrieval.embed_job import FORMAT, _write_shard, run_embedding
from bertdist.stored_set import MANIFEST, shard_name, write_json_atomic
from bertdist.retrieval.index import approximate_recall, build_index, default_nlist, load_index
from tests.retrieval.test_embed_job import book_sentences, tiny_model


def write_vector_set(d: Path, vectors: np.ndarray, shard_rows: int = 1000) -> Path:
    """An embedding directory holding ``vectors`` as they are (ids v0, v1, ...), as `bertdist embed`
    lays it out, for tests that need vectors no model made."""
    d.mkdir(parents=True, exist_ok=True)
    n, dim = vectors.shape
    k = -(-n // shard_rows)
    shards = []
    for i in range(k):
        lo, hi = i * shard_rows, min(n, (i + 1) * shard_rows)
        _write_shard(d / shard_name(i, k), lo, [f"v{j}" for j in range(lo, hi)], [f"text {j}" for j in range(lo, hi)],
                     vectors[lo:hi])
        shards.append({"file": shard_name(i, k), "rows": hi - lo})
    model = {"path": "none", "sha256": "0" * 64, "pooling": "mean", "normalize": False, "truncate_dim": None,
             "dim": dim}
    write_json_atomic(d / MANIFEST, {"format": FORMAT, "model": model, "sources": [], "rows": n, "dim": dim,
                               "normalized": False, "shard_rows": shard_rows, "num_shards": k, "shards": shards})
    return d


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(unit(queries) @ unit(vectors).T), axis=1, kind="stable")[:, :k]


@pytest.fixture(scope="module")
def random_set(tmp_path_factory):
    """3,000 random 64-wide vectors (not unit length: the index normalises), 200 queries."""
    rng = np.random.default_rng(0)
    vectors = (rng.standard_normal((3000, 64)) * rng.uniform(0.5, 2.0, (3000, 1))).astype(np.float32)
    queries = rng.standard_normal((200, 64)).astype(np.float32)
    return write_vector_set(tmp_path_factory.mktemp("random") / "emb", vectors), vectors, queries


@pytest.fixture(scope="module")
def real_set(tmp_path_factory):
    """A tiny random BERT's embeddings of 1,500 sentences of two books, and of 100 others as queries."""
    tmp = tmp_path_factory.mktemp("real")
    model = tiny_model(tmp / "tiny")
    docs = book_sentences(900) + book_sentences(600, book="chesterton-thursday.txt")
    src = tmp / "docs.txt"
    src.write_text("\n".join(docs) + "\n")
    run_embedding(model, [src], tmp / "emb", shard_rows=500, batch_size=64, progress=False)
    from bertdist.embed.model import load_bi_encoder

    queries = load_bi_encoder(model).encode(book_sentences(100, start=1000))
    return tmp / "emb", queries


def test_flat_is_exact_cosine_and_keeps_ids_and_texts(tmp_path, random_set):
    emb, vectors, queries = random_set
    meta = build_index(emb, tmp_path / "ix", "flat")
    assert (meta["kind"], meta["count"], meta["dim"], meta["params"]) == ("flat", 3000, 64, {})
    assert meta["model"]["sha256"] == "0" * 64 and len(meta["embeddings"]["manifest_sha256"]) == 64
    assert json.loads((tmp_path / "ix" / "index.json").read_text()) == meta
    vi = load_index(tmp_path / "ix")
    scores, rows = vi.search(queries, 10)
    np.testing.assert_array_equal(rows, exact_top(vectors, queries, 10))
    want = np.take_along_axis(unit(queries) @ unit(vectors).T, rows, axis=1)
    np.testing.assert_allclose(scores, want, atol=1e-5)
    assert vi.ids[int(rows[0, 0])] == f"v{rows[0, 0]}" and vi.texts[int(rows[0, 0])] == f"text {rows[0, 0]}"
    assert vi.search(queries[:1], 5000)[1].shape == (1, 3000)  # k above the count: every row


def test_hnsw_and_ivf_on_random_unit_vectors(tmp_path, random_set):
    emb, vectors, queries = random_set
    want = exact_top(vectors, queries, 10)

    def recall(rows):
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, want)])

    meta = build_index(emb, tmp_path / "hnsw", "hnsw")
    assert meta["params"] == {"m": 32, "ef_construction": 200, "ef_search": 128}
    hnsw = load_index(tmp_path / "hnsw")
    assert recall(hnsw.search(queries, 10)[1]) >= 0.95
    r = approximate_recall(tmp_path / "hnsw", queries, k=10, min_seconds=0.05)
    assert r["recall@10"] == pytest.approx(recall(hnsw.search(queries, 10)[1]))
    assert r["queries_per_second"] > 0 and r["exact_queries_per_second"] > 0 and r["queries"] == 200
    low = approximate_recall(tmp_path / "hnsw", queries, k=10, ef_search=10, min_seconds=0.05)
    assert low["params"]["ef_search"] == 10 and low["recall@10"] < r["recall@10"]

    meta = build_index(emb, tmp_path / "ivf", "ivf")
    nlist = default_nlist(3000)
    assert meta["params"] == {"nlist": nlist, "nprobe": nlist // 4} and nlist == 3000 // 39
    # every cell visited: the same as exact search
    full = load_index(tmp_path / "ivf", nprobe=nlist)
    np.testing.assert_array_equal(full.search(queries, 10)[1], want)
    few = approximate_recall(tmp_path / "ivf", queries, k=10, nprobe=1, min_seconds=0.05)["recall@10"]
    assert few < approximate_recall(tmp_path / "ivf", queries, k=10, min_seconds=0.05)["recall@10"]
    assert approximate_recall(tmp_path / "ivf", queries, k=10, nprobe=nlist, min_seconds=0.05)["recall@10"] == 1.0


def test_hnsw_recall_on_real_embeddings(tmp_path, real_set):
    emb, queries = real_set
    build_index(emb, tmp_path / "hnsw", "hnsw")
    r = approximate_recall(tmp_path / "hnsw", queries, k=10, min_seconds=0.05)
    assert r["count"] == 1500 and r["recall@10"] >= 0.95
    build_index(emb, tmp_path / "ivf", "ivf")
    assert approximate_recall(tmp_path / "ivf", queries, k=10, min_seconds=0.05)["recall@10"] >= 0.8
    assert approximate_recall(tmp_path / "ivf", queries, k=10, nprobe=default_nlist(1500),
                              min_seconds=0.05)["recall@10"] == 1.0


def test_the_cli_builds_an_index_and_bad_input_is_an_error(tmp_path, random_set, capsys):
    from bertdist.cli.main import main

    emb, _, _ = random_set
    assert main(["index", "--embeddings", str(emb), "--out", str(tmp_path / "ix"), "--kind", "ivf", "--nlist", "16",
                 "--nprobe", "4"]) == 0
    assert "ivf index (nlist=16, nprobe=4) over 3000 64-wide vectors" in capsys.readouterr().out
    assert load_index(tmp_path / "ix").index.nprobe == 4
    assert main(["index", "--embeddings", str(emb), "--out", str(tmp_path / "x"), "--kind", "ivf",
                 "--nlist", "4000"]) == 2
    assert "nlist 4000 is more than the 3000 vectors to cluster" in capsys.readouterr().err
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "plan.json").write_text("{}")
    assert main(["index", "--embeddings", str(unfinished), "--out", str(tmp_path / "y")]) == 2
    assert "no manifest.json: an unfinished embedding job" in capsys.readouterr().err


def test_a_damaged_index_directory_is_refused(tmp_path, random_set):
    emb, _, _ = random_set
    build_index(emb, tmp_path / "ix", "flat")
    meta_path = tmp_path / "ix" / "index.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "count": 2999}))
    with pytest.raises(DataError, match=re.escape("index.faiss holds 3000 vectors of width 64, rows.parquet 3000 rows, "
                                                  "index.json says 2999 of width 64")):
        load_index(tmp_path / "ix")
    meta_path.write_text(json.dumps({**meta, "files": {"index": "../emb/x", "rows": "rows.parquet"}}))
    with pytest.raises(DataError, match="outside"):
        load_index(tmp_path / "ix")
    meta_path.write_text(json.dumps({**meta, "kind": "lsh"}))
    with pytest.raises(DataError, match=re.escape(f"{meta_path}: wrong layout: expected kind (one of ['flat', 'hnsw', "
                                                  "'ivf'])")):
        load_index(tmp_path / "ix")
    meta_path.write_text(json.dumps(meta))
    f = tmp_path / "ix" / "index.faiss"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(DataError, match=re.escape(f"{f}: not a readable FAISS index")):
        load_index(tmp_path / "ix")
    with pytest.raises(DataError, match="no index.json"):
        load_index(tmp_path)
