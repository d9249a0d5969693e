"""data_pipeline.beam.read: each reader under TestPipeline with assert_that, including bad input."""
from __future__ import annotations

import bz2
import json

import apache_beam as beam
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from data_pipeline.beam.read import ReadBertFormatText, ReadBooks, ReadJsonLines, ReadWikipediaDump
from data_pipeline.beam.tokenize import SplitLines, SplitSentences
from tests.data_pipeline.beam._util import OPTS, _check


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
        data = data.replace(b"well known", b"well kn\xf6wn")  # one latin-1 letter: that page is decoded as such
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
            ("wiki:1", "Foo is a bar in Baz. It is well kn\u00f6wn.\n\nFoo was made in 1900. It grew."),
            ("wiki:6", "Second article. It has two sentences."),
        ]))
    res = p.result.metrics().query()["counters"]
    names = {c.key.metric.name: c.committed for c in res}
    assert names["skipped_wiki_redirect"] == 1 and names["skipped_wiki_not_article_namespace"] == 1
    assert names["skipped_wiki_disambiguation"] == 1 and names["skipped_wiki_malformed_page"] == 1
    assert names.get("decoded_cp1252") == 1, names


def test_truncated_bz2_keeps_pages_before_damage(tmp_path):
    pages = [page(i, f"T{i}", f"Article number {i} text. Second sentence here. " * 20) for i in range(1, 400)]
    write_dump(tmp_path / "t.xml.bz2", pages, truncate=True)
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        docs = p | ReadWikipediaDump(str(tmp_path / "t.xml.bz2"))
        assert_that(docs | beam.combiners.Count.Globally(), lambda n: _check(0 < n[0] < 399))
    names = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert names["truncated_input_file"] == 1


def test_read_books_strips_gutenberg(tmp_path):
    (tmp_path / "b1.txt").write_text("The Project Gutenberg EBook of X\nlicence blah\n"
                                     "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nCall me Ishmael. Some years ago.\n"
                                     "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nfooter licence\n")
    (tmp_path / "b2.txt").write_bytes("Plain book, caf\u00e9 text. Second.\n".encode("latin-1"))
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        docs = p | ReadBooks(str(tmp_path)) | SplitSentences()
        assert_that(docs, equal_to([("books:b1.txt", ["Call me Ishmael.", "Some years ago."]),
                                    ("books:b2.txt", ["Plain book, caf\u00e9 text.", "Second."])]))


def test_read_bert_text_and_jsonl(tmp_path):
    (tmp_path / "c.txt").write_text("Sent one.\nSent two.\n\n\nDoc two a.\nDoc two b.\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "Hello there. General Kenobi.", "id": "k1"}) + "\n{broken\n"
                                      + json.dumps({"other": 1}) + "\n")
    with TestPipeline(options=beam.options.pipeline_options.PipelineOptions(OPTS)) as p:
        t = p | ReadBertFormatText(str(tmp_path / "c.txt"))  # ids are byte offsets
        assert_that(t, equal_to([("text:c.txt:0", "Sent one.\nSent two."), ("text:c.txt:22", "Doc two a.\nDoc two b.")]),
                    label="text")
        # a 7-byte split: four ranges, the same two documents, each read once
        t7 = p | "split" >> ReadBertFormatText(str(tmp_path / "c.txt"), split_bytes=7) | SplitLines()
        assert_that(t7, equal_to([("text:c.txt:0", ["Sent one.", "Sent two."]),
                                  ("text:c.txt:22", ["Doc two a.", "Doc two b."])]), label="text7")
        j = p | ReadJsonLines(str(tmp_path / "d.jsonl"), text_field="body", id_field="id") | SplitSentences()
        assert_that(j, equal_to([("jsonl:d.jsonl:k1", ["Hello there.", "General Kenobi."])]), label="jsonl")
    names = {c.key.metric.name: c.committed for c in p.result.metrics().query()["counters"]}
    assert names["skipped_malformed_json_line"] == 1 and names["skipped_json_missing_text_field"] == 1


def test_bert_format_range_size_balances_small_inputs_and_caps_large_ones():
    auto = ReadBertFormatText.auto_split_bytes
    assert auto(10 << 20) == 1 << 20  # the 10 MB reference workload: 10 ranges, not 8 MB + 2 MB
    assert auto(64 << 20) == 2 << 20
    assert auto(10 << 30) == 8 << 20 and auto(1000) == 1 << 20
