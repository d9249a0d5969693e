"""Bounded work per input: no reader holds a line of unknown size, and a range of a file without
newlines is read in linear time. Decompression bombs are made here, a MiB of zeros at a time."""
import bz2
import gzip
import io
import random
import time
import tracemalloc

import pytest

from data_pipeline import sources
from data_pipeline.sources import iter_bert_format, iter_json_lines, open_input
from data_pipeline.wikitext import iter_page_blobs

MiB = 1 << 20


def _bomb(path, mib: int, opener) -> None:
    """``mib`` MiB of zero bytes (no newline anywhere), compressed: a few hundred bytes on disk."""
    zeros = bytes(MiB)
    with opener(path, "wb") as f:
        for _ in range(mib):
            f.write(zeros)


def _peak_mib(fn) -> float:
    """The peak of Python allocations while ``fn`` runs (deterministic, unlike RSS)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MiB
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    _bomb(d / "dump.xml.bz2", 128, bz2.open)
    _bomb(d / "text.txt.gz", 128, gzip.open)
    _bomb(d / "docs.jsonl.gz", 128, gzip.open)
    return d


@pytest.mark.slow  # 3 x 128 MiB decompressed: about 10 s
def test_decompression_bombs_are_read_in_bounded_memory_and_counted(bombs):
    assert (bombs / "dump.xml.bz2").stat().st_size < 4096  # what a user might be handed

    def wiki():
        with open_input(str(bombs / "dump.xml.bz2")) as s:
            assert list(iter_page_blobs(s, 64 * MiB)) == [("junk", b"")]  # counted, once

    def text():
        with open_input(str(bombs / "text.txt.gz")) as s:
            events = [x for x in iter_bert_format(s) if x[0] == "!event"]
        assert events == [("!event", "skipped_overlong_line")]

    def jsonl():
        with open_input(str(bombs / "docs.jsonl.gz")) as s:
            assert list(iter_json_lines(s, "text", "id")) == [("!event", "skipped_overlong_json_line")]

    # a few pieces of one line at most (the decompressor keeps its own buffers); before: the whole 128 MiB
    assert _peak_mib(wiki) < 8 * sources.MAX_LINE_BYTES / MiB
    assert _peak_mib(text) < 8 * sources.MAX_LINE_BYTES / MiB
    assert _peak_mib(jsonl) < 3 * sources.MAX_JSON_LINE_BYTES / MiB  # its pieces, and their join


def test_an_overlong_line_in_a_page_makes_it_oversized_and_the_next_page_is_read(monkeypatch):
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 64)
    import data_pipeline.wikitext as wt

    monkeypatch.setattr(wt, "MAX_LINE_BYTES", 64)
    dump = (b"<mediawiki>\n<page>\n<title>A</title>\n<text>" + b"x" * 500 + b"</text>\n</page>\n"
            b"<page>\n<title>B</title>\n</page>\n</mediawiki>\n")
    got = list(iter_page_blobs(io.BytesIO(dump), 10_000))
    assert [k for k, _ in got] == ["oversized", "page"] and b"<title>B</title>" in got[1][1]


def test_junk_outside_pages_is_counted_once_per_run():
    dump = (b"<mediawiki>\n  <siteinfo>\n    <sitename>W</sitename>\n  </siteinfo>\n\x00\x00\x00\n\x00\n\n"
            b"<page>\n<title>A</title>\n</page>\nstray text\n<page>\n<title>B</title>\n</page>\n</mediawiki>\n")
    got = [k for k, _ in iter_page_blobs(io.BytesIO(dump), 10_000)]
    assert got == ["junk", "page", "junk", "page"]


def test_byte_ranges_read_every_document_once_around_overlong_lines(monkeypatch):
    """The range reader's contract (every document exactly once, for any cut) holds with lines
    over the limit: skipped where they are, whatever range they fall in."""
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 8)
    r = random.Random(1)
    for _ in range(300):
        lines = []
        for _doc in range(r.randint(0, 5)):
            lines += [r.choice(["a b.", "word", "y" * r.randint(5, 40), "ü é", "\u00a0nb x" * r.randint(1, 4)])
                      for _ in range(r.randint(1, 4))]
            lines += [r.choice(["", "  ", "\t" * r.randint(1, 20), "\u00a0"]) for _ in range(r.randint(1, 2))]
        data = ("\n".join(lines) + r.choice(["", "\n"])).encode()
        whole = [x for x in iter_bert_format(io.BytesIO(data)) if x[0] != "!event"]
        cuts = sorted(r.sample(range(1, len(data) + 1), min(len(data), r.randint(0, 6))))
        bounds = [0, *cuts, None]
        got = [x for a, b in zip(bounds[:-1], bounds[1:])
               for x in iter_bert_format(io.BytesIO(data), a, b) if x[0] != "!event"]
        assert got == whole, (data, bounds)
        for _, sents in whole:
            assert all(len(s.encode()) < 8 for s in sents)


@pytest.mark.slow  # reads 64 MiB a few times over
def test_ranges_of_a_64_mib_file_without_newlines_take_linear_time_and_bounded_memory(tmp_path):
    path = tmp_path / "minified.txt"
    with open(path, "wb") as f:
        for _ in range(64):
            f.write(b"x" * MiB)
    size = path.stat().st_size
    bounds = [0, size // 4, size // 2, 3 * size // 4, None]

    def read_ranges():
        for a, b in zip(bounds[:-1], bounds[1:]):
            with open(path, "rb") as f:
                list(iter_bert_format(f, a, b))

    t0 = time.perf_counter()
    peak = _peak_mib(read_ranges)
    # a hang guard, not a speed target: the quadratic search took minutes at this size
    assert time.perf_counter() - t0 < 60
    assert peak < 8 * sources.MAX_LINE_BYTES / MiB  # the old reader held about 4x the file
