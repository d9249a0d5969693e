"""Unlabelled input in each accepted layout, and the errors (file and line) for the rest."""
import json

import pytest

from bertdist.distill.unlabeled import read_unlabeled
from bertdist.finetune.errors import DataError


def test_glue_text_jsonl_and_task_tsv_without_or_with_labels(tmp_path):
    txt = tmp_path / "u.txt"
    txt.write_text("a fine film .\n\nan awful plot .\n")
    src = read_unlabeled("sst2", txt)
    assert [e.text_a for e in src.examples] == ["a fine film .", "an awful plot ."] and src.skipped_blank == 1
    jl = tmp_path / "u.jsonl"
    jl.write_text(json.dumps({"sentence1": "a", "sentence2": "b"}) + "\n" + json.dumps({"text_a": "c", "text_b": "d"}) + "\n")
    assert [(e.text_a, e.text_b) for e in read_unlabeled("rte", jl).examples] == [("a", "b"), ("c", "d")]
    tsv = tmp_path / "u.tsv"
    tsv.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\tc\td\n")  # label present, then absent
    ex = read_unlabeled("rte", tsv).examples
    assert [(e.text_a, e.text_b, e.label) for e in ex] == [("a", "b", None), ("c", "d", None)]


def test_ner_conll_without_tags_and_jsonl(tmp_path):
    conll = tmp_path / "u.conll"
    conll.write_text("-DOCSTART- -X- -X- O\n\nJohn\nlives\n\nParis NNP B-NP B-LOC\n")
    assert [s.words for s in read_unlabeled("ner", conll).examples] == [["John", "lives"], ["Paris"]]
    jl = tmp_path / "u.jsonl"
    jl.write_text('{"words": ["a", "b"]}\n{"text": "c d e"}\n')
    assert [s.words for s in read_unlabeled("ner", jl).examples] == [["a", "b"], ["c", "d", "e"]]


def test_squad_json_without_answers(tmp_path):
    p = tmp_path / "u.json"
    p.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c1", "qas": [{"id": "x", "question": "q?"}]}]}]}))
    ex = read_unlabeled("squad", p).examples
    assert [(e.qid, e.question, e.context, e.answers) for e in ex] == [("x", "q?", "c1", [])]


@pytest.mark.parametrize("task,name,content,match", [
    ("sst2", "e.txt", "\n  \n", r"e.txt:1: empty file"),
    ("rte", "p.txt", "one sentence\n", r"p.txt:1: wrong layout: rte takes sentence pairs"),
    ("rte", "w.tsv", "index\tquestion\tsentence\n0\ta\tb\n", r"w.tsv:1: wrong layout: the header .* lacks the rte text"),
    ("sst2", "c.tsv", "sentence\tlabel\nok\t1\nbad\t1\textra\n", r"c.tsv:3: wrong layout: 3 columns, the header has 2"),
    ("sst2", "j.jsonl", '{"sentence": "ok"}\nnot json\n', r"j.jsonl:2: wrong layout: not a JSON object"),
    ("sst2", "k.jsonl", '{"sentence": "ok"}\n{"title": "x"}\n', r"k.jsonl:2: wrong layout: no first text field"),
    ("ner", "n.conll", "John\nthis is a whole sentence on one line\n", r"n.conll:2: wrong layout: 8 columns"),
    ("squad", "s.json", '{"version": "1.1"}', r"s.json:1: wrong layout: not a SQuAD file"),
])
def test_bad_input_names_file_and_line(tmp_path, task, name, content, match):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        read_unlabeled(task, p)
