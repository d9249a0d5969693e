"""Reading the four source formats (pure generators over an open binary stream).

Each yields documents as ``(local_id, text_or_sentences)`` plus skip/repair events as
``("!event", name)`` tuples, so the Beam DoFns can count them and the vocab trainer can reuse
the same readers without Beam.
"""
from __future__ import annotations

import bz2
import gzip
import io
import json
import zlib
from typing import BinaryIO, Iterator

from data_pipeline.text import clean_line, decode_bytes


def open_input(path: str) -> BinaryIO:
    """Open any Beam filesystem path as a binary stream, decompressing .bz2/.gz (multistream ok)."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    raw = FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED)
    if path.endswith(".bz2"):
        return bz2.BZ2File(raw)
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    return raw


# errors a truncated or corrupt compressed stream raises mid-read
STREAM_ERRORS = (EOFError, OSError, zlib.error, ValueError)


def read_text_document(stream: BinaryIO, max_chars: int) -> tuple[str, list[str]]:
    """A whole small-to-large document (a book). Returns (text, events)."""
    events = []
    try:
        data = stream.read(max_chars * 4 + 1)  # utf-8 is at most 4 bytes per char
    except STREAM_ERRORS:
        return "", ["skipped_unreadable_file"]
    text, repaired = decode_bytes(data)
    if repaired:
        events.append("repaired_non_utf8")
    if len(text) > max_chars:
        text = text[:max_chars]
        events.append("repaired_truncated_enormous_document")
    return text, events


def iter_bert_format(stream: BinaryIO) -> Iterator[tuple[int, list[str]] | tuple[str, str]]:
    """One sentence per line, blank line between documents. Yields (doc_index, sentences)."""
    sents: list[str] = []
    index = 0
    try:
        for raw in stream:
            line, repaired = decode_bytes(raw)
            if repaired:
                yield ("!event", "repaired_non_utf8")
            line = clean_line(line)
            if line:
                sents.append(line)
            elif sents:
                yield (index, sents)
                index, sents = index + 1, []
    except STREAM_ERRORS:
        yield ("!event", "truncated_input_file")
    if sents:
        yield (index, sents)


def iter_json_lines(stream: BinaryIO, text_field: str, id_field: str) -> Iterator[tuple[str, str] | tuple[str, str]]:
    """Yields (doc_id, text) per JSON line; bad lines yield events."""
    lineno = 0
    try:
        for raw in stream:
            lineno += 1
            if not raw.strip():
                continue
            line, repaired = decode_bytes(raw)
            if repaired:
                yield ("!event", "repaired_non_utf8")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                yield ("!event", "skipped_malformed_json_line")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                yield ("!event", "skipped_json_missing_text_field")
                continue
            doc_id = str(obj.get(id_field)) if id_field and obj.get(id_field) is not None else str(lineno)
            yield (doc_id, obj[text_field])
    except STREAM_ERRORS:
        yield ("!event", "truncated_input_file")


def iter_lines_safely(stream: BinaryIO) -> Iterator[bytes]:
    """Lines of a possibly truncated compressed stream; stops cleanly at the damage."""
    try:
        yield from stream
    except STREAM_ERRORS:
        return


