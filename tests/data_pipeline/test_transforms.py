"""Each PTransform under TestPipeline with assert_that, including bad input."""
from __future__ import annotations

import bz2
import json

import apache_beam as beam
import numpy as np
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to, is_not_empty

from data_pipeline.transforms import (
    CreateInstances, ReadBertFormatText, ReadBooks, ReadJsonLines, ReadWikipediaDump, SplitSentences, SplitShards,
    Tokenize, WriteShards,
)

OPTS = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]


def page(pid, title, text, ns=0, redirect=False):
    r = '<redirect title="X" />' if redirect else ""
    return (f"  <page>\n    <title>{title}</title>\n    <ns>{ns}</ns>\n    <id>{pid}</id>\n    {r}\n"
            f"    <revision>\n      <text xml:space=\"preserve\">{text}</text>\n    </revision>\n  </page>\n")


ARTICLE = ("'''Foo''' is a [[bar (thing)|bar]] in [[Baz]].&lt;ref&gt;Cited.&lt;/ref&gt; {{Infobox x|a=1}}"
           "It is &lt;!-- hidden --&gt; well known. __NOTOC__\n\n[[File:Foo.jpg|thumb|A caption.]]\n"
           "{| class=\"wikitable\"\n|-\n| cell one || cell two\n|}\n== History ==\nFoo was made in 1900. It grew.\n"
           "== References ==\n* A reference list item that should not appear anywhere.\n[[Category:Things]]")


def write_dump(path, pages, truncate=False, bad_bytes=False):
    xml = "<mediawiki>\n" + "".join(pages) + "</mediawiki>\n"
    data = xml.encode()
    if bad_bytes:
        data = data.replace(b"well known", b"well \xff\xfe known")
    comp = bz2.compress(data, compresslevel=1)  # 100 kB blocks: a cut file keeps whole early blocks
    path.write_bytes(comp[: len(comp) * 2 // 3] if truncate else comp)


def test_read_wikipedia_dump(tmp_path):
    pages = [page(1, "Foo", ARTICLE), page(2, "Redir", "#REDIRECT [[Foo]]", redirect=True),
             page(3, "Talk:Foo", "talk text. More.", ns=1), page(4, "Foo (disambiguation)", "'''Foo''' may be: a. b."),
             page(5, "Broken", "x")[: -12] + "\n", page(6, "Other", "Second article. It has two sentences.")]
    write_dump(tmp_path / "a.xml.bz2", pages, bad_bytes=True)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        docs = p | ReadWikipediaDump(str(tmp_path / "a.xml.bz2"))
        assert_that(docs, equal_to([
            ("wiki:1", "Foo is a bar in Baz. It is well known.\n\nFoo was made in 1900. It grew."),
            ("wiki:6", "Second article. It has two sentences."),
        ]))
    res = p.result.metrics().query()["counters"]
    names = {c.key.metric.name: c.committed for c in res}
    assert names["skipped_wiki_redirect"] == 1 and names["skipped_wiki_not_article_namespace"] == 1
    assert names["skipped_wiki_disambiguation"] == 1 and names["skipped_wiki_malformed_page"] == 1
    assert names["repaired_non_utf8"] == 1


def test_truncated_bz2_keeps_pages_before_damage(tmp_path):
    pages = [page(i, f"T{i}", f"Article number {i} text. Second sentence here. " * 20) for i in range(1, 400)]
    write_dump(tmp_path / "t.xml.bz2", pages, truncate=True)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        docs = p | ReadWikipediaDump(str(tmp_path / "t.xml.bz2"))
        assert_that(docs | beam.combiners.Count.Globally(), lambda n: _check(0 < n[0] < 399))
    names = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert names["truncated_input_file"] == 1


def _check(cond):
    assert cond


def test_read_books_strips_gutenberg(tmp_path):
    (tmp_path / "b1.txt").write_text("The Project Gutenberg EBook of X\nlicence blah\n"
                                     "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nCall me Ishmael. Some years ago.\n"
                                     "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nfooter licence\n")
    (tmp_path / "b2.txt").write_bytes(b"Plain book \xff text. Second.\n")
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        docs = p | ReadBooks(str(tmp_path)) | SplitSentences()
        assert_that(docs, equal_to([("books:b1.txt", ["Call me Ishmael.", "Some years ago."]),
                                    ("books:b2.txt", ["Plain book text.", "Second."])]))


def test_read_bert_text_and_jsonl(tmp_path):
    (tmp_path / "c.txt").write_text("Sent one.\nSent two.\n\n\nDoc two a.\nDoc two b.\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "Hello there. General Kenobi.", "id": "k1"}) + "\n{broken\n"
                                      + json.dumps({"other": 1}) + "\n")
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        t = p | ReadBertFormatText(str(tmp_path / "c.txt"))  # ids are byte offsets
        assert_that(t, equal_to([("text:c.txt:0", ["Sent one.", "Sent two."]), ("text:c.txt:22", ["Doc two a.", "Doc two b."])]),
                    label="text")
        # a 7-byte split: four ranges, the same two documents, each read once
        t7 = p | "split" >> ReadBertFormatText(str(tmp_path / "c.txt"), split_bytes=7)
        assert_that(t7, equal_to([("text:c.txt:0", ["Sent one.", "Sent two."]),
                                  ("text:c.txt:22", ["Doc two a.", "Doc two b."])]), label="text7")
        j = p | ReadJsonLines(str(tmp_path / "d.jsonl"), text_field="body", id_field="id") | SplitSentences()
        assert_that(j, equal_to([("jsonl:d.jsonl:k1", ["Hello there.", "General Kenobi."])]), label="jsonl")
    names = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert names["skipped_malformed_json_line"] == 1 and names["skipped_json_missing_text_field"] == 1


def test_tokenize_instances_and_write(tmp_path, small_vocab):
    from data_pipeline.pipeline import instance_params
    from data_pipeline.config import DataConfig
    from bertdist.data.vocab import load_vocab
    import pyarrow.parquet as pq

    tokens = load_vocab(small_vocab)
    docs = [(f"d{i}", [f"Sentence {j} of document {i} is here." for j in range(30)]) for i in range(12)]
    docs += [("empty", []), ("one", ["Only one sentence."])]
    cfg = DataConfig(max_seq_length=32, dupe_factor=2)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        tok = p | beam.Create(docs) | Tokenize(str(small_vocab))
        assert_that(tok | beam.Map(lambda d: (d[0], len(d[2]) - 1)), equal_to([(f"d{i}", 30) for i in range(12)]),
                    label="tok")
        inst = tok | CreateInstances(instance_params(cfg, tokens), seed=1, dupe_factor=2,
                                     vocab_path=str(small_vocab), scratch_dir=str(tmp_path / "docs"), spill_tokens=500)
        assert_that(inst | "n" >> beam.MapTuple(lambda split, b: (split, len(b) > 0)),
                    equal_to([("train", True)] * 12), label="inst")
        # 40 rows per bucket: several buckets, most straddling a shard boundary; spills every 100 rows
        written = inst | WriteShards(str(tmp_path), {"train": SplitShards(3, expected_rows=300)}, len(tokens), 16,
                                     "zstd", rows_per_bucket=40, spill_rows=100)
        assert_that(written | beam.Map(lambda s: s["rows"]) | beam.combiners.ToList(),
                    lambda r: _check(len(r[0]) == 3 and max(r[0]) - min(r[0]) <= 1), label="rows")
    names = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert names["skipped_empty_document"] == 1 and names["skipped_too_few_sentences"] == 1
    assert names["train_spill_files"] >= 3  # rows went through several run files
    t = pq.read_table(tmp_path / "train-00000-of-00003.parquet")
    assert t.num_rows > 0 and max(len(x) for x in t.column("input_ids").to_pylist()) <= 32
    assert not list((tmp_path / "parts").iterdir())  # every part file was streamed into a shard and removed
    # shards are consecutive key ranges, each sorted: the rows of all shards in order are sorted by key
    import hashlib, json
    for i in range(3):
        side = json.loads((tmp_path / f"train-{i:05d}-of-00003.parquet.json").read_text())
        assert side["sha256"] == hashlib.sha256((tmp_path / side["path"]).read_bytes()).hexdigest()
        assert side["bytes"] == (tmp_path / side["path"]).stat().st_size


def test_splits_share_the_transforms_and_never_mix(tmp_path, small_vocab):
    """Train and held-out documents go through one CreateInstances + WriteShards, keyed by split:
    each split gets its own balanced shards, and an NSP negative comes from its own split only."""
    import pyarrow.parquet as pq

    from bertdist.data.vocab import load_vocab
    from data_pipeline.config import DataConfig
    from data_pipeline.negatives import HeldOutSplit
    from data_pipeline.pipeline import instance_params

    tokens = load_vocab(small_vocab)
    # document i holds only ids 1000 + 10 i ... 1000 + 10 i + 9 (unmasked records keep them; the
    # special tokens are below 1000), so every token of a row names the document it came from
    docs = []
    for i in range(40):
        ids = np.array([1000 + 10 * i + (j % 10) for j in range(20 * 12)], np.uint16)
        docs.append((f"doc{i}", ids, np.arange(0, 241, 12, dtype=np.int64)))
    split_of = HeldOutSplit.from_fraction(0.3)
    want = {d[0]: split_of(d[0]) for d in docs}
    assert set(want.values()) == {"train", "heldout"}
    cfg = DataConfig(max_seq_length=48, dupe_factor=2, masking="dynamic")
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        (p | beam.Create(docs)
         | CreateInstances(instance_params(cfg, tokens), seed=3, dupe_factor=2, vocab_path=str(small_vocab),
                           scratch_dir=str(tmp_path / "docs"), heldout_fraction=0.3, spill_tokens=700)
         | WriteShards(str(tmp_path), {"train": SplitShards(3, 200), "heldout": SplitShards(2, 80)}, len(tokens), 16,
                       "zstd", rows_per_bucket=30, spill_rows=50))
    counters = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    doc_split = {i: want[f"doc{i}"] for i in range(40)}
    for split, n in (("train", 3), ("heldout", 2)):
        rows = [pq.read_table(tmp_path / f"{split}-{s:05d}-of-{n:05d}.parquet").num_rows for s in range(n)]
        assert max(rows) - min(rows) <= 1 and sum(rows) == counters[f"{split}_instances"] > 0
        negatives = 0
        for s in range(n):
            t = pq.read_table(tmp_path / f"{split}-{s:05d}-of-{n:05d}.parquet")
            for ids, nsp in zip(t.column("input_ids").to_pylist(), t.column("next_sentence_label").to_pylist()):
                from_docs = {(i - 1000) // 10 for i in ids if i >= 1000}
                assert {doc_split[d] for d in from_docs} == {split}, (split, from_docs)
                negatives += nsp == 1 and len(from_docs) == 2
        assert negatives > 0  # random-next rows did draw from another document of the same split
    assert counters["heldout_random_next"] > 0 and counters["train_random_next"] > 0


def test_write_shards_rejects_a_split_it_was_not_given(tmp_path):
    import pytest

    from data_pipeline.instance_batch import InstanceBatch

    batch = InstanceBatch(keys=np.array([1], np.uint64), ids=np.array([2, 3], np.uint16), ids_offsets=np.array([0, 2]),
                          num_a=np.array([1], np.uint16), nsp=np.array([0], np.int8), mpos=np.empty(0, np.uint16),
                          mids=np.empty(0, np.uint16), m_offsets=np.zeros(2, np.int64))
    with pytest.raises(Exception, match="split 'dev' reached WriteShards, which writes \\['train'\\]"):
        with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
            (p | beam.Create([("dev", batch)])
             | WriteShards(str(tmp_path), {"train": SplitShards(1, 10)}, 100, 16, "zstd"))


def test_instances_do_not_depend_on_how_the_work_is_cut(tmp_path, small_vocab):
    """How the spilled documents are sliced (slot_bits), how many work units there are and how
    big the spill files are change nothing in the shards; the plan and the units' reports add up
    to what was written. Small buckets (bucket_tokens) make several per split."""
    import hashlib
    import json

    import pyarrow.parquet as pq

    from bertdist.data.vocab import load_vocab
    from data_pipeline.config import DataConfig
    from data_pipeline.pipeline import instance_params

    tokens = load_vocab(small_vocab)
    rng = np.random.default_rng(5)
    docs = []
    for i in range(60):
        lens = rng.integers(4, 20, size=int(rng.integers(3, 40)))
        bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        docs.append((f"doc{i}", rng.integers(1000, 2999, size=int(bounds[-1])).astype(np.uint16), bounds))
    cfg = DataConfig(max_seq_length=48, dupe_factor=2)
    shards = {}
    for name, cut in (("coarse", dict(slot_bits=2, target_units=1, spill_tokens=100_000)),
                      ("fine", dict(slot_bits=7, target_units=9, spill_tokens=400))):
        out = tmp_path / name
        with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
            (p | beam.Create(docs)
             | CreateInstances(instance_params(cfg, tokens), seed=3, dupe_factor=2, vocab_path=str(small_vocab),
                               scratch_dir=str(out / "docs"), report_dir=str(out / "report"), heldout_fraction=0.1,
                               heldout_min_documents=12, bucket_tokens=4000, **cut)
             | WriteShards(str(out), {"train": SplitShards(2, 300), "heldout": SplitShards(1, 60)}, len(tokens), 16,
                           "zstd", rows_per_bucket=50, spill_rows=80))
        shards[name] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.glob("*.parquet"))}
        plans = [json.loads(f.read_text()) for f in (out / "report").glob("plan-*.json")]
        plan = plans[0]
        assert plans and all(p == plan for p in plans)
        units = [json.loads(f.read_text()) for f in (out / "report" / "units").glob("*.json")]
        assert plan["documents"] == {"train": 48, "heldout": 12} and len(plan["buckets"]["train"]) > 1
        for split, n in (("train", 2), ("heldout", 1)):
            mine = [u for u in units if u["split"] == split]
            rows = sum(pq.read_metadata(out / f"{split}-{i:05d}-of-{n:05d}.parquet").num_rows for i in range(n))
            assert sum(u["documents"] for u in mine) == plan["documents"][split]
            assert sum(u["instances"] for u in mine) == rows > 0
            negatives = sum(u["random_next"] for u in mine)
            assert 0.97 * negatives <= sum(u["distinct_windows"] for u in mine) <= negatives
            assert max(u["max_window_reuse"] for u in mine) <= 2
        if name == "fine":
            assert len(units) > len(plan["buckets"]["train"]) + 1  # buckets were cut into several units
    assert shards["coarse"] == shards["fine"] and len(shards["fine"]) == 3
