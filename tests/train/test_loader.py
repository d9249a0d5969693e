"""The loader on real pipeline records: sharding, resume, masking, manifest and shard checks."""
from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from bertdist.config import ConfigError
from bertdist.data import RecordsError, continuation_mask, load_vocab
from bertdist.model import IGNORE_INDEX
from bertdist.train.config import LoaderConfig
from bertdist.train.loader import LoaderState, PretrainingLoader, eval_batches, open_training_records
from bertdist.train.masking import SpecialIds, dynamic_mask


def make(records, vocab, world=1, rank=0, accum=2, **kw):
    cfg = LoaderConfig(train_manifest=str(records), vocab_file=str(vocab), max_seq_length=64, micro_batch_size=16,
                     global_batch_size=16 * accum * world, shuffle_window_shards=2, **kw)
    src = open_training_records(cfg.train_manifest, cfg.vocab_file, 64)
    return PretrainingLoader(src, cfg, rank=rank, world_size=world, grad_accum=accum,
                             continuation=continuation_mask(vocab))


def test_ranks_get_disjoint_equal_shares_independent_of_world_size(train_records, small_vocab):
    one = make(train_records, small_vocab, world=1, accum=2)
    ranks = [make(train_records, small_vocab, world=2, rank=r, accum=1) for r in range(2)]
    assert one.steps_per_epoch == ranks[0].steps_per_epoch == ranks[1].steps_per_epoch > 10
    state = LoaderState()
    for _ in range(3):
        whole = one.micro_batches(state)
        parts = [r.micro_batches(state)[0] for r in ranks]
        for mine, theirs in zip(whole, parts):  # rank r's micro-batch == world-1 micro-batch r
            for k in mine:
                assert torch.equal(mine[k], theirs[k]), k
        state = one.advance(state)
    # One epoch covers each row at most once, and all but < one global batch of them.
    seen = []
    for b in range(one.steps_per_epoch):
        for (win, rows) in one._rows(0, b * one.global_batch, one.global_batch):
            seen.extend(zip([id(win)] * len(rows), rows.tolist()))
    assert len(seen) == len(set(seen)) == one.steps_per_epoch * one.global_batch
    assert one.num_rows - len(seen) == one.dropped_per_epoch < one.global_batch


def test_resume_from_state_neither_replays_nor_skips(train_records, small_vocab):
    loader = make(train_records, small_vocab)
    it = loader.steps(LoaderState())
    seq = [next(it) for _ in range(6)]
    resumed = loader.steps(seq[2][1])  # the state saved after step 3
    for expected in seq[3:]:
        got = next(resumed)
        assert got[1] == expected[1]
        for a, b in zip(got[0], expected[0]):
            assert all(torch.equal(a[k], b[k]) for k in a)
    # epoch rollover: the state after the last step of an epoch is the next epoch's start
    last = LoaderState(0, (loader.steps_per_epoch - 1) * loader.global_batch)
    assert loader.advance(last) == LoaderState(1, 0)
    assert not torch.equal(loader.micro_batches(LoaderState(1, 0))[0]["input_ids"],
                           loader.micro_batches(LoaderState(0, 0))[0]["input_ids"])


def test_dynamic_masking_follows_bert(train_records, small_vocab):
    loader = make(train_records, small_vocab, whole_word_mask=False)
    sp = loader.special
    n_masked = n_rand = n_keep = 0
    for b in loader.micro_batches(LoaderState()) + loader.micro_batches(LoaderState(0, 32)):
        ids, labels, att = b["input_ids"], b["labels"], b["attention_mask"]
        lens = att.sum(1)
        chosen = labels != IGNORE_INDEX
        budget = torch.clamp(torch.round(lens * 0.15), min=1).clamp(max=loader.max_predictions)
        assert torch.equal(chosen.sum(1), budget.long())
        assert not (chosen & (att == 0)).any()
        orig = torch.where(chosen, labels, ids)
        assert not (chosen & ((orig == sp.cls) | (orig == sp.sep))).any()
        n_masked += int((chosen & (ids == sp.mask)).sum())
        n_keep += int((chosen & (ids == labels)).sum())
        n_rand += int((chosen & (ids != sp.mask) & (ids != labels)).sum())
        tt = b["token_type_ids"]
        assert (tt[:, 0] == 0).all() and ((tt == 1) <= (att == 1)).all()
    total = n_masked + n_rand + n_keep
    assert 0.7 < n_masked / total < 0.9 and n_keep / total > 0.05 and n_rand / total > 0.03


def test_whole_word_masking_never_splits_a_word():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "##x", "##y", "c"]
    cont = np.array([t.startswith("##") for t in vocab])
    rng = np.random.default_rng(0)
    words = [[5, 7, 8], [6], [9, 7], [5], [6, 8]]
    for _ in range(50):
        row = [2] + [t for w in rng.permutation(len(words)) for t in words[w]] * 3 + [3]
        ids = np.array([row] * 8)
        lens = np.full(8, len(row))
        masked, labels = dynamic_mask(ids.copy(), lens, SpecialIds(0, 2, 3, 4), len(vocab), rng, 0.3, 20, cont)
        chosen = labels != IGNORE_INDEX
        for r in range(8):
            for j in range(1, len(row) - 1):
                if cont[row[j]]:  # a continuation piece is chosen iff the piece before it is
                    assert chosen[r, j] == chosen[r, j - 1]
            assert 1 <= chosen[r].sum() <= round(len(row) * 0.3)


def test_static_masks_are_taken_from_the_records(tmp_path, small_vocab, train_records):
    from tests.train.conftest import build

    manifest = build(tmp_path / "static", small_vocab, masking="static", num_shards=2, dupe_factor=1)
    loader = make(manifest, small_vocab)
    assert not loader.dynamic
    b = loader.micro_batches(LoaderState())[0]
    parts = loader._rows(0, 0, 16)
    expected = []
    for win, rows in parts:
        for r in rows:
            s, n = win.mpos_start[r], win.mpos_len[r]
            expected.append(dict(zip(win.mpos[s:s + n].tolist(), win.mids[s:s + n].tolist())))
    assert sum(len(e) for e in expected) > 0
    for row, exp in enumerate(expected):
        got = {p: int(b["labels"][row, p]) for p in torch.nonzero(b["labels"][row] != IGNORE_INDEX).flatten().tolist()}
        assert got == exp
    with pytest.raises(ConfigError, match="unmasked"):
        make(train_records, small_vocab, masking="static")


def test_manifest_and_shard_errors(tmp_path, train_records, small_vocab):
    cfg = LoaderConfig(max_seq_length=128, micro_batch_size=16, global_batch_size=32)
    src = open_training_records(train_records, small_vocab, 64)
    with pytest.raises(ConfigError, match="max_seq_length 64"):
        PretrainingLoader(src, cfg, rank=0, world_size=1, grad_accum=2)
    with pytest.raises(RecordsError, match="max_seq_length"):
        open_training_records(train_records, small_vocab, 128)
    other = tmp_path / "other_vocab.txt"
    other.write_text("\n".join(load_vocab(small_vocab)[:-1]) + "\n")
    with pytest.raises(RecordsError, match="vocab sha256"):
        open_training_records(train_records, other, 64)
    big = LoaderConfig(max_seq_length=64, micro_batch_size=20000, global_batch_size=40000)
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        PretrainingLoader(src, big, rank=0, world_size=1, grad_accum=2)
    copy = tmp_path / "records"
    shutil.copytree(train_records.parent, copy)
    shard = sorted(copy.glob("shards-*/*train*"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordsError, match=shard.name):
        open_training_records(copy / "manifest.json", small_vocab, 64)
    shard.unlink()
    with pytest.raises(RecordsError, match="missing"):
        open_training_records(copy / "manifest.json", small_vocab, 64)


def test_eval_masks_are_fixed_and_world_independent(train_records, small_vocab):
    held = open_training_records(train_records, small_vocab, 64, split="heldout")
    cfg = LoaderConfig(max_seq_length=64)
    cont = continuation_mask(small_vocab)
    one = eval_batches(held, cfg, cont, rank=0, world_size=1, micro_batch_size=8, max_sequences=64, seed=3)
    again = eval_batches(held, cfg, cont, rank=0, world_size=1, micro_batch_size=8, max_sequences=64, seed=3)
    r1 = eval_batches(held, cfg, cont, rank=1, world_size=2, micro_batch_size=8, max_sequences=64, seed=3)
    assert len(one) == 8 and len(r1) == 4
    for a, b in zip(one, again):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(one[1::2], r1):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert dataclasses.is_dataclass(cfg)


def test_batches_for_a_gpu_are_pinned_in_the_prefetch_thread(train_records, small_vocab, monkeypatch):
    """Pinned host memory makes .to(cuda, non_blocking=True) asynchronous; the pinning happens in
    the loader's thread, after binding that thread to the rank's GPU (else it opens a context on
    cuda:0). No GPU here: pin_memory and set_device are recorded instead."""
    import threading

    events = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self: events.append(("pin", threading.current_thread().name)) or self.clone())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", str(d),
                                                                        threading.current_thread().name)))
    plain = make(train_records, small_vocab)
    pinned = make(train_records, small_vocab)
    pinned.pin_device = torch.device("cuda", 3)
    gens = [plain.steps(LoaderState()), pinned.steps(LoaderState())]
    a, b = (next(g) for g in gens)
    for g in gens:
        g.close()  # joins the prefetch threads
    assert events[0] == ("set_device", "cuda:3", "bertdist-loader")
    pins = [e for e in events if e[0] == "pin"]
    assert pins and all(name == "bertdist-loader" for _, name in pins)
    per_step = sum(len(mb) for mb in b[0])
    assert len(pins) >= per_step and len(pins) % per_step == 0  # every tensor of every micro-batch (+ prefetched)
    for x, y in zip(a[0], b[0]):
        assert all(torch.equal(x[k], y[k]) for k in x)
    cpu = PretrainingLoader(plain.source, plain.cfg, rank=0, world_size=1, grad_accum=2,
                            continuation=continuation_mask(small_vocab), pin_device=torch.device("cpu"))
    assert cpu.pin_device is None  # nothing to pin for a CPU run
