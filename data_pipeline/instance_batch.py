"""The columnar batch of training instances (numpy), the unit that flows through the shuffle.

Moving thousands of instances as one element of flat arrays instead of one Python object each
keeps Beam's per-element cost (pickling, shuffling) off the hot path. The columns map 1:1 onto
the record schema in :mod:`bertdist.data.records`; ``keys`` (uint64, a hash of seed, document,
dupe and position) decides the shard and the row order, so both are independent of bundling.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from bertdist.data.records import DOCUMENT_LENGTHS, record_schema

KEY_COLUMN = "_key"


def reference_gather_ragged(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of the ragged column (values, offsets) in that order: (values, offsets from 0).
    The readable numpy version, and the test oracle of the native ``gather_ragged``."""
    starts, ends = offsets[rows], offsets[rows + 1]
    lens = ends - starts
    new_offs = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lens, out=new_offs[1:])
    if new_offs[-1] == 0:
        return values[:0], new_offs
    # index of every element: start of its row + position within the row
    idx = np.repeat(starts - new_offs[:-1], lens) + np.arange(new_offs[-1])
    return values[idx], new_offs


try:  # one memcpy per row (csrc/data_pipeline/instances.cpp), about 10x the numpy gather
    from data_pipeline._native_instances import gather_ragged as _native_gather
except ImportError:  # not built: the numpy reference
    _native_gather = None


def gather_ragged(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if _native_gather is not None and values.dtype in (np.uint16, np.uint32, np.int64):
        return _native_gather(np.ascontiguousarray(values), np.ascontiguousarray(offsets, np.int64), rows)
    return reference_gather_ragged(values, offsets, rows)


def list_column(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, int64 offsets from 0), whatever its chunking or slicing."""
    col = column.combine_chunks()
    offs = col.offsets.to_numpy().astype(np.int64)
    values = col.values.to_numpy(zero_copy_only=False)[offs[0]:offs[-1]]
    return values, offs - offs[0]


@dataclass
class InstanceBatch:
    keys: np.ndarray  # uint64 [n]
    ids: np.ndarray  # id dtype, concatenated input_ids
    ids_offsets: np.ndarray  # int64 [n + 1]
    num_a: np.ndarray  # uint16 [n]
    nsp: np.ndarray  # int8 [n]
    mpos: np.ndarray  # uint16, concatenated masked_lm_positions
    mids: np.ndarray  # id dtype, concatenated masked_lm_ids
    m_offsets: np.ndarray  # int64 [n + 1]
    # packed rows only (None otherwise): the lengths of each row's documents, concatenated
    doc_lens: np.ndarray | None = None  # uint16
    doc_offsets: np.ndarray | None = None  # int64 [n + 1]

    @property
    def packed(self) -> bool:
        return self.doc_lens is not None

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    @staticmethod
    def empty(id_dtype, packed: bool = False) -> "InstanceBatch":
        z = np.zeros(1, np.int64)
        return InstanceBatch(np.empty(0, np.uint64), np.empty(0, id_dtype), z, np.empty(0, np.uint16),
                             np.empty(0, np.int8), np.empty(0, np.uint16), np.empty(0, id_dtype), z.copy(),
                             *((np.empty(0, np.uint16), z.copy()) if packed else ()))

    @staticmethod
    def concat(batches: list["InstanceBatch"]) -> "InstanceBatch":
        batches = [b for b in batches if len(b)] or batches[:1]
        if len(batches) == 1:
            return batches[0]

        def offsets(parts):
            out = [np.zeros(1, np.int64)]
            base = 0
            for o in parts:
                out.append(o[1:] + base)
                base += int(o[-1])
            return np.concatenate(out)

        return InstanceBatch(
            keys=np.concatenate([b.keys for b in batches]),
            ids=np.concatenate([b.ids for b in batches]),
            ids_offsets=offsets([b.ids_offsets for b in batches]),
            num_a=np.concatenate([b.num_a for b in batches]),
            nsp=np.concatenate([b.nsp for b in batches]),
            mpos=np.concatenate([b.mpos for b in batches]),
            mids=np.concatenate([b.mids for b in batches]),
            m_offsets=offsets([b.m_offsets for b in batches]),
            **({"doc_lens": np.concatenate([b.doc_lens for b in batches]),
                "doc_offsets": offsets([b.doc_offsets for b in batches])} if batches[0].packed else {}),
        )

    def take(self, rows: np.ndarray) -> "InstanceBatch":
        """Rows in the given order (a gather over the ragged columns)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        ids, io = gather_ragged(self.ids, self.ids_offsets, rows)
        mp, mo = gather_ragged(self.mpos, self.m_offsets, rows)
        mi, _ = gather_ragged(self.mids, self.m_offsets, rows)
        docs = gather_ragged(self.doc_lens, self.doc_offsets, rows) if self.packed else ()
        return InstanceBatch(self.keys[rows], ids, io, self.num_a[rows], self.nsp[rows], mp, mi, mo, *docs)

    def slice(self, lo: int, hi: int) -> "InstanceBatch":
        """Rows ``lo:hi`` (views, offsets rebased): what ``take(arange(lo, hi))`` gives, no gather."""
        io, mo = self.ids_offsets[lo:hi + 1], self.m_offsets[lo:hi + 1]
        docs = ()
        if self.packed:
            do = self.doc_offsets[lo:hi + 1]
            docs = (self.doc_lens[do[0]:do[-1]], do - do[0])
        return InstanceBatch(self.keys[lo:hi], self.ids[io[0]:io[-1]], io - io[0], self.num_a[lo:hi], self.nsp[lo:hi],
                             self.mpos[mo[0]:mo[-1]], self.mids[mo[0]:mo[-1]], mo - mo[0], *docs)

    def sorted_by_key(self) -> "InstanceBatch":
        return self.take(np.argsort(self.keys, kind="stable"))

    def num_tokens(self) -> int:
        return int(self.ids_offsets[-1])

    def num_masked(self) -> int:
        return int(self.m_offsets[-1])

    def num_documents(self) -> int:
        """Document pieces in the rows (packed rows; else one per row)."""
        return int(self.doc_offsets[-1]) if self.packed else len(self)

    def to_arrow(self, vocab_size: int, *, with_keys: bool = False) -> pa.Table:
        """The record columns; ``with_keys`` adds the row keys (for spill files, not for shards)."""
        schema = record_schema(vocab_size, self.packed)
        id_type = schema.field("input_ids").type.value_type

        def lst(values, offs, typ):
            return pa.ListArray.from_arrays(pa.array(offs.astype(np.int32)), pa.array(values, type=typ))

        table = pa.Table.from_arrays([
            lst(self.ids, self.ids_offsets, id_type),
            pa.array(self.num_a, type=pa.uint16()),
            pa.array(self.nsp, type=pa.int8()),
            lst(self.mpos, self.m_offsets, pa.uint16()),
            lst(self.mids, self.m_offsets, id_type),
            *([lst(self.doc_lens, self.doc_offsets, pa.uint16())] if self.packed else []),
        ], schema=schema)
        return table.append_column(KEY_COLUMN, pa.array(self.keys, type=pa.uint64())) if with_keys else table

    @staticmethod
    def from_arrow(table: pa.Table) -> "InstanceBatch":
        """Inverse of ``to_arrow(..., with_keys=True)``."""
        def lst(name):
            return list_column(table.column(name))

        ids, io = lst("input_ids")
        mp, mo = lst("masked_lm_positions")
        mi, _ = lst("masked_lm_ids")
        docs = lst(DOCUMENT_LENGTHS) if DOCUMENT_LENGTHS in table.column_names else ()
        return InstanceBatch(table.column(KEY_COLUMN).to_numpy(), ids, io, table.column("num_a_tokens").to_numpy(),
                             table.column("next_sentence_label").to_numpy(), mp, mi, mo, *docs)
