"""Packed MLM-only rows (pure functions): whole documents packed greedily into rows of
``max_seq_length`` tokens, for encoders that attend within each document of a row (ModernBERT's
unpadded varlen attention reads the boundaries from the records' ``document_lengths``).

Framing, as ModernBERT's: every document is ``[CLS] tokens [SEP]``. A document longer than a
row's room (``max_seq_length - 2`` tokens) is cut into row-sized pieces, each framed the same
way, the last one holding the rest; every piece counts as a document of the row it lands in.

Packing is best-fit decreasing over one *group* of documents (a bounded hash range of the corpus,
see :mod:`data_pipeline.beam.instance_transform`): the pieces, longest first (ties in the
group's canonical document order), each go into the open row with the least room that still
holds them, or open a new row. Within a row, its documents keep the group's order. It depends
only on the group's documents, never on bundling, worker count or runner.

Every token is accounted for (:class:`PackStats`): the rows hold exactly the documents' tokens
plus two framing tokens per piece; nothing is truncated or dropped.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import asdict, dataclass, fields

import numpy as np

from data_pipeline.instance_algorithm import row_keys
from data_pipeline.instance_batch import InstanceBatch

FRAME_TOKENS = 2  # [CLS] and [SEP] around every document piece


@dataclass
class PackStats:
    """Counts of one or more packed groups; :meth:`check` says whether the tokens add up."""

    documents: int = 0  # documents in
    document_tokens: int = 0  # their tokens, without framing
    split_documents: int = 0  # documents longer than a row's room, cut into pieces
    pieces: int = 0  # framed pieces written (documents + the extra pieces of the cut ones)
    rows: int = 0
    row_tokens: int = 0  # tokens written: document_tokens + FRAME_TOKENS * pieces
    padding: int = 0  # room left empty in the rows: rows * max_seq_length - row_tokens

    def add(self, other: "PackStats") -> "PackStats":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    def check(self, max_seq_length: int) -> None:
        """ValueError, with every number, unless tokens in and out and the rows' room reconcile."""
        framed = self.document_tokens + FRAME_TOKENS * self.pieces
        room = self.rows * max_seq_length
        if self.row_tokens != framed or self.row_tokens + self.padding != room:
            raise ValueError(f"packing lost tokens: {self.document_tokens} document tokens in {self.pieces} pieces "
                             f"should make {framed} row tokens, {self.row_tokens} were written; {self.rows} rows of "
                             f"{max_seq_length} hold {room} = {self.row_tokens} + {self.padding} padding?")


def piece_bounds(n_tokens: int, max_seq_length: int) -> list[tuple[int, int]]:
    """A document of ``n_tokens`` tokens as [start, end) pieces of at most ``max_seq_length - 2``
    tokens each (one piece when it fits)."""
    room = max_seq_length - FRAME_TOKENS
    if room < 1:
        raise ValueError(f"max_seq_length {max_seq_length} leaves no room for a token between [CLS] and [SEP]")
    return [(s, min(s + room, n_tokens)) for s in range(0, max(n_tokens, 1), room)] if n_tokens else []


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of item indices: items longest first (ties by index), each into the open row with the
    least room that holds it, else a new row; each row's items in index order."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and int(lengths.max()) > capacity:
        raise ValueError(f"an item of {int(lengths.max())} does not fit in a row of {capacity}")
    smallest = int(lengths.min()) if lengths.size else 0
    order = np.lexsort((np.arange(lengths.size), -lengths))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row) of the rows that can still take an item, sorted
    for i in order.tolist():
        need = int(lengths[i])
        j = bisect_left(room, (need, -1))
        if j < len(room):
            left, r = room.pop(j)
        else:
            left, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        left -= need
        if left >= smallest:  # a full row never takes another item: keep it out of the search
            insort(room, (left, r))
    return [sorted(r) for r in rows]


def pack_documents(docs: list[np.ndarray], *, max_seq_length: int, cls_id: int, sep_id: int, key_seed: int,
                   dtype=None) -> tuple[InstanceBatch, PackStats]:
    """A group's documents (token ids, in the group's canonical order) -> packed rows and counts.

    Rows: ``input_ids`` the framed pieces one after the other, ``document_lengths`` their lengths,
    ``num_a_tokens`` the row's length (one segment: token types 0), no NSP label (-1), no static
    masks. Row keys come from ``key_seed`` (the group's seed), so the shards' order does too."""
    dtype = np.dtype(dtype if dtype is not None else (docs[0].dtype if docs else np.uint16))
    stats = PackStats(documents=len(docs))
    starts, ends, flat_parts, base = [], [], [], 0
    for ids in docs:
        n = int(ids.shape[0])
        bounds = piece_bounds(n, max_seq_length)
        stats.document_tokens += n
        stats.split_documents += len(bounds) > 1
        starts += [base + s for s, _ in bounds]
        ends += [base + e for _, e in bounds]
        flat_parts.append(ids)
        base += n
    if not starts:
        return InstanceBatch.empty(dtype, packed=True), stats
    all_ids = np.concatenate(flat_parts).astype(dtype, copy=False)
    p_start, p_end = np.array(starts, np.int64), np.array(ends, np.int64)
    p_len = p_end - p_start + FRAME_TOKENS
    rows = best_fit_decreasing(p_len, max_seq_length)
    order = np.fromiter((i for r in rows for i in r), np.int64, count=p_len.size)  # pieces in row order
    counts = np.fromiter((len(r) for r in rows), np.int64, count=len(rows))
    lens = p_len[order]
    out_offs = np.zeros(order.size + 1, np.int64)
    np.cumsum(lens, out=out_offs[1:])
    total = int(out_offs[-1])
    # every output position's source: the piece's start + (position - the piece's first content position)
    src = np.repeat(p_start[order] - out_offs[:-1] - 1, lens) + np.arange(total)
    flat = all_ids[np.clip(src, 0, max(all_ids.shape[0] - 1, 0))]
    flat[out_offs[:-1]] = cls_id
    flat[out_offs[1:] - 1] = sep_id
    doc_offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(counts, out=doc_offsets[1:])
    row_offs = out_offs[doc_offsets]
    row_len = np.diff(row_offs)
    m = len(rows)
    z = np.zeros(m + 1, np.int64)
    batch = InstanceBatch(row_keys(key_seed, m), flat, row_offs, row_len.astype(np.uint16), np.full(m, -1, np.int8),
                          np.empty(0, np.uint16), np.empty(0, dtype), z, lens.astype(np.uint16), doc_offsets)
    stats.pieces, stats.rows, stats.row_tokens = int(order.size), m, total
    stats.padding = m * max_seq_length - total
    stats.check(max_seq_length)
    return batch, stats
