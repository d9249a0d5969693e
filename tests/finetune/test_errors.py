"""Bad input gets a clear error naming the file, the line and what was expected."""
from __future__ import annotations

import json

import pytest

from bertdist.finetune import DataError, FinetuneConfig, VocabMismatch, run_finetune
from bertdist.finetune import glue as G
from bertdist.finetune.ner import read_conll
from bertdist.finetune.squad import read_squad
from bertdist.finetune.swag import read_swag
from tests.finetune import fixtures

pytestmark = pytest.mark.shared


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, shared_data):
    return fixtures.tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"),
                                       shared_data / "vocab" / "bert-base-uncased-vocab.txt")


def test_wrong_column_layout(shared_data, tmp_path):
    with pytest.raises(DataError, match=r"wrong column layout: no column '#1 String' in the header \['sentence', 'label'\]"):
        G.read_glue(G.GLUE_TASKS["mrpc"], shared_data / "glue" / "SST-2" / "dev.tsv")
    with pytest.raises(DataError, match="line 1 has 2 columns, cola train/dev files have 4"):
        G.read_glue(G.GLUE_TASKS["cola"], shared_data / "glue" / "SST-2" / "dev.tsv")
    bad = tmp_path / "dev.tsv"
    bad.write_text("sentence\tlabel\na fine film\t1\nno label here\n")
    with pytest.raises(DataError, match=r"dev.tsv:3: wrong column layout: 1 columns, expected 2"):
        G.read_glue(G.GLUE_TASKS["sst2"], bad)
    (tmp_path / "x.csv").write_text("sent1,sent2,ending0\na,b,c\n")
    with pytest.raises(DataError, match=r"missing columns \['ending1', 'ending2', 'ending3', 'label'\]"):
        read_swag(tmp_path / "x.csv")
    (tmp_path / "ner.txt").write_text("EU NNP B-NP B-ORG\nrejects\n")
    with pytest.raises(DataError, match=r"ner.txt:2: wrong column layout"):
        read_conll(tmp_path / "ner.txt")


def test_labels_outside_the_label_set(tmp_path, tiny_ckpt):
    bad = tmp_path / "dev.tsv"
    bad.write_text("sentence\tlabel\na fine film\t1\na dull film\tnegative\n")
    with pytest.raises(DataError, match=r"dev.tsv:3: label 'negative' is not in the sst2 label set \['0', '1'\]"):
        G.read_glue(G.GLUE_TASKS["sst2"], bad)
    (tmp_path / "t.csv").write_text("sent1,sent2,ending0,ending1,ending2,ending3,label\na,b,c,d,e,f,4\n")
    with pytest.raises(DataError, match=r"label '4' is not in the SWAG label set"):
        read_swag(tmp_path / "t.csv")
    (tmp_path / "n.txt").write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP BEGIN-X\n")
    with pytest.raises(DataError, match=r"n.txt:2: NER tag 'BEGIN-X'"):
        read_conll(tmp_path / "n.txt")
    # an entity type in dev that the training file never has
    ner = tmp_path / "ner"
    ner.mkdir()
    (ner / "train.txt").write_text("EU NNP B-NP B-ORG\nsays VBZ B-VP O\n\nPeter NNP B-NP B-PER\n")
    (ner / "valid.txt").write_text("Paris NNP B-NP B-LOC\n")
    cfg = FinetuneConfig(task="ner", checkpoint=str(tiny_ckpt), data=str(ner), output_dir=str(tmp_path / "o"),
                         max_steps=1, progress=False, kernels="reference")
    with pytest.raises(DataError, match=r"valid.txt:1: label 'B-LOC' is not in the label set from the training file"):
        run_finetune(cfg)


def test_checkpoint_vocab_must_match_data_tokenizer(tmp_path, tiny_ckpt, shared_data):
    cfg = FinetuneConfig(task="sst2", checkpoint=str(tiny_ckpt), data=str(shared_data / "glue" / "SST-2"),
                         output_dir=str(tmp_path), vocab_file=str(shared_data / "vocab" / "bert-base-cased-vocab.txt"),
                         max_steps=1, progress=False)
    with pytest.raises(VocabMismatch, match=r"checkpoint's vocab .*30522 tokens.* does not match the data "
                                            r"tokenizer's vocab .*bert-base-cased-vocab.txt \(28996 tokens"):
        run_finetune(cfg)
    # and through the CLI: exit code 2 with the message
    from bertdist.cli.main import main

    rc = main(["finetune", "sst2", "--checkpoint", str(tiny_ckpt), "--data", str(shared_data / "glue" / "SST-2"),
               "--vocab", str(shared_data / "vocab" / "bert-base-cased-vocab.txt"), "--out", str(tmp_path / "cli")])
    assert rc == 2


def test_squad_answer_must_match_context(tmp_path):
    ctx = "Super Bowl 50 was played at Levi's Stadium in Santa Clara."
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "Levi's Stadium", "answer_start": 29}]}]}]}]}
    (tmp_path / "s.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"question q1: answer \"Levi's Stadium\" does not match the context at "
                                        r"answer_start 29 \(context there: \"evi's Stadium \"\)"):
        read_squad(tmp_path / "s.json")
    data["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 28
    (tmp_path / "s.json").write_text(json.dumps(data))
    assert read_squad(tmp_path / "s.json")[0][0].answers == [("Levi's Stadium", 28)]


def test_unknown_task_and_missing_files(tmp_path, tiny_ckpt):
    cfg = FinetuneConfig(task="glue-xyz", checkpoint=str(tiny_ckpt), data=str(tmp_path), output_dir=str(tmp_path))
    with pytest.raises(DataError, match="unknown task 'glue-xyz'"):
        run_finetune(cfg)
    cfg = FinetuneConfig(task="rte", checkpoint=str(tiny_ckpt), data=str(tmp_path), output_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"no train file \(looked for \[.train.tsv.\]\)"):
        run_finetune(cfg)


def test_a_non_finite_regression_label_or_a_non_utf8_file_names_the_line(tmp_path):
    stsb = G.GLUE_TASKS["stsb"]
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    bad = tmp_path / "dev.tsv"
    bad.write_text(header + "0\tmain\tf\t2012\t1\ts\ts\tA man.\tA dog.\t3.2\n1\tmain\tf\t2012\t2\ts\ts\tA.\tB.\tnan\n")
    with pytest.raises(DataError, match=r"dev.tsv:3: stsb label 'nan' is not a finite number"):
        G.read_glue(stsb, bad)
    latin = tmp_path / "latin1.tsv"
    latin.write_bytes(header.encode() + "0\tmain\tf\t2012\t1\ts\ts\tCaf\xe9.\tB.\t3.0\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.tsv: not UTF-8 text"):
        G.read_glue(stsb, latin)


def test_a_squad_stride_that_leaves_no_room_names_every_number(shared_data):
    """Checked against the longest question (the tokenizer's own error names neither setting);
    short questions leave room where max_query_length alone would not."""
    from bertdist.export import bert_tokenizer
    from bertdist.finetune.squad import SquadExample, make_features

    tok = bert_tokenizer(shared_data / "vocab" / "bert-base-uncased-vocab.txt", True)
    ex = [SquadExample("q1", "who built the mill by the river?", "the mill was built by the abbey " * 20,
                       [("the abbey", 22)], False)]
    assert make_features(ex, tok, max_seq_length=48, doc_stride=36, max_query_length=64, train=True).inputs
    with pytest.raises(DataError, match=r"doc_stride=37 must be positive and below the context's room in a window: "
                                        r"max_seq_length \(48\) - the longest question \(8 tokens, at most "
                                        r"max_query_length 64\) - 3 = 37"):
        make_features(ex, tok, max_seq_length=48, doc_stride=37, max_query_length=64, train=True)
