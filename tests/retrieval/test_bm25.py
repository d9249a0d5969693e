"""BM25 search over a tiny corpus, hard-negative windows, and the Parquet set with its manifest."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bertdist.finetune.errors import DataError
from bertdist.retrieval.bm25 import (BM25Index, NegativeSetMismatch, mine_hard_negatives, read_negative_set,
                                     top_k, training_triples, write_negative_set)

# for the query "solar panel energy" (no stop words anywhere; lengths 4, 4, 2, 2, 2, 3 tokens):
# 0 and 1 hold all three terms (a tie), 2 two of them, 3 "panel" (df 3), 4 "energy" (df 4), 5 none
CORPUS = ["solar panel energy output", "solar panel energy storage", "solar energy", "panel discussion",
          "energy drinks", "unrelated filler words"]
QUERY = "solar panel energy"


def test_search_order_and_lucene_scores():
    ids, scores = BM25Index(CORPUS).search([QUERY, "Energy DRINKS"], k=4)
    # "energy drinks": 4 holds both terms; 2 (2 tokens) beats 0 and 1 (4 tokens) on "energy" by length
    assert ids.tolist() == [[0, 1, 2, 3], [4, 2, 0, 1]]
    # Lucene BM25, k1 1.5, b 0.75, N 6, avgdl 17/6: idf(df) = ln(1 + (6 - df + 0.5) / (df + 0.5)),
    # idf(3) = ln 2 = 0.693147, idf(4) = ln(1 + 2.5/4.5) = 0.441833;
    # doc 2 (dl 2): (idf(3) + idf(4)) * 1 / (1 + 1.5 * (0.25 + 0.75 * 2 / (17/6))) = 0.523245
    norm = lambda dl: 1 / (1 + 1.5 * (0.25 + 0.75 * dl / (17 / 6)))  # noqa: E731
    want2 = (math.log(2) + math.log(1 + 2.5 / 4.5)) * norm(2)
    assert want2 == pytest.approx(0.523245, abs=1e-6)
    assert scores[0, 2] == pytest.approx(want2, rel=1e-6)
    assert scores[0, 0] == pytest.approx((2 * math.log(2) + math.log(1 + 2.5 / 4.5)) * norm(4), rel=1e-6)


def test_search_clamps_k_and_scores_unknown_words_zero():
    ids, scores = BM25Index(CORPUS).search(["zebra"], k=50)
    assert ids.shape == (1, 6) and scores.tolist() == [[0.0] * 6]
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5]]  # equal scores: by document index
    with pytest.raises(ValueError, match="k must be a positive integer, got 0"):
        BM25Index(CORPUS).search([QUERY], 0)


def test_top_k_orders_ties_by_index():
    s = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    assert top_k(s, 2).tolist() == [1, 2]
    assert top_k(s, 4).tolist() == [1, 2, 4, 3]
    assert top_k(s, 9).tolist() == [1, 2, 4, 3, 0]


def test_window_skips_the_positive():
    # ranking 0, 1, 2, 3, 4; positive 0 removed: 1, 2, 3, 4
    mined = mine_hard_negatives([QUERY], [[0]], CORPUS, k=2)
    assert mined.rows[0].negative_ids == (1, 2)
    # positive 1 (tied with 0): 0 is the first negative
    assert mine_hard_negatives([QUERY], [[1]], CORPUS, k=2).rows[0].negative_ids == (0, 2)


def test_window_skips_the_top_and_never_takes_zero_scores():
    mined = mine_hard_negatives([QUERY], [[0]], CORPUS, k=3, skip_top=1)
    assert mined.rows[0].negative_ids == (2, 3, 4)
    # depth 5 reaches doc 5, which shares no term: left out, the query is short of k
    mined = mine_hard_negatives([QUERY], [[0]], CORPUS, k=5, skip_top=1)
    assert mined.rows[0].negative_ids == (2, 3, 4)
    assert mined.counts == {"queries": 1, "corpus": 6, "negatives": 3, "queries_with_k": 0, "queries_short": 1,
                            "queries_without": 0}


def test_margin_drops_candidates_that_score_like_the_positive():
    # doc 1 scores as the positive (0.616936) > 0.9 * 0.616936: dropped; doc 2 (0.523245 <= 0.555243) stays
    mined = mine_hard_negatives([QUERY], [[0]], CORPUS, k=2, depth=4, margin=0.1)
    row = mined.rows[0]
    assert row.negative_ids == (2, 3)
    assert row.positive_score == pytest.approx(0.616936, abs=1e-6)
    assert mined.window["margin"] == 0.1


def test_mining_input_errors():
    with pytest.raises(ValueError, match=r"query 0: positive ids \[9\] are outside the corpus \(0..5\)"):
        mine_hard_negatives([QUERY], [[9]], CORPUS, k=2)
    with pytest.raises(ValueError, match="query 1 has no positive document"):
        mine_hard_negatives([QUERY, QUERY], [[0], []], CORPUS, k=2)
    with pytest.raises(ValueError, match="2 queries but 1 positive-id lists"):
        mine_hard_negatives([QUERY, QUERY], [[0]], CORPUS, k=2)
    with pytest.raises(ValueError, match="depth must be an integer >= k = 3, got 2"):
        mine_hard_negatives([QUERY], [[0]], CORPUS, k=3, depth=2)
    with pytest.raises(ValueError, match=r"margin must be in \[0, 1\)"):
        mine_hard_negatives([QUERY], [[0]], CORPUS, k=3, margin=1.5)


@pytest.fixture
def sources(tmp_path):
    queries = tmp_path / "queries.jsonl"
    queries.write_text(json.dumps({"query": QUERY, "positive_id": 0}) + "\n" +
                       json.dumps({"query": "energy drinks", "positive_id": 4}) + "\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    return {"queries": queries, "corpus": corpus}


def test_parquet_round_trip(tmp_path, sources):
    mined = mine_hard_negatives([QUERY, "energy drinks"], [[0], [4]], CORPUS, k=2, skip_top=1)
    manifest = write_negative_set(tmp_path / "negs", mined, sources)
    back = read_negative_set(tmp_path / "negs", sources=sources)
    assert back.rows == mined.rows
    assert (back.k, back.window, back.counts, back.method) == (mined.k, mined.window, mined.counts, mined.method)
    on_disk = json.loads((tmp_path / "negs" / "manifest.json").read_text())
    assert on_disk == manifest == back.manifest
    assert on_disk["format"] == "bertdist-hard-negatives/1"
    assert on_disk["method"]["library"] == "bm25s" and on_disk["method"]["k1"] == 1.5
    assert on_disk["window"] == {"skip_top": 1, "depth": 2, "margin": None, "positives_removed": True,
                                 "zero_scores_removed": True}
    assert on_disk["counts"]["queries"] == 2
    assert on_disk["created_by"].startswith("bertdist ")
    import hashlib

    for s in on_disk["sources"]:
        assert s["sha256"] == hashlib.sha256(sources[s["role"]].read_bytes()).hexdigest()
    assert sorted(p.name for p in (tmp_path / "negs").iterdir()) == ["manifest.json", "negatives.parquet"]


def test_reading_with_another_queries_file_fails(tmp_path, sources):
    mined = mine_hard_negatives([QUERY], [[0]], CORPUS, k=2)
    m = write_negative_set(tmp_path / "negs", mined, sources)
    old = next(s["sha256"] for s in m["sources"] if s["role"] == "queries")
    sources["queries"].write_text(json.dumps({"query": "another question", "positive_id": 3}) + "\n")
    with pytest.raises(NegativeSetMismatch, match="mined from the queries file") as e:
        read_negative_set(tmp_path / "negs", sources={"queries": sources["queries"]})
    import hashlib

    new = hashlib.sha256(sources["queries"].read_bytes()).hexdigest()
    assert old in str(e.value) and new in str(e.value) and str(sources["queries"]) in str(e.value)
    with pytest.raises(NegativeSetMismatch, match=r"records no labels file \(it has \['corpus', 'queries'\]\)"):
        read_negative_set(tmp_path / "negs", sources={"labels": sources["corpus"]})
    # without sources to check, the set still reads
    assert read_negative_set(tmp_path / "negs").rows == mined.rows


def test_reading_a_broken_set_fails_clearly(tmp_path, sources):
    with pytest.raises(DataError, match="no manifest.json"):
        read_negative_set(tmp_path)
    write_negative_set(tmp_path / "negs", mine_hard_negatives([QUERY], [[0]], CORPUS, k=2), sources)
    m = json.loads((tmp_path / "negs" / "manifest.json").read_text())
    m["counts"]["queries"] = 5
    (tmp_path / "negs" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="1 rows, the manifest .* says 5"):
        read_negative_set(tmp_path / "negs")
    m["file"] = "../elsewhere.parquet"
    (tmp_path / "negs" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="outside"):
        read_negative_set(tmp_path / "negs")


def test_training_triples():
    mined = mine_hard_negatives([QUERY], [[0, 1]], CORPUS, k=2)
    assert mined.rows[0].negative_ids == (2, 3)
    assert training_triples(mined, [QUERY], CORPUS) == [
        {"query": QUERY, "positive": CORPUS[0], "negatives": [CORPUS[2], CORPUS[3]]},
        {"query": QUERY, "positive": CORPUS[1], "negatives": [CORPUS[2], CORPUS[3]]},
    ]
