"""Reading the four source formats (pure generators over an open binary stream).

Each yields documents as ``(local_id, text_or_sentences)`` plus skip/repair events as
``("!event", name)`` tuples, so the Beam DoFns can count them and the vocab trainer can reuse
the same readers without Beam.
"""
from __future__ import annotations

import bz2
import functools
import glob
import gzip
import json
import os
import zlib
from typing import BinaryIO, Iterator

from data_pipeline.decoding import decode_document, decode_strict
from data_pipeline.text import clean_line, clean_lines


# which files a directory input means, per source kind
DIRECTORY_SUFFIX = {"wiki": "*.xml*", "books": "*.txt", "jsonl": "*.jsonl*", "text": "*"}


def is_local(path: str) -> bool:
    """A path without a URL scheme (gs://, s3://, hdfs://...): read without Beam's filesystems, so
    vocab training and the tests need no Beam."""
    return "://" not in path


def match_file_sizes(pattern: str, *, directory_suffix: str = "*") -> dict[str, int]:
    """Expand a path, directory or glob, local or on any Beam filesystem: {path: size in bytes},
    sorted by path (for stable ids). Hidden files match, as they do on Beam's filesystems."""
    if is_local(pattern):
        # absolute: the paths go to workers, whose working folder is not the launcher's
        pattern = os.path.abspath(pattern)
        pat = os.path.join(pattern, directory_suffix) if os.path.isdir(pattern) else pattern
        paths = glob.glob(pat, recursive=True, include_hidden=True) if glob.has_magic(pat) else [pat]
        sizes = {p: os.path.getsize(p) for p in paths if os.path.isfile(p)}
    else:
        from apache_beam.io.filesystems import FileSystems

        # an object-store "directory" is a prefix ending in "/": Beam's match appends "*" to it
        sizes = {m.path: m.size_in_bytes for r in FileSystems.match([pattern]) for m in r.metadata_list}
    if not sizes:
        raise FileNotFoundError(f"no input files match {pattern!r}")
    return dict(sorted(sizes.items()))


def match_files(pattern: str, *, directory_suffix: str = "*") -> list[str]:
    return list(match_file_sizes(pattern, directory_suffix=directory_suffix))


def relative_ids(paths: list[str]) -> dict[str, str]:
    """Document-id prefix per file: its path relative to the files' common directory, so ids
    (and so the output) do not depend on where the corpus is mounted."""
    if len(paths) == 1:
        return {paths[0]: os.path.basename(paths[0])}
    common = os.path.commonpath(paths) if all(p.startswith("/") for p in paths) else os.path.dirname(os.path.commonprefix(paths))
    return {p: os.path.relpath(p, common) if common else p for p in paths}


def open_input(path: str) -> BinaryIO:
    """Open a local path or any Beam filesystem path as a binary stream, decompressing .bz2/.gz
    (multistream ok)."""
    if is_local(path):
        raw = open(path, "rb")
    else:
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
# The longest line read whole. A longer one (minified or binary data, a decompression bomb) is
# consumed in pieces of this size, skipped and counted: no reader ever holds a line of unknown size.
MAX_LINE_BYTES = 1 << 20
# A JSONL line is a whole document (a book is a few MB).
MAX_JSON_LINE_BYTES = 16 << 20


def _rest_of_line(readline, limit: int) -> int:
    """Read and drop the rest of the current line, ``limit`` bytes at a time; its length."""
    n = 0
    while True:
        more = readline(limit)
        n += len(more)
        if len(more) < limit or more.endswith(b"\n"):
            return n


def read_line(readline, limit: int) -> tuple[bytes | None, int]:
    """The next line (b"" at the end) and its length in bytes; (None, length) for a line longer
    than ``limit``, whose bytes are read and dropped, never held whole. Read in pieces of at most
    MAX_LINE_BYTES, so that a long limit costs memory only for a line that long."""
    piece = min(limit, MAX_LINE_BYTES)
    raw = readline(piece)
    if len(raw) < piece or raw.endswith(b"\n"):
        return raw, len(raw)
    parts, size = [raw], len(raw)
    while size < limit:
        more = readline(min(piece, limit - size))
        parts.append(more)
        size += len(more)
        if not more or more.endswith(b"\n"):
            return b"".join(parts), size
    return None, size + _rest_of_line(readline, piece)


class _SkippedLine:
    """An over-long line's place in a block of lines: its length, for byte offsets, and no bytes."""
    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


def decoded_event(encoding: str) -> str:
    """The counter of documents (or lines) decoded from ``encoding`` (the manifest's "encodings")."""
    return f"decoded_{encoding}"


def read_text_document(stream: BinaryIO, max_chars: int) -> tuple[str | None, list[str]]:
    """A whole small-to-large document (a book). Returns (text, events); text is None when the
    file cannot be read or decoded with confidence (see data_pipeline.decoding)."""
    events = []
    try:
        data = stream.read(max_chars * 4 + 1)  # utf-8 is at most 4 bytes per char
    except STREAM_ERRORS:
        return None, ["skipped_unreadable_file"]
    decoded = decode_document(data)
    if decoded is None:
        return None, ["skipped_undecodable_document"]
    text = decoded.text
    events.append(decoded_event(decoded.encoding))
    if len(text) > max_chars:
        text = text[:max_chars]
        events.append("repaired_truncated_enormous_document")
    return text, events


def _line_before_is_blank(stream: BinaryIO, pos: int, chunk: int = 1 << 16) -> bool:
    """Is the line that ends at byte ``pos - 1`` blank (or is ``pos`` the start of the file)?
    Reads backwards from ``pos`` to that line's start, in chunks joined once (linear); a line
    longer than MAX_LINE_BYTES is an over-long line, which is not blank (the reader skips it as a
    line of its document). ``stream`` must be seekable."""
    if pos <= 0:
        return True
    pieces: list[bytes] = []
    end, got = pos, 0
    while True:
        lo = max(0, end - chunk)
        stream.seek(lo)
        piece = stream.read(end - lo)
        # the newline that ends the line before: not the byte at pos - 1, which ends this one
        cut = piece.rfind(b"\n", 0, len(piece) - 1 if not pieces else len(piece))
        if cut >= 0 or lo == 0:
            pieces.append(piece[cut + 1:])
            line = b"".join(reversed(pieces))
            if len(line) > MAX_LINE_BYTES + 1:
                return False
            text, enc = decode_text_line(line)
            return enc != "undecodable" and not clean_line(text)
        pieces.append(piece)
        got += len(piece)
        if got > MAX_LINE_BYTES + 1:
            return False
        end = lo


def _surely_not_blank(raw: bytes) -> bool:
    """True when ``clean_line`` surely keeps something of this line: its first non-space byte is
    printable ASCII (control characters, NBSP and other Unicode spaces need the full check)."""
    s = raw.lstrip()
    return bool(s) and 32 < s[0] < 127


def _read_lines(stream: BinaryIO, size: int) -> tuple[list, bool, list[int]]:
    """Whole lines, about ``size`` bytes of them, whether the stream broke (a truncated
    compressed file: the lines read before the damage are kept), and the indices of over-long
    lines, which stand in the list as a _SkippedLine (their length, no bytes)."""
    raws: list = []
    skipped: list[int] = []
    total = 0
    limit = MAX_LINE_BYTES
    readline = stream.readline
    try:
        for raw in iter(functools.partial(readline, limit), b""):  # C-level iteration, bounded lines
            if len(raw) == limit and not raw.endswith(b"\n"):
                raw = _SkippedLine(len(raw) + _rest_of_line(readline, limit))
                skipped.append(len(raws))
            raws.append(raw)
            total += len(raw)
            if total >= size:
                break
    except STREAM_ERRORS:
        return raws, True, skipped
    return raws, False, skipped


def decode_text_line(raw: bytes) -> tuple[str, str | None]:
    """One line of BERT-format text: (text, encoding when it was not UTF-8). Each line on its
    own, so that the result does not depend on how a file is cut into ranges; a line that cannot
    be decoded with confidence is ("", "undecodable"): skipped and counted, never a document break."""
    text = decode_strict(raw)
    if text is not None:
        return text, None
    decoded = decode_document(raw)
    return (decoded.text, decoded.encoding) if decoded is not None else ("", "undecodable")


def _clean_lines(lines: list[bytes]) -> tuple[list[str | None], list[str]]:
    """``clean_line(decode_text_line(line))`` of every line (each ends with "\n" but maybe the
    last; None for an undecodable one), and the encodings of the lines that were not UTF-8. A block of valid UTF-8 is decoded
    and cleaned whole (``clean_lines``), at a fraction of the per-line calls."""
    block = b"".join(lines)
    text = decode_strict(block)
    if text is None:  # rare: line by line, so every line decoded otherwise is counted
        out, encodings = [], []
        for raw in lines:
            line, enc = decode_text_line(raw)
            if enc is not None:
                encodings.append(enc)
            out.append(None if enc == "undecodable" else clean_line(line))
        return out, encodings
    return clean_lines(text, block)[:len(lines)], []


def _clean_lines_around(raws: list, skipped: list[int]) -> tuple[list[str | None], list[str]]:
    """``_clean_lines`` of the real lines between over-long ones, None in the over-long ones' places."""
    lines: list[str | None] = []
    encodings: list[str] = []
    start = 0
    for i in [*skipped, len(raws)]:
        if i > start:
            got, enc = _clean_lines(raws[start:i])
            lines += got
            encodings += enc
        if i < len(raws):
            lines.append(None)
        start = i + 1
    return lines, encodings


def iter_bert_format(stream: BinaryIO, start: int = 0, end: int | None = None, *, block_bytes: int = 1 << 20
                     ) -> Iterator[tuple[int, list[str]] | tuple[str, str]]:
    """One sentence per line, blank line between documents. Yields (byte offset, sentences) for
    every document whose first line starts in ``[start, end)``: byte ranges of one file split
    it between readers with each document read exactly once, and the offset is a document id
    that does not depend on the split. ``start > 0`` needs a seekable stream. Lines are read and
    cleaned in blocks of about ``block_bytes`` (whole lines)."""
    sents: list[str] = []
    in_doc = False
    doc_at = pos = 0
    prev_blank = True
    if start > 0:
        stream.seek(start - 1)
        pos = start - 1 + read_line(stream.readline, MAX_LINE_BYTES)[1]  # the first line at or after ``start``
        prev_blank = _line_before_is_blank(stream, pos)  # a whole line: byte pos - 1 ends it
        stream.seek(pos)
        if not prev_blank:  # the tail of a document that started before ``start``: skip it without cleaning
            readline = stream.readline
            while True:
                raw, n = read_line(readline, MAX_LINE_BYTES)
                if not n:
                    break
                if end is not None and pos >= end:
                    return  # still in that document: none starts in [start, end)
                if raw is not None and not _surely_not_blank(raw):  # an over-long line is not blank
                    stream.seek(pos)  # this line needs the full check: the block loop reads it
                    break
                pos += n
    damaged = False
    past_end = 1 << 14
    while not damaged:
        # up to ``end`` in one block; past it only the last document's tail is left, read in
        # growing blocks so that little of the next document is read for nothing
        if end is None or pos < end:
            size = block_bytes if end is None else min(block_bytes, max(end - pos, 1 << 14))
        else:
            size, past_end = past_end, min(2 * past_end, block_bytes)
        raws, damaged, skipped = _read_lines(stream, size)
        if raws:
            lines, encodings = _clean_lines_around(raws, skipped) if skipped else _clean_lines(raws)
            for _ in skipped:
                yield ("!event", "skipped_overlong_line")
            for enc in encodings:
                yield ("!event", "skipped_undecodable_line" if enc == "undecodable" else decoded_event(enc))
            for raw, line in zip(raws, lines):
                if line or line is None:  # None: an undecodable line, of its document but no sentence
                    if not in_doc:
                        if not prev_blank:  # the tail of a document that started before ``start``
                            pos += len(raw)
                            continue
                        if end is not None and pos >= end:
                            return
                        doc_at, in_doc = pos, True
                    if line:
                        sents.append(line)
                elif in_doc:
                    if sents:
                        yield (doc_at, sents)
                    sents, in_doc = [], False
                prev_blank = line == ""
                pos += len(raw)
        elif not damaged:
            break
    if damaged:
        yield ("!event", "truncated_input_file")
    if sents:
        yield (doc_at, sents)


def iter_json_lines(stream: BinaryIO, text_field: str, id_field: str) -> Iterator[tuple[str, str] | tuple[str, str]]:
    """Yields (doc_id, text) per JSON line; bad lines yield events."""
    lineno = 0
    readline = stream.readline
    try:
        while True:
            raw, n = read_line(readline, MAX_JSON_LINE_BYTES)
            if not n:
                break
            lineno += 1
            if raw is None:
                yield ("!event", "skipped_overlong_json_line")
                continue
            if not raw.strip():
                continue
            decoded = decode_document(raw)
            if decoded is None:
                yield ("!event", "skipped_undecodable_json_line")
                continue
            line = decoded.text
            yield ("!event", decoded_event(decoded.encoding))
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


