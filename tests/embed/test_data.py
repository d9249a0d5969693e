"""Training-file readers: each layout read, and each way a file can be wrong named by path:line."""
from __future__ import annotations

import json

import pytest

from bertdist.embed.data import PairExample, ScoredPair, read_pairs, read_scored_pairs, read_stsb
from bertdist.finetune.errors import DataError


def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def _jsonl(tmp_path, rows, name="train.jsonl"):
    return _write(tmp_path, name, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


# ---------------------------------------------------------------- (query, positive, negatives)
def test_pairs_jsonl(tmp_path):
    p = _jsonl(tmp_path, [{"query": "q1", "positive": "p1", "negatives": ["n1", "n2"]},
                          "", {"query": "q2", "positive": "p2", "id": 7}])
    assert read_pairs(p) == [PairExample("q1", "p1", ("n1", "n2")), PairExample("q2", "p2", ())]


def test_pairs_tsv_with_and_without_header(tmp_path):
    p = _write(tmp_path, "a.tsv", "query\tpositive\tnegative\nq1\tp1\tn1\nq2\tp2\n\n")
    assert read_pairs(p) == [PairExample("q1", "p1", ("n1",)), PairExample("q2", "p2", ())]
    p = _write(tmp_path, "b.tsv", "q1\tp1\n")
    assert read_pairs(p) == [PairExample("q1", "p1")]


@pytest.mark.parametrize("rows,where,match", [
    (['{"query": "q", "positive": "p"}', '{"query": "q", '], 2, "not valid JSON"),
    ([["q", "p"]], 1, "wrong layout: a JSON list"),
    ([{"query": "q1", "positive": "p1"}, {"query": "q2"}], 2, "missing key 'positive'"),
    ([{"question": "q", "positive": "p"}], 1, "missing key 'query'"),
    ([{"query": "q", "positive": "  "}], 1, "positive is empty"),
    ([{"query": 3, "positive": "p"}], 1, "query must be a string, got int"),
    ([{"query": "q", "positive": "p", "negatives": "n"}], 1, "negatives must be a list of strings, got str"),
    ([{"query": "q", "positive": "p", "negatives": ["n", ""]}], 1, r"negatives\[1\] is empty"),
])
def test_pairs_jsonl_errors_name_path_and_line(tmp_path, rows, where, match):
    p = _jsonl(tmp_path, rows)
    with pytest.raises(DataError, match=match) as e:
        read_pairs(p)
    assert str(e.value).startswith(f"{p}:{where}: ")


@pytest.mark.parametrize("text,where,match", [
    ("q1\tp1\nq2\n", 2, "wrong layout: 1 column"),
    ("q1\tp1\n\tp2\n", 2, "query is empty"),
    ("q1\tp1\tn1\nq2\tp2\t \n", 2, "negative 1 is empty"),
    ("query\tpositive\n", 2, "no rows after the header"),
])
def test_pairs_tsv_errors(tmp_path, text, where, match):
    p = _write(tmp_path, "t.tsv", text)
    with pytest.raises(DataError, match=match) as e:
        read_pairs(p)
    assert str(e.value).startswith(f"{p}:{where}: ")


@pytest.mark.parametrize("name", ["e.jsonl", "e.tsv"])
def test_empty_file(tmp_path, name):
    p = _write(tmp_path, name, "\n  \n")
    with pytest.raises(DataError, match=f"^{p}:1: empty file") as e:
        read_pairs(p)
    assert "expected" in str(e.value)


def test_format_from_extension_or_argument(tmp_path):
    p = _write(tmp_path, "rows.txt", '{"query": "q", "positive": "p"}\n')
    with pytest.raises(DataError, match=r"extension '\.txt'"):
        read_pairs(p)
    assert read_pairs(p, fmt="jsonl") == [PairExample("q", "p")]
    with pytest.raises(DataError, match="format 'csv' is not one of"):
        read_pairs(p, fmt="csv")
    with pytest.raises(DataError, match="file not found"):
        read_pairs(tmp_path / "missing.jsonl")


def test_not_utf8(tmp_path):
    p = tmp_path / "latin.tsv"
    p.write_bytes("caf\xe9\tp\n".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        read_pairs(p)


# ---------------------------------------------------------------- (text_a, text_b, score)
def test_scored_pairs_jsonl_and_tsv(tmp_path):
    p = _jsonl(tmp_path, [{"text_a": "a", "text_b": "b", "score": 4}, {"text_a": "c", "text_b": "d", "score": 0.5}])
    assert read_scored_pairs(p) == [ScoredPair("a", "b", 4.0), ScoredPair("c", "d", 0.5)]
    p = _write(tmp_path, "s.tsv", "text_a\ttext_b\tscore\na\tb\t3.2\n")
    assert read_scored_pairs(p) == [ScoredPair("a", "b", 3.2)]


@pytest.mark.parametrize("row,match", [
    ({"text_a": "a", "text_b": "b", "score": "high"}, "score 'high' is a string, expected a JSON number"),
    ({"text_a": "a", "text_b": "b", "score": None}, "score None is not a number"),
    ({"text_a": "a", "text_b": "b", "score": True}, "score True is not a number"),
    ({"text_a": "a", "text_b": "b"}, "missing key 'score'"),
    ({"text_a": "a", "text_b": "", "score": 1}, "text_b is empty"),
])
def test_scored_jsonl_errors(tmp_path, row, match):
    p = _jsonl(tmp_path, [{"text_a": "x", "text_b": "y", "score": 1}, row])
    with pytest.raises(DataError, match=match) as e:
        read_scored_pairs(p)
    assert str(e.value).startswith(f"{p}:2: ")


@pytest.mark.parametrize("line,match", [
    ("a\tb\tabc", "score 'abc' is not a number"),
    ("a\tb\tnan", "score 'nan' is not a finite number"),
    ("a\tb", "wrong layout: 2 columns, expected 3"),
    ("a\tb\t1\textra", "wrong layout: 4 columns, expected 3"),
])
def test_scored_tsv_errors(tmp_path, line, match):
    p = _write(tmp_path, "s.tsv", f"x\ty\t1\n{line}\n")
    with pytest.raises(DataError, match=match) as e:
        read_scored_pairs(p)
    assert str(e.value).startswith(f"{p}:2: ")


def test_scored_tsv_unknown_header_names_the_header_layout(tmp_path):
    p = _write(tmp_path, "s.tsv", "first\tsecond\tlabel\na\tb\t1\n")
    with pytest.raises(DataError, match=r"score 'label' is not a number \(a header line must read text_a<TAB>") as e:
        read_scored_pairs(p)
    assert str(e.value).startswith(f"{p}:1: ")


# ---------------------------------------------------------------- GLUE STS-B
STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"


def _stsb_row(i, a, b, score):
    return f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{a}\t{b}\t{score}\n"


def test_stsb_layout(tmp_path):
    p = _write(tmp_path, "train.tsv", STSB_HEADER + _stsb_row(0, "A plane.", "An air plane.", "5.000")
               + _stsb_row(1, "A man.", "A flute.", "0.500"))
    assert read_stsb(p) == [ScoredPair("A plane.", "An air plane.", 5.0), ScoredPair("A man.", "A flute.", 0.5)]


@pytest.mark.parametrize("text,where,match", [
    ("index\tsentence1\tsentence2\n0\ta\tb\n", 1, r"missing column\(s\) \['score'\]"),
    (STSB_HEADER + _stsb_row(0, "a", "b", "1") + _stsb_row(1, "a", "b", "x"), 3, "score 'x' is not a number"),
    (STSB_HEADER + _stsb_row(0, "a", "b", "1") + "1\tshort\n", 3, "wrong layout: 2 columns, the header has 10"),
    (STSB_HEADER + _stsb_row(0, "", "b", "1"), 2, "sentence1 is empty"),
    (STSB_HEADER, 2, "no rows after the header"),
    ("", 1, "empty file"),
])
def test_stsb_errors(tmp_path, text, where, match):
    p = _write(tmp_path, "dev.tsv", text)
    with pytest.raises(DataError, match=match) as e:
        read_stsb(p)
    assert str(e.value).startswith(f"{p}:{where}: ")


@pytest.mark.shared
def test_stsb_real_files(shared_data):
    train = read_stsb(shared_data / "glue" / "STS-B" / "train.tsv")
    dev = read_stsb(shared_data / "glue" / "STS-B" / "dev.tsv")
    assert (len(train), len(dev)) == (5749, 1500)  # GLUE's STS-B sizes
    assert all(0.0 <= r.score <= 5.0 for r in train + dev)
    assert train[0] == ScoredPair("A plane is taking off.", "An air plane is taking off.", 5.0)
