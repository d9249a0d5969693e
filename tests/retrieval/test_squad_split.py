"""The SQuAD v1.1 dev retrieval split: counts, no article on both sides, relevance by origin."""
from __future__ import annotations

import json

import pytest

from bertdist.finetune.errors import DataError
from bertdist.retrieval.squad_split import load_squad_retrieval


@pytest.mark.shared
def test_dev_split_counts_and_disjoint_articles(shared_data):
    path = shared_data / "squad" / "dev-v1.1.json"
    split = load_squad_retrieval(path)
    data = json.loads(path.read_text())["data"]
    # dev v1.1: 48 articles, 2,067 paragraphs, 10,570 questions; alternate articles to each side
    assert len(data) == 48
    assert split.counts() == {"train_articles": 24, "train_pairs": 5397, "train_paragraphs": 1023,
                              "eval_articles": 24, "eval_queries": 5173, "eval_paragraphs": 1044}
    assert split.counts()["train_pairs"] + split.counts()["eval_queries"] == 10570
    assert split.counts()["train_paragraphs"] + split.counts()["eval_paragraphs"] == 2067
    assert not set(split.train_articles) & set(split.eval_articles)
    assert split.train_articles == [a["title"] for a in data[0::2]]
    assert split.eval_articles == [a["title"] for a in data[1::2]]
    # no paragraph text, and no question id, on both sides
    assert not {c for _, c in split.train_pairs} & set(split.corpus)
    assert not set(split.train_question_ids) & set(split.eval_query_ids)
    # relevance: each eval question's one paragraph is the one it was asked about
    context_of = {qa["id"]: para["context"] for a in data for para in a["paragraphs"] for qa in para["qas"]}
    text_of = dict(zip(split.corpus_ids, split.corpus))
    assert all(len(rel) == 1 for rel in split.eval_relevant)
    assert all(text_of[next(iter(rel))] == context_of[qid]
               for qid, rel in zip(split.eval_query_ids, split.eval_relevant))
    assert all(c == context_of[qid] for (_, c), qid in zip(split.train_pairs, split.train_question_ids))


def _squad(articles):
    return {"version": "1.1", "data": [
        {"title": t, "paragraphs": [{"context": c, "qas": [{"id": f"{t}-{i}", "question": q, "answers": []}
                                                          for i, q in enumerate(qs)]} for c, qs in paras]}
        for t, paras in articles]}


def test_small_file_alternates_articles(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(_squad([("A", [("ctx a0", ["qa0"]), ("ctx a1", ["qa1", "qa1b"])]),
                                    ("B", [("ctx b0", ["qb0"])]),
                                    ("C", [("ctx c0", ["qc0"])]),
                                    ("D", [("ctx d0", ["qd0"]), ("ctx d1", ["qd1"])])])))
    s = load_squad_retrieval(p)
    assert s.train_articles == ["A", "C"] and s.eval_articles == ["B", "D"]
    assert s.train_pairs == [("qa0", "ctx a0"), ("qa1", "ctx a1"), ("qa1b", "ctx a1"), ("qc0", "ctx c0")]
    assert s.train_paragraph_ids == ["a0-p0", "a0-p1", "a0-p1", "a2-p0"]
    assert s.corpus_ids == ["a1-p0", "a3-p0", "a3-p1"]
    assert s.corpus == ["ctx b0", "ctx d0", "ctx d1"]
    assert s.eval_queries == ["qb0", "qd0", "qd1"]
    assert s.eval_relevant == [{"a1-p0"}, {"a3-p0"}, {"a3-p1"}]


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_squad_retrieval(tmp_path / "none.json")
    p = tmp_path / "one.json"
    p.write_text(json.dumps(_squad([("A", [("ctx", ["q"])])])))
    with pytest.raises(DataError, match="one article only"):
        load_squad_retrieval(p)
    p.write_text(json.dumps({"data": []}))
    with pytest.raises(DataError, match="no articles"):
        load_squad_retrieval(p)


def test_data_squad_retrieval_writes_the_commands_inputs_and_never_overwrites(tmp_path, capsys):
    from bertdist.cli.main import main
    from bertdist.embed.data import read_pairs

    src = tmp_path / "squad.json"
    src.write_text(json.dumps(_squad([("A", [("alpha text one.", ["q a1?", "q a2?"])]),
                                      ("B", [("beta text one.", ["q b1?"]), ("beta two.", ["q\nb2?"])])])))
    out = tmp_path / "r"
    assert main(["data", "squad-retrieval", "--squad", str(src), "--out", str(out)]) == 0
    assert [(r.query, r.positive) for r in read_pairs(out / "train.jsonl")] == [("q a1?", "alpha text one."),
                                                                                ("q a2?", "alpha text one.")]
    assert [(r.query, r.positive) for r in read_pairs(out / "dev.jsonl")] == [("q b1?", "beta text one."),
                                                                              ("q\nb2?", "beta two.")]
    corpus = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert corpus == [{"id": "a1-p0", "text": "beta text one."}, {"id": "a1-p1", "text": "beta two."}]
    assert (out / "queries.txt").read_text() == "q b1?\nq b2?\n"  # one question a line
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["data", "squad-retrieval", "--squad", str(src), "--out", str(out)]) == 2
    assert "already holds" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
