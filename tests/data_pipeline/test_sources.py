"""data_pipeline.sources: the BERT-format reader against its plain definition."""
from __future__ import annotations

import bz2
import io
import random

from data_pipeline.sources import decode_text_line, iter_bert_format
from data_pipeline.text import clean_line


def plain_bert_format(data: bytes) -> tuple[list[tuple[int, list[str]]], list[str]]:
    """The format's definition, line by line: each line decoded on its own (UTF-8, else the
    detected encoding, else skipped) and cleaned; a document is a run of non-blank lines (an
    undecodable line is part of it, without a sentence), its id the byte offset of its first
    line. Returns (documents, the encodings of the lines that were not UTF-8)."""
    docs, sents, doc_at, pos, in_doc, encodings = [], [], 0, 0, False, []
    for raw in io.BytesIO(data):
        line, enc = decode_text_line(raw)
        if enc is not None:
            encodings.append(enc)
        line = clean_line(line)
        if line or enc == "undecodable":
            if not in_doc:
                doc_at, in_doc = pos, True
            if line:
                sents.append(line)
        elif in_doc:
            if sents:
                docs.append((doc_at, sents))
            sents, in_doc = [], False
        pos += len(raw)
    if sents:
        docs.append((doc_at, sents))
    return docs, encodings


PIECES = ["a b.", "  lead", "trail  ", "ü é", "e\u0301", "\u0301starts with a mark", "\x01ctl", "\u00a0nb",
          "tab\tin", "wide\u3000space", "en\u2000quad", "\u2001", "Ωμέγα", "日本語", "\ufffe", "crlf\r", "nel\x85",
          "ls\u2028", "x" * 40]
BLANKS = ["", "  ", "\t", "\x01", "\u00a0", " \u3000\x7f", "\r"]


def _random_file(r: random.Random) -> bytes:
    lines = []
    for _ in range(r.randint(0, 8)):
        lines += ["".join(r.choice(PIECES) for _ in range(r.randint(1, 3))) for _ in range(r.randint(1, 5))]
        lines += [r.choice(BLANKS) for _ in range(r.randint(1, 3))]
    data = ("\n".join(lines) + r.choice(["", "\n"])).encode()
    if data and r.random() < 0.3:  # invalid UTF-8 somewhere: that line is decoded otherwise or skipped, and counted
        at = r.randrange(len(data))
        data = data[:at] + r.choice([b"\xff", b"\xc3", b"\xe6\x97"]) + data[at:]
    return data


def test_block_reader_equals_the_line_by_line_definition():
    """Block-wise decoding and cleaning (any block size) gives the documents and encoding counts
    of the plain line-by-line definition, also when read in byte ranges."""
    r = random.Random(1)
    for _ in range(600):
        data = _random_file(r)
        want, want_encodings = plain_bert_format(data)
        want_events = sorted("skipped_undecodable_line" if e == "undecodable" else f"decoded_{e}"
                             for e in want_encodings)
        for block in (1, 7, 64, 1 << 20):
            out = list(iter_bert_format(io.BytesIO(data), block_bytes=block))
            assert [x for x in out if x[0] != "!event"] == want, (data, block)
            assert sorted(x[1] for x in out if x[0] == "!event") == want_events, (data, block)
        cuts = sorted(r.sample(range(1, len(data) + 1), min(len(data), r.randint(0, 4))))
        bounds = [0, *cuts, None]
        got = [x for a, b in zip(bounds[:-1], bounds[1:])
               for x in iter_bert_format(io.BytesIO(data), a, b, block_bytes=r.choice([3, 50, 1 << 20]))
               if x[0] != "!event"]
        assert got == want, (data, bounds)


def test_truncated_compressed_input_keeps_the_lines_before_the_damage():
    lines = [f"Sentence {i} of the first document." for i in range(40000)] + ["", "Second document."]
    packed = bz2.compress("\n".join(lines).encode(), compresslevel=1)  # 100 kB blocks: damage mid-file
    stream = bz2.BZ2File(io.BytesIO(packed[: len(packed) * 2 // 3]))  # cut mid-stream
    out = list(iter_bert_format(stream, block_bytes=1 << 20))  # one block would hold the whole file
    assert ("!event", "truncated_input_file") in out
    docs = [x for x in out if x[0] != "!event"]
    assert len(docs) == 1 and docs[0][0] == 0
    kept = docs[0][1]
    assert kept == lines[: len(kept)] and len(kept) > 100  # everything before the damage, in order


def test_bert_format_byte_ranges_read_every_document_once():
    """Any cut of a file into byte ranges yields exactly the documents of one whole read."""
    r = random.Random(0)
    for _ in range(300):
        lines = []
        for _doc in range(r.randint(0, 6)):
            lines += [r.choice(["a b.", "  lead", "x" * r.randint(1, 30), "ü é", "\x01ctl", "\u00a0nb"])
                      + ("\r" if r.random() < 0.1 else "") for _ in range(r.randint(1, 4))]
            # blank after cleaning too: control characters and Unicode spaces only
            lines += [r.choice(["", "  ", "\t", "\x01", "\u00a0", " \u3000\x7f"]) for _ in range(r.randint(1, 3))]
        data = ("\n".join(lines) + r.choice(["", "\n"])).encode()
        whole = [x for x in iter_bert_format(io.BytesIO(data)) if x[0] != "!event"]
        cuts = sorted(r.sample(range(1, len(data) + 1), min(len(data), r.randint(0, 5))))
        bounds = [0, *cuts, None]
        got = [x for a, b in zip(bounds[:-1], bounds[1:])
               for x in iter_bert_format(io.BytesIO(data), a, b) if x[0] != "!event"]
        assert got == whole, (data, bounds)
