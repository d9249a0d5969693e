"""`bertdist search`: dense hits by cosine, re-ranked in the cross-encoder's order, hybrid results
equal to reciprocal-rank fusion of the dense and BM25 rankings, and a query model other than the
index's refused."""
import json
import re
import shutil

import numpy as np
import pytest

from bertdist.finetune.errors import DataError
from bertdist.retrieval.bm25 import BM25Index
from bertdist.retrieval.embed_job import read_embeddings, run_embedding
from bertdist.stored_set import model_sha256
from bertdist.retrieval.index import IndexModelMismatch, build_index, load_index
from bertdist.retrieval.metrics import reciprocal_rank_fusion
from bertdist.retrieval.search import load_query_model, search
from tests.retrieval.test_embed_job import book_sentences, tiny_model

QUERIES = ["Sir Walter Elliot and his vanity", "Anne was walking with Captain Wentworth",
           "the navy and its officers", "a letter from Lady Russell"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random BERT, its embeddings of 300 Persuasion sentences and a flat index over them."""
    tmp = tmp_path_factory.mktemp("search")
    model = tiny_model(tmp / "tiny")
    src = tmp / "docs.txt"
    src.write_text("\n".join(book_sentences(300)) + "\n")
    run_embedding(model, [src], tmp / "emb", shard_rows=100, progress=False)
    build_index(tmp / "emb", tmp / "ix", "flat")
    return tmp, model, load_query_model(model)


def dense_ranking(tmp, qm, queries, depth):
    emb = read_embeddings(tmp / "emb")
    sims = qm.model.encode(queries) @ emb.vectors.T  # both unit length
    return [[int(r) for r in np.argsort(-s, kind="stable")[:depth]] for s in sims], sims


def test_dense_hits_are_the_nearest_by_cosine(setup):
    tmp, _, qm = setup
    results = search(tmp / "ix", QUERIES, k=5, model=qm)
    want, sims = dense_ranking(tmp, qm, QUERIES, 5)
    index = load_index(tmp / "ix")
    for qi, hits in enumerate(results):
        assert [h.row for h in hits] == want[qi]
        assert [h.id for h in hits] == [index.ids[r] for r in want[qi]]
        assert [h.text for h in hits] == [index.texts[r] for r in want[qi]]
        np.testing.assert_allclose([h.score for h in hits], sims[qi][want[qi]], atol=1e-5)


def test_rerank_orders_the_candidates_as_the_cross_encoder_scores_them(setup, capsys):
    import torch

    from bertdist.embed.model import load_cross_encoder

    tmp, model, qm = setup
    torch.manual_seed(3)
    ce = load_cross_encoder(model)  # a new, random one-output head: an order unrelated to the dense one
    results = search(tmp / "ix", QUERIES, k=5, model=qm, rerank=ce, rerank_top=12)
    dense, _ = dense_ranking(tmp, qm, QUERIES, 12)
    index = load_index(tmp / "ix")
    changed = 0
    for qi, hits in enumerate(results):
        pool = dense[qi]
        scores = ce.score([(QUERIES[qi], index.texts[r]) for r in pool])
        want = [pool[i] for i in np.argsort(-scores, kind="stable")[:5]]
        assert [h.row for h in hits] == want
        np.testing.assert_allclose([h.score for h in hits], np.sort(scores)[::-1][:5], atol=1e-5)
        assert all("dense" in h.scores and h.scores["rerank"] == h.score for h in hits)
        changed += want != pool[:5]
    assert changed >= 3  # the cross-encoder's order is not the dense one

    # the CLI, with the cross-encoder as an exported directory, gives the same list
    from bertdist.cli.main import main
    from bertdist.embed.export import write_cross_encoder

    write_cross_encoder(tmp / "ce", ce)
    capsys.readouterr()
    assert main(["search", "--index", str(tmp / "ix"), "--query", QUERIES[0], "--query", QUERIES[1], "--k", "5",
                 "--rerank", str(tmp / "ce"), "--rerank-top", "12", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["query"] for r in got] == QUERIES[:2]
    for qi in range(2):
        assert [h["id"] for h in got[qi]["hits"]] == [h.id for h in results[qi]]
        np.testing.assert_allclose([h["score"] for h in got[qi]["hits"]], [h.score for h in results[qi]], atol=1e-4)


def test_hybrid_is_reciprocal_rank_fusion_of_the_dense_and_bm25_rankings(setup):
    tmp, _, qm = setup
    depth = 40
    results = search(tmp / "ix", QUERIES, k=10, model=qm, hybrid="bm25", fusion_depth=depth)
    dense, _ = dense_ranking(tmp, qm, QUERIES, depth)
    index = load_index(tmp / "ix")
    rows, scores = BM25Index(index.texts).search(QUERIES, depth)
    for qi, hits in enumerate(results):
        lexical = [int(r) for r, s in zip(rows[qi], scores[qi]) if s > 0]
        assert lexical, "every query shares a word with some sentence"
        want = reciprocal_rank_fusion([dense[qi], lexical], k=60)[:10]
        assert [h.row for h in hits] == [r for r, _ in want]
        np.testing.assert_allclose([h.score for h in hits], [s for _, s in want], rtol=1e-6)
        assert [r for r, _ in want] != dense[qi][:10]  # BM25 moved something
        assert all(h.scores["rrf"] == h.score for h in hits)


def test_a_query_model_with_another_hash_is_refused_and_a_copy_is_accepted(setup, tmp_path, capsys):
    from bertdist.cli.main import main

    tmp, model, _ = setup
    other = tiny_model(tmp_path / "other" / "tiny", seed=1)
    with pytest.raises(IndexModelMismatch, match=re.escape(f"(model sha256 {model_sha256(model)}), the query model "
                                                           f"{other} has sha256 {model_sha256(other)}")):
        search(tmp / "ix", QUERIES[:1], k=3, model=other)
    assert main(["search", "--index", str(tmp / "ix"), "--query", "Anne", "--model", str(other)]) == 2
    assert "its vectors are not comparable" in capsys.readouterr().err
    copy = tmp_path / "copy" / "tiny"
    shutil.copytree(model, copy)
    a = search(tmp / "ix", QUERIES[:2], k=3, model=copy)
    b = search(tmp / "ix", QUERIES[:2], k=3)  # the index's own model
    assert [[h.id for h in hits] for hits in a] == [[h.id for h in hits] for hits in b]


def test_the_cli_prints_hits_from_a_query_file_and_checks_its_arguments(setup, tmp_path, capsys):
    from bertdist.cli.main import main

    tmp, _, qm = setup
    qf = tmp_path / "q.txt"
    qf.write_text(QUERIES[2] + "\n\n" + QUERIES[3] + "\n")
    assert main(["search", "--index", str(tmp / "ix"), "--query-file", str(qf), "--k", "3"]) == 0
    out = capsys.readouterr().out
    want = search(tmp / "ix", QUERIES[2:], k=3, model=qm)
    assert out.count("query: ") == 2 and f"query: {QUERIES[3]}" in out
    assert f"  1  {want[0][0].score:9.4f}  {want[0][0].id}  " in out
    assert main(["search", "--index", str(tmp / "ix"), "--query", "Anne", "--rerank", str(tmp / "tiny"),
                 "--k", "10", "--rerank-top", "5"]) == 2
    assert "rerank_top 5 is less than k 10" in capsys.readouterr().err
    assert main(["search", "--index", str(tmp / "ix")]) == 2
    assert "no query" in capsys.readouterr().err
    with pytest.raises(DataError, match="query 2 is empty"):
        search(tmp / "ix", ["Anne", " "], k=3, model=qm)
