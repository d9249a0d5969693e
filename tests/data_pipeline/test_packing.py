"""data_pipeline.packing: documents packed greedily into rows, every token accounted for."""
from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.packing import PackStats, best_fit_decreasing, pack_documents, piece_bounds

CLS, SEP = 1, 2


def _docs(lengths, base=1000, dtype=np.uint16):
    """Document i holds ids base + i (so every token names its document)."""
    return [np.full(n, base + i, dtype) for i, n in enumerate(lengths)]


def _rows(batch):
    for r in range(len(batch)):
        ids = batch.ids[batch.ids_offsets[r]:batch.ids_offsets[r + 1]]
        lens = batch.doc_lens[batch.doc_offsets[r]:batch.doc_offsets[r + 1]].astype(np.int64)
        yield ids, lens


def test_piece_bounds_cut_only_what_does_not_fit():
    assert piece_bounds(0, 16) == []
    assert piece_bounds(14, 16) == [(0, 14)]
    assert piece_bounds(15, 16) == [(0, 14), (14, 15)]
    assert piece_bounds(30, 16) == [(0, 14), (14, 28), (28, 30)]
    with pytest.raises(ValueError, match="no room"):
        piece_bounds(3, 2)


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 101, size=500)
    rows = best_fit_decreasing(lengths, 100)
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(500))
    loads = [int(lengths[r].sum()) for r in rows]
    assert max(loads) <= 100
    # within best-fit decreasing's bound of 11/9 of the optimum (at least the larger of the
    # volume bound and the items over half a row, which no two can share), and no two rows
    # that could have been one
    lower = max(int(np.ceil(lengths.sum() / 100)), int((lengths > 50).sum()))
    assert lower <= len(rows) <= 11 / 9 * lower + 1
    assert sum(1 for load in loads if load <= 50) <= 1
    assert rows == best_fit_decreasing(lengths, 100)  # deterministic
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing(np.array([5, 101]), 100)


def test_best_fit_takes_the_row_with_the_least_room_that_fits():
    # 60 and 50 open two rows (room 40, 50); 40 fits both and goes where it fills the row exactly
    rows = best_fit_decreasing(np.array([60, 50, 40]), 100)
    assert rows == [[0, 2], [1]]


def test_packed_rows_hold_every_document_token_framed_once():
    lengths = [3, 10, 25, 1, 7, 40, 14, 0, 100]
    docs = _docs(lengths)
    batch, stats = pack_documents(docs, max_seq_length=16, cls_id=CLS, sep_id=SEP, key_seed=7)
    rebuilt: dict[int, int] = {}
    for ids, lens in _rows(batch):
        assert ids.shape[0] == int(lens.sum()) <= 16
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        for s, n in zip(starts.tolist(), lens.tolist()):
            piece = ids[s:s + n]
            assert piece[0] == CLS and piece[-1] == SEP and n >= 3
            body = piece[1:-1]
            assert (body == body[0]).all()  # a piece holds one document
            rebuilt[int(body[0])] = rebuilt.get(int(body[0]), 0) + body.shape[0]
    assert rebuilt == {1000 + i: n for i, n in enumerate(lengths) if n}
    assert stats == PackStats(documents=9, document_tokens=sum(lengths), split_documents=3,
                              pieces=1 + 1 + 2 + 1 + 1 + 3 + 1 + 8, rows=len(batch),
                              row_tokens=sum(lengths) + 2 * 18, padding=len(batch) * 16 - (sum(lengths) + 36))
    assert batch.num_tokens() == stats.row_tokens and batch.num_documents() == stats.pieces
    assert (batch.nsp == -1).all() and (batch.num_a == np.diff(batch.ids_offsets)).all()
    assert batch.num_masked() == 0
    # the keys come from the group's seed only
    again, _ = pack_documents(docs, max_seq_length=16, cls_id=CLS, sep_id=SEP, key_seed=7)
    assert (again.keys == batch.keys).all() and (again.ids == batch.ids).all()


def test_a_split_document_keeps_its_order_across_pieces():
    doc = np.arange(3000, 3000 + 40, dtype=np.uint16)
    batch, _ = pack_documents([doc], max_seq_length=16, cls_id=CLS, sep_id=SEP, key_seed=1)
    bodies = sorted((ids[1:-1].tolist() for ids, _ in _rows(batch)), key=lambda b: b[0])
    assert [t for b in bodies for t in b] == doc.tolist()


def test_long_rows_and_large_vocabs_keep_their_types():
    """8,192-token rows: lengths still fit uint16; ids of a vocab over 65,536 stay uint32."""
    docs = _docs([9000, 5000, 3000, 100], base=70_000, dtype=np.uint32)
    batch, stats = pack_documents(docs, max_seq_length=8192, cls_id=CLS, sep_id=SEP, key_seed=2, dtype=np.uint32)
    assert batch.ids.dtype == np.uint32 and batch.doc_lens.dtype == np.uint16
    assert batch.ids.max() == 70_003 and stats.split_documents == 1
    assert int(batch.doc_lens.max()) == 8192 and int(np.diff(batch.ids_offsets).max()) == 8192
    table = batch.to_arrow(100_000)
    assert str(table.schema.field("input_ids").type.value_type) == "uint32"
    assert table.column("document_lengths").to_pylist()[0][0] <= 8192


def test_an_empty_group_makes_no_rows():
    batch, stats = pack_documents([], max_seq_length=64, cls_id=CLS, sep_id=SEP, key_seed=0)
    assert len(batch) == 0 and batch.packed and stats == PackStats()


def test_stats_that_do_not_reconcile_are_refused():
    with pytest.raises(ValueError, match="packing lost tokens"):
        PackStats(documents=1, document_tokens=10, pieces=1, rows=1, row_tokens=11, padding=5).check(16)
