"""The native instance builder (data_pipeline._native_instances) against the Python reference:
bitwise the same InstanceBatch (every column, dtype included) and InstanceStats over objectives,
lengths, short_seq_prob, masking, negative sources, id dtypes, seeds and dupe factors, on synthetic and
real text; its RNG replicas against CPython's random and numpy's PCG64; argument errors; the
builder choice; and byte-identical shards through the Beam transforms with either builder."""
from __future__ import annotations

import bisect
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import instance_native
from data_pipeline.instance_algorithm import InstanceParams, InstanceStats, create_instances, row_keys
from data_pipeline.instance_batch import InstanceBatch
from data_pipeline.negatives import NegativeSource, canonical_order, placement_hash

needs_native = pytest.mark.skipif(not instance_native.available(),
                                  reason=instance_native.unavailable_reason() or "native builder not built")

FIELDS = ("keys", "ids", "ids_offsets", "num_a", "nsp", "mpos", "mids", "m_offsets")


def params(**kw) -> InstanceParams:
    base = dict(max_seq_length=128, short_seq_prob=0.1, objective="nsp", nsp_random_prob=0.5, masking="static",
                masked_lm_prob=0.15, max_predictions_per_seq=20, whole_word_mask=False, cls_id=101, sep_id=102,
                mask_id=103, vocab_size=30522)
    base.update(kw)
    return InstanceParams(**base)


def doc(name: str, lens, rng: np.random.Generator, dtype=np.uint16, high: int = 30000):
    lens = np.asarray(lens, np.int64)
    ids = rng.integers(1000, high, size=int(lens.sum())).astype(dtype)
    return name, ids, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def synthetic_docs(seed: int = 0, dtype=np.uint16, high: int = 30000):
    """Ordinary documents plus the edge cases: one sentence, two, one-token sentences, and
    sentences longer than any max_seq_length of the grid (truncation on every path)."""
    rng = np.random.default_rng(seed)
    docs = [doc(f"doc{d}", rng.integers(1, 30, size=int(rng.integers(3, 40))), rng, dtype, high) for d in range(8)]
    docs += [doc("one_sentence", [17], rng, dtype, high), doc("one_token", [1], rng, dtype, high),
             doc("two_sentences", [3, 9], rng, dtype, high), doc("short_tail", [40, 5, 1], rng, dtype, high),
             doc("long_sentences", [300, 2, 250, 190], rng, dtype, high),
             doc("long_single", [400], rng, dtype, high)]
    return docs


def make_source(docs, seed: int) -> NegativeSource:
    """One bucket of all the documents, in the pipeline's canonical order."""
    order = canonical_order([placement_hash(d[0]) for d in docs], [d[0] for d in docs], [d[1] for d in docs])
    return NegativeSource.from_documents([docs[i] for i in order], seed=seed)


def continuation_table(vocab_size: int, seed: int = 0, rate: float = 0.35) -> np.ndarray:
    """A '##' table for whole-word masking: about ``rate`` of the ids are continuation pieces."""
    return np.random.default_rng(seed).random(vocab_size) < rate


def assert_same(docs, p: InstanceParams, *, seed: int, dupes: int, source: NegativeSource | None = None,
                source_of=None, continuation: np.ndarray | None = None) -> int:
    """Reference vs native for every document, with the negatives of ``source`` (or of
    ``source_of(doc)``, a per-document source); each document is found in its source by id.
    Whole-word masking takes ``continuation`` (default: a random table of the vocab's size)."""
    if p.whole_word_mask and continuation is None:
        continuation = continuation_table(p.vocab_size)
    rows = 0
    for d in docs:
        src = source_of(d) if source_of else source
        place = src.doc_ids.index(d[0]) if src is not None else -1
        deal = src.dealer(place) if src is not None and p.objective == "nsp" else None
        s_ref, s_nat = InstanceStats(), InstanceStats()
        want = InstanceBatch.concat([create_instances(*d, k, params=p, seed=seed, negatives=deal,
                                                      continuation=continuation, stats=s_ref) for k in range(dupes)])
        s_ref.count_windows(deal)
        got = instance_native.create_document_instances(*d, dupes, params=p, seed=seed, negatives=src,
                                                        doc_index=place, continuation=continuation, stats=s_nat)
        for f in FIELDS:
            a, b = getattr(want, f), getattr(got, f)
            assert a.dtype == b.dtype, (d[0], f, a.dtype, b.dtype, p)
            assert np.array_equal(a, b), (d[0], f, p)
        assert s_ref == s_nat, (d[0], s_ref, s_nat, p)
        rows += len(want)
    return rows


# ---------------------------------------------------------------- parity grid (synthetic)


@needs_native
@pytest.mark.parametrize("masking", ["static", "dynamic", "static_wwm"])
@pytest.mark.parametrize("max_seq_length", [8, 16, 128])
@pytest.mark.parametrize("objective", ["nsp", "sop", "none"])
def test_parity_objectives_lengths_short_seq(objective, max_seq_length, masking):
    docs = synthetic_docs()
    for ssp in (0.0, 0.1, 1.0):
        p = params(objective=objective, max_seq_length=max_seq_length, short_seq_prob=ssp,
                   masking=masking.removesuffix("_wwm"), whole_word_mask=masking.endswith("_wwm"))
        assert assert_same(docs, p, seed=1, dupes=3, source=make_source(docs, 1)) > 0


@needs_native
def test_parity_whole_word_masking_knobs():
    """Whole-word masking: words longer than the budget (skipped, the next one tried), tables with
    no '##' pieces or only '##' pieces (one word per run of candidates), budgets of 0 and above the
    candidates, uint32 ids, and the masking rates of a real run."""
    docs = synthetic_docs(seed=6)
    for kw, rate in ((dict(), 0.35), (dict(), 0.0), (dict(), 1.0), (dict(), 0.9),
                     (dict(max_predictions_per_seq=0), 0.35), (dict(max_predictions_per_seq=200, masked_lm_prob=1.0), 0.5),
                     (dict(masked_lm_prob=0.125), 0.5), (dict(objective="sop"), 0.6), (dict(vocab_size=1), 0.0)):
        p = params(max_seq_length=48, whole_word_mask=True, **kw)
        table = continuation_table(p.vocab_size, rate=rate) if p.vocab_size > 1 else np.zeros(30522, bool)
        if p.vocab_size == 1:  # every id is outside a 1-entry vocab: the table must still cover them
            p = replace(p, vocab_size=30522)
        assert assert_same(docs, p, seed=7, dupes=2, source=make_source(docs, 7), continuation=table) > 0
    docs32 = synthetic_docs(seed=2, dtype=np.uint32, high=70000)
    p = params(max_seq_length=24, whole_word_mask=True, vocab_size=70000, cls_id=66000, sep_id=66001, mask_id=66002)
    assert_same(docs32, p, seed=3, dupes=2, source=make_source(docs32, 3))
    # no partially masked word in the native output: a '##' piece and the piece before it (both
    # non-special) are masked together or not at all
    table = continuation_table(30522, rate=0.5)
    p = params(max_seq_length=64, whole_word_mask=True)
    words = 0
    for d in docs:
        b = instance_native.create_document_instances(*d, 2, params=p, seed=9, continuation=table)
        for r in range(len(b)):
            s, e, ms, me = b.ids_offsets[r], b.ids_offsets[r + 1], b.m_offsets[r], b.m_offsets[r + 1]
            pos = b.mpos[ms:me].astype(np.int64)
            original = b.ids[s:e].copy()
            original[pos] = b.mids[ms:me]
            masked = set(pos.tolist())
            special = {0, int(b.num_a[r]) - 1, int(e - s) - 1}
            for i in range(2, int(e - s)):
                if table[original[i]] and i not in special and i - 1 not in special:
                    assert (i in masked) == (i - 1 in masked), (d[0], r, i)
                    words += i in masked
    assert words > 50  # multi-piece words were masked


@needs_native
@pytest.mark.parametrize("objective", ["nsp", "sop", "none"])
@pytest.mark.parametrize("source_kind", ["none", "alone", "pair", "normal"])
def test_parity_negative_sources(objective, source_kind):
    """No source, a bucket of the document alone (no negative exists: every random-next row falls
    back), of two documents (half the positions hold the document's own windows: skipped, up to
    10 in a row), and of all of them; the deal's counts agree too."""
    docs = synthetic_docs(seed=1)
    p = params(objective=objective, max_seq_length=32)
    partner = {d[0]: docs[(i + 1) % len(docs)] for i, d in enumerate(docs)}
    source_of = {"none": lambda d: None, "alone": lambda d: make_source([d], 2),
                 "pair": lambda d: make_source([d, partner[d[0]]], 2),
                 "normal": lambda d, s=make_source(docs, 2): s}[source_kind]
    assert_same(docs, p, seed=2, dupes=3, source_of=source_of)
    if objective == "nsp":  # the fallback path was exercised (or not) as intended, and counted alike
        stats = InstanceStats()
        for d in docs:
            src = source_of(d)
            instance_native.create_document_instances(*d, 3, params=p, seed=2, negatives=src,
                                                      doc_index=src.doc_ids.index(d[0]) if src else -1, stats=stats)
        if source_kind != "pair":  # a pair with a one-sentence partner falls back now and then
            assert (stats.same_document_fallbacks > 0) == (source_kind in ("none", "alone"))
        assert (stats.distinct_windows > 0) == (source_kind in ("pair", "normal"))
        assert stats.distinct_windows <= stats.random_next


@needs_native
@pytest.mark.parametrize("objective", ["nsp", "sop", "none"])
def test_parity_uint32_ids_and_large_vocab(objective):
    docs = synthetic_docs(seed=2, dtype=np.uint32, high=70000)
    p = params(objective=objective, max_seq_length=16, vocab_size=70000, cls_id=66000, sep_id=66001, mask_id=66002)
    assert_same(docs, p, seed=3, dupes=3, source=make_source(docs, 3))
    assert instance_native.create_document_instances(*docs[0], 1, params=p, seed=3).ids.dtype == np.uint32
    # uint16 ids with a vocab past 65535: random ids wrap when cast, in both builders alike
    docs16 = synthetic_docs(seed=2)
    assert_same(docs16, replace(p, cls_id=101, sep_id=102, mask_id=103), seed=3, dupes=2)


@needs_native
@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, 2**64 - 1])
@pytest.mark.parametrize("dupes", [1, 2, 5])
def test_parity_seeds_and_dupe_factors(seed, dupes):
    docs = synthetic_docs(seed=3)[:6]
    p = params(max_seq_length=24, short_seq_prob=0.3)
    assert_same(docs, p, seed=seed, dupes=dupes, source=make_source(docs, seed))


@needs_native
def test_parity_masking_and_nsp_knobs():
    """Budgets with half-way rints (prob 0.125 on lengths 12, 20, ...), caps, every nsp rate."""
    docs = synthetic_docs(seed=4)
    for kw in (dict(masked_lm_prob=0.125), dict(masked_lm_prob=0.0), dict(masked_lm_prob=1.0),
               dict(masked_lm_prob=0.5, max_predictions_per_seq=2), dict(max_predictions_per_seq=0),
               dict(max_predictions_per_seq=200), dict(nsp_random_prob=0.0), dict(nsp_random_prob=1.0),
               dict(objective="sop", masked_lm_prob=0.3), dict(vocab_size=1)):
        p = params(max_seq_length=40, **kw)
        assert_same(docs, p, seed=5, dupes=2, source=make_source(docs, 5))


@needs_native
def test_empty_result_has_the_reference_dtypes():
    """SOP on a one-token document makes no instance: an empty batch like InstanceBatch.empty."""
    rng = np.random.default_rng(0)
    for dtype in (np.uint16, np.uint32):
        d = doc("x", [1], rng, dtype)
        stats = InstanceStats()
        got = instance_native.create_document_instances(*d, 3, params=params(objective="sop"), seed=1, stats=stats)
        assert len(got) == 0 and stats.skipped_short_sentence == 3
        want = InstanceBatch.empty(dtype)
        for f in FIELDS:
            assert getattr(got, f).dtype == getattr(want, f).dtype and np.array_equal(getattr(got, f), getattr(want, f))


# ---------------------------------------------------------------- parity on real text


@needs_native
@pytest.mark.shared
def test_parity_on_tokenized_books(shared_data):
    from data_pipeline.text import text_to_sentences
    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wordpiece import WordPieceEncoder

    vocab = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    tok, lowercase = load_tokenizer(vocab)
    encoder = WordPieceEncoder(tok, lowercase)
    docs = []
    for book in ("shakespeare-macbeth.txt", "chesterton-thursday.txt"):
        sents = text_to_sentences((shared_data / "books" / book).read_text(encoding="utf-8"))
        for j in range(0, len(sents), 600):  # several documents per book: more negative documents
            ids, bounds = encoder.encode_document(sents[j:j + 600])
            if len(bounds) > 2:
                docs.append((f"{book}#{j}", ids, bounds))
    assert len(docs) >= 8 and docs[0][1].dtype == np.uint16
    from bertdist.data.vocab import continuation_mask

    for kw in (dict(objective="nsp", max_seq_length=128), dict(objective="sop", max_seq_length=64, masking="dynamic"),
               dict(objective="none", max_seq_length=512), dict(objective="nsp", max_seq_length=16, short_seq_prob=0.5),
               dict(objective="nsp", max_seq_length=128, whole_word_mask=True)):
        p = params(**kw)
        assert assert_same(docs, p, seed=12345, dupes=2, source=make_source(docs, 12345),
                           continuation=continuation_mask(vocab)) > 100


# ---------------------------------------------------------------- RNG replicas


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**64 - 1, 123456789012345678])
def test_mt19937_replica_matches_cpython(seed):
    ops = [0, 1, 5, 31, 32, 33, 63, 64, 65, 100, 1000, -7, -125, -1, 0, -3] * 60  # crosses the 624-word refills
    r = random.Random(seed)
    want = []
    for op in ops:
        if op == 0:
            want.append(r.random())
        elif op > 0:
            want.append(float(r.getrandbits(op).bit_count()))
        else:
            want.append(float(int(r.random() * -op)))
    assert instance_native._ext.testing.mt_draws(seed, ops) == want


@needs_native
@pytest.mark.parametrize("seed", [0, 1, 5, 2**32 - 1, 2**32, 2**63 + 17, 2**64 - 1])
def test_pcg64_seeding_matches_numpy(seed):
    """np.random.PCG64(seed): SeedSequence's hashing, then pcg64_set_seed."""
    st = np.random.PCG64(seed).state["state"]
    assert instance_native._ext.testing.pcg64_state(seed) == (st["state"], st["inc"])


@needs_native
@pytest.mark.parametrize("seed", [0, 5, 2**63 + 17])
@pytest.mark.parametrize("high", [1, 2, 30522, 65536, 70000, 3_000_000_000, 2**32 - 1, 2**32])
def test_pcg64_replica_matches_numpy(seed, high):
    """random() then integers(0, high): 3e9 rejects ~30% of draws, odd counts leave a buffered half."""
    for n_doubles, n_ints in ((0, 1), (1, 3), (7, 10), (100, 1001)):
        g = np.random.Generator(np.random.PCG64(seed))
        want_d, want_i = g.random(n_doubles), g.integers(0, high, size=n_ints)
        got_d, got_i = instance_native._ext.testing.pcg_draws(seed, n_doubles, high, n_ints)
        assert np.array_equal(np.array(got_d), want_d) and np.array_equal(np.array(got_i, np.int64), want_i)


def test_dupe_seeds_equal_derive_seed():
    from data_pipeline.seeds import derive_seed

    for seed, doc_id in ((12345, "books:a.txt"), (0, "wiki:1#part2"), (2**64 - 1, "é\x1f")):
        mt, rows, masks = instance_native.dupe_seeds(doc_id, 4, seed)
        assert mt.dtype == rows.dtype == masks.dtype == np.uint64
        assert mt.tolist() == [derive_seed(seed, doc_id, k) for k in range(4)]
        assert rows.tolist() == [derive_seed(seed, "row", doc_id, k) for k in range(4)]
        assert masks.tolist() == [derive_seed(seed, "mask", doc_id, k) for k in range(4)]


@needs_native
def test_row_keys_bisect_and_budget_replicas():
    t = instance_native._ext.testing
    for base in (0, 1, 98765, 2**64 - 1):
        assert np.array_equal(t.row_keys(base, 300), row_keys(base, 300))
    a = [0, 3, 3, 7, 10, 10, 15]
    for x in range(-1, 17):
        for lo in range(len(a)):
            for hi in range(lo, len(a) + 1):
                assert t.bisect_left(a, x, lo, hi) == bisect.bisect_left(a, x, lo, hi)
    lengths = np.arange(1, 600)
    for prob in (0.125, 0.15, 0.5, 1 / 3):
        want = np.minimum(np.minimum(20, np.maximum(1, np.rint(lengths * prob).astype(np.int64))), lengths - 3)
        assert [t.mask_budget(int(n), prob, 20, int(n) - 3) for n in lengths] == want.tolist()


@needs_native
def test_smallest_keys_selection_with_ties():
    """The per-row selection equals "stable argsort, first `budget`, ascending" even with tied
    keys (which random doubles never produce): keys from a few values force every path, the
    prefilter's fallback, crowded histogram buckets and the tie handling."""
    t = instance_native._ext.testing
    rng = np.random.default_rng(0)
    for trial in range(3000):
        end = int(rng.integers(3, 200))
        levels = [4, 50, 10**9][trial % 3]
        key = rng.integers(0, levels, size=end) / levels
        sep_a = int(rng.integers(1, end))
        budget = int(rng.integers(1, end - 1))
        cand = np.array([c for c in range(1, end) if c != sep_a])
        order = np.argsort(key[cand], kind="stable")
        want = sorted(cand[order[:budget]].tolist())
        assert t.take_smallest(key.tolist(), sep_a, end, budget) == want, (end, sep_a, budget, levels)


# ---------------------------------------------------------------- errors and the builder choice


@needs_native
def test_argument_errors_name_expected_and_actual():
    ext = instance_native._ext
    rng = np.random.default_rng(0)
    _, ids, bounds = doc("d", [4, 5, 6], rng)
    seeds, _, masks = instance_native.dupe_seeds("d", 2, 1)
    kw = dict(max_seq_length=32, short_seq_prob=0.1, objective="nsp", nsp_random_prob=0.5, masking="static",
              masked_lm_prob=0.15, max_predictions_per_seq=5, whole_word_mask=False, cls_id=101, sep_id=102,
              mask_id=103, vocab_size=30522, negatives=None, doc_index=-1)

    def call(ids=ids, bounds=bounds, seeds=seeds, rows=seeds, masks=masks, **over):
        return ext.build_document(ids, bounds, seeds, rows, masks, **{**kw, **over})

    call()  # the baseline is valid
    cases = [
        (dict(ids=ids.astype(np.int64)), "ids: expected dtype uint16 or uint32, got int64"),
        (dict(ids=ids.astype(">u2")), "ids: expected dtype uint16 or uint32, got >u2"),
        (dict(ids=ids.reshape(3, 5)), "ids: expected a 1-D array, got 2-D"),
        (dict(ids=ids[::2]), "ids: expected a C-contiguous array"),
        (dict(bounds=bounds.astype(np.int32)), "bounds: expected dtype int64, got int32"),
        (dict(bounds=bounds + 1), r"bounds: expected to run from 0 to len\(ids\) = 15, got 1 \.\. 16"),
        (dict(bounds=np.array([0, 4, 4, 15])), r"strictly increasing .* bounds\[1\] = 4 >= bounds\[2\] = 4"),
        (dict(bounds=np.array([0, 9, 4, 15])), "strictly increasing"),
        (dict(bounds=np.array([], np.int64)), "at least one entry"),
        (dict(rows=seeds[:1]), "expected mt_seeds, row_bases, mask_seeds of one length .*, got 2, 1, 2"),
        (dict(masks=np.zeros((2, 4), np.uint64)), "mask_seeds: expected a 1-D array, got 2-D"),
        (dict(seeds=seeds.astype(np.int64)), "mt_seeds: expected dtype uint64, got int64"),
        (dict(objective="mlm"), "objective: expected one of nsp, sop, none, got 'mlm'"),
        (dict(masking="random"), "masking: expected static or dynamic, got 'random'"),
        (dict(whole_word_mask=True), "continuation: whole-word masking needs the vocab's continuation mask, got None"),
        (dict(whole_word_mask=True, continuation=np.zeros(30522, np.uint8)), "continuation: expected dtype bool, got uint8"),
        (dict(whole_word_mask=True, continuation=np.zeros(100, bool)), r"continuation: expected one entry per vocab id \(30522\), got 100"),
        (dict(max_seq_length=4), "max_seq_length: expected 8 <= max_seq_length <= 65535, got 4"),
        (dict(masked_lm_prob=1.5), r"masked_lm_prob: expected a value in \[0, 1\]"),
        (dict(cls_id=70000), "cls_id 70000 does not fit the ids' dtype uint16"),
        (dict(mask_id=-1), "mask_id: expected a uint32 id, got -1"),
        (dict(vocab_size=0), r"vocab_size: expected 1 <= vocab_size <= 2\*\*32, got 0"),
    ]
    for over, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**over)
    other = NegativeSource.from_documents([("d", ids, bounds), ("o", ids[:9], np.array([0, 4, 9]))], seed=1)
    native = instance_native.packed(other)
    call(negatives=native, doc_index=0)  # valid: the document is the source's first
    for over, message in [
        (dict(doc_index=2), r"doc_index: expected the document's place in the negative source, 0 <= doc_index < 2, got 2"),
        (dict(doc_index=-1), "got -1"),
        (dict(doc_index=1), "doc_index 1: the negative source's document there has 2 sentences, this one 3"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(negatives=native, **over)
    wide = NegativeSource.from_documents([("o", ids[:9].astype(np.uint32), np.array([0, 4, 9]))], seed=1)
    with pytest.raises(ValueError, match="negatives ids: expected the document's dtype uint16, got uint32"):
        call(negatives=instance_native.packed(wide), doc_index=0)
    io, bo = np.array([0, 9]), np.array([0, 3])
    with pytest.raises(ValueError,
                       match=r"negatives document 0: expected sentence bounds 0 < \.\.\. < len\(document ids\) = 9"):
        ext.NegativeSource(ids[:9], io, np.array([0, 4, 8]), bo, np.array([0, 1]))
    with pytest.raises(ValueError, match=r"negatives perm: expected a permutation of the 2 windows .* got 3 entries"):
        ext.NegativeSource(ids[:9], io, np.array([0, 4, 9]), bo, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"negatives perm: not a permutation of \[0, 2\): entry 1 is 0"):
        ext.NegativeSource(ids[:9], io, np.array([0, 4, 9]), bo, np.array([0, 0]))
    with pytest.raises(ValueError, match="negatives bound_offsets: expected 2 entries"):
        ext.NegativeSource(ids[:9], io, np.array([0, 4, 9]), np.array([0, 3, 3]), np.array([1, 0]))
    with pytest.raises(ValueError, match="negatives perm: expected dtype int64, got int32"):
        ext.NegativeSource(ids[:9], io, np.array([0, 4, 9]), bo, np.array([1, 0], np.int32))
    with pytest.raises(ValueError, match=r"doc_index 5: not a document of the negative source \(2 documents\)"):
        instance_native.create_document_instances("d", ids, bounds, 2, params=params(), seed=1, negatives=other,
                                                  doc_index=5)
    with pytest.raises(ValueError, match="document 5 is not in this bucket of 2 documents"):
        other.dealer(5)
    with pytest.raises(ValueError, match="needs the vocab's continuation mask"):  # as the reference says too
        instance_native.create_document_instances("d", ids, bounds, 1, params=params(whole_word_mask=True), seed=1)
    with pytest.raises(ValueError, match="needs the vocab's continuation mask"):
        create_instances("d", ids, bounds, 0, params=params(whole_word_mask=True), seed=1)


def test_builder_choice(monkeypatch):
    p = params()
    assert instance_native.choose_builder("reference")[0] == "reference"
    with pytest.raises(ValueError, match="not one of"):
        instance_native.choose_builder("fast")
    if instance_native.available():
        assert instance_native.choose_builder("auto")[0] == "native"
        assert instance_native.choose_builder("native")[0] == "native"
    # the extension missing: auto falls back and says why, native is an error
    monkeypatch.setattr(instance_native, "_ext", None)
    monkeypatch.setattr(instance_native, "_UNAVAILABLE", "the extension data_pipeline._native_instances is not built (test)")
    chosen, why = instance_native.choose_builder("auto")
    assert chosen == "reference" and "not built" in why
    with pytest.raises(ValueError, match="instance_builder=native, but the extension .* is not built"):
        instance_native.choose_builder("native")
    with pytest.raises(RuntimeError, match="not built"):
        instance_native.create_document_instances("d", np.zeros(3, np.uint16), np.array([0, 3]), 1, params=p, seed=1)


def test_config_field_is_validated():
    from bertdist.config import ConfigError, from_dict
    from data_pipeline.config import BuildConfig

    assert BuildConfig().instance_builder == "auto"
    assert from_dict(BuildConfig, {"instance_builder": "reference"}).instance_builder == "reference"
    for make in (lambda: from_dict(BuildConfig, {"instance_builder": "fast"}), lambda: BuildConfig(instance_builder="fast")):
        with pytest.raises(ConfigError, match=r"instance_builder: 'fast' is not one of \['auto', 'native', 'reference'\]"):
            make()


# ---------------------------------------------------------------- the pipeline's transforms


def _shards_with(builder: str, out: Path, docs, p: InstanceParams, vocab: Path) -> tuple[dict, dict]:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.test_pipeline import TestPipeline

    from data_pipeline.beam.instance_transform import CreateInstances
    from data_pipeline.beam.shards import SplitShards, WriteShards
    from tests.conftest import IN_PROCESS

    out.mkdir()
    with TestPipeline(options=PipelineOptions(IN_PROCESS)) as pipe:
        built = pipe | beam.Create(docs) | CreateInstances(
            p, seed=7, dupe_factor=2, vocab_path=str(vocab), scratch_dir=str(out / "docs"), spill_tokens=2000,
            builder=builder)
        (built["instances"]
         | WriteShards(str(out), {"train": SplitShards(2, expected_rows=400)}, p.vocab_size, 64, "zstd",
                       rows_per_bucket=100, spill_rows=150))
    counters = {c.key.metric.name: c.committed for c in pipe.result.metrics().query()["counters"]}
    return {f.name: f.read_bytes() for f in sorted(out.glob("train-*.parquet"))}, counters


@needs_native
def test_transforms_write_identical_shards_with_either_builder(tmp_path, small_vocab):
    """CreateInstances + WriteShards on the bundled books: the same shard bytes and counters."""
    from bertdist.data.vocab import load_vocab
    from data_pipeline.pipeline import instance_params
    from data_pipeline.config import BuildConfig
    from data_pipeline.text import text_to_sentences
    from data_pipeline.tokenization import load_tokenizer
    from data_pipeline.wordpiece import WordPieceEncoder
    from tests.conftest import SAMPLES

    tokens = load_vocab(small_vocab)
    tok, lowercase = load_tokenizer(small_vocab)
    encoder = WordPieceEncoder(tok, lowercase)
    sents = text_to_sentences((SAMPLES / "books" / "shakespeare-macbeth.txt").read_text(encoding="utf-8"))[:1200]
    docs = [(f"macbeth#{j}", *encoder.encode_document(sents[j:j + 100])) for j in range(0, len(sents), 100)]
    p = instance_params(BuildConfig(max_seq_length=48), tokens)
    ref, ref_counts = _shards_with("reference", tmp_path / "ref", docs, p, small_vocab)
    nat, nat_counts = _shards_with("native", tmp_path / "nat", docs, p, small_vocab)
    assert len(ref) == 2 and ref.keys() == nat.keys()
    for name in ref:
        assert ref[name] == nat[name], f"{name} differs between the reference and the native builder"
    assert ref_counts["train_instances"] == nat_counts["train_instances"] > 100
    assert ref_counts["train_random_next"] == nat_counts["train_random_next"]


@pytest.mark.slow  # six builds: about 15 s
@needs_native
@pytest.mark.parametrize("masking", [dict(whole_word_mask=False), dict(whole_word_mask=True), dict(masking_mode="span")],
                         ids=["token", "whole_word", "span"])
def test_build_records_identical_with_and_without_the_extension(tmp_path, small_vocab, monkeypatch, caplog,
                                                                masking):
    """The whole pipeline (bundled wiki + books, in-process): auto takes the native builder;
    with the extension hidden it falls back to the reference, and every shard is byte-identical."""
    import json
    import logging

    from data_pipeline import build_records
    from tests.conftest import SAMPLES

    def shard_bytes(manifest: Path) -> dict[str, bytes]:
        man = json.loads(manifest.read_text())
        return {Path(s["path"]).name: (manifest.parent / s["path"]).read_bytes()
                for sp in man["splits"].values() for s in sp["shards"]}

    def build(out: Path) -> dict[str, bytes]:
        return shard_bytes(build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], out, small_vocab,
                                         max_seq_length=64, dupe_factor=2, num_shards=2, **masking))

    caplog.set_level(logging.INFO, logger="data_pipeline")
    monkeypatch.setattr(instance_native, "_logged", set())
    native = build(tmp_path / "native")
    monkeypatch.setattr(instance_native, "_ext", None)
    monkeypatch.setattr(instance_native, "_UNAVAILABLE", "hidden by the test")
    reference = build(tmp_path / "reference")
    said = [r.getMessage() for r in caplog.records if "training instances:" in r.getMessage()]
    assert any("native builder" in m for m in said) and any("reference builder" in m and "hidden" in m for m in said)
    assert len(native) == 3 and native.keys() == reference.keys()  # 2 train shards + 1 held-out
    for name in native:
        assert native[name] == reference[name], f"{name} differs between the native and the reference builder"


def test_config_instance_builder_reaches_the_pipeline(tmp_path, small_vocab, caplog, monkeypatch):
    """``instance_builder`` from the config is what the driver and the workers use; an impossible
    ``native`` fails in the driver before any output is written."""
    import logging

    from data_pipeline import build_records
    from tests.conftest import SAMPLES

    caplog.set_level(logging.INFO, logger="data_pipeline")
    build_records([f"books:{SAMPLES / 'books'}"], tmp_path / "ref", small_vocab, max_seq_length=64, dupe_factor=1,
                  num_shards=1, instance_builder="reference")
    said = [r.getMessage() for r in caplog.records if "training instances:" in r.getMessage()]
    assert said and all("reference builder (instance_builder=reference)" in m for m in said)
    monkeypatch.setattr(instance_native, "_ext", None)  # as if the extension were not built
    monkeypatch.setattr(instance_native, "_UNAVAILABLE", "the extension is not built (test)")
    with pytest.raises(ValueError, match="instance_builder=native, but the extension is not built"):
        build_records([f"books:{SAMPLES / 'books'}"], tmp_path / "native", small_vocab, max_seq_length=64,
                      num_shards=1, instance_builder="native")
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").iterdir())


# ---------------------------------------------------------------- the ragged gather


@needs_native
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64])
def test_gather_ragged_equals_the_numpy_reference(dtype):
    """The native gather (InstanceBatch.take's hot loop) against reference_gather_ragged: any row
    order, repeated rows, empty rows, no rows, and offsets that do not start at 0 (slices)."""
    from data_pipeline import _native_instances
    from data_pipeline.instance_batch import reference_gather_ragged

    rng = np.random.default_rng(5)
    for _ in range(50):
        lens = rng.integers(0, 9, size=rng.integers(0, 40))
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64) + int(rng.integers(0, 3))
        vals = rng.integers(0, np.iinfo(np.uint16).max, size=int(offs[-1]) + 2).astype(dtype)
        rows = rng.integers(0, max(len(lens), 1), size=rng.integers(0, 60)).astype(np.int64) if len(lens) else \
            np.empty(0, np.int64)
        got_v, got_o = _native_instances.gather_ragged(vals, offs, rows)
        want_v, want_o = reference_gather_ragged(vals, offs, rows)
        assert got_v.dtype == want_v.dtype and np.array_equal(got_v, want_v)
        assert got_o.dtype == np.int64 and np.array_equal(got_o, want_o)


@needs_native
def test_gather_ragged_argument_errors():
    from data_pipeline import _native_instances

    g = _native_instances.gather_ragged
    u16, i64 = np.zeros(3, np.uint16), np.array([0, 1, 3], np.int64)
    cases = [
        ((u16, i64, np.array([2], np.int64)), IndexError, r"rows\[0\] = 2 is out of range for 2 rows"),
        ((u16, i64, np.array([-1], np.int64)), IndexError, r"rows\[0\] = -1 is out of range"),
        ((u16, np.array([0, 1, 5], np.int64), np.array([1], np.int64)), ValueError,
         r"offsets\[1:3\] = \(1, 5\) do not lie in the 3 values"),
        ((u16, np.array([0, 2, 1], np.int64), np.array([1], np.int64)), ValueError, r"\(2, 1\) do not lie"),
        ((np.zeros(3, np.float32), i64, np.array([0], np.int64)), ValueError,
         "expected dtype uint16, uint32 or int64, got float32"),
        ((u16, i64.astype(np.int32), np.array([0], np.int64)), ValueError, "offsets: expected dtype int64, got int32"),
        ((u16, i64, np.array([0], np.int32)), ValueError, "rows: expected dtype int64, got int32"),
        ((u16, np.empty(0, np.int64), np.empty(0, np.int64)), ValueError, "at least one entry"),
        ((np.zeros((2, 2), np.uint16), i64, np.array([0], np.int64)), ValueError, "expected a 1-D array, got 2-D"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            g(*args)


def test_take_is_the_same_with_and_without_the_extension(monkeypatch):
    """InstanceBatch.take (sort by key, bucket split) through the native gather or the numpy one."""
    from data_pipeline import instance_batch

    p = params(max_seq_length=32, max_predictions_per_seq=5, vocab_size=500)
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 500, size=400).astype(np.uint16)
    batch = create_instances("d", ids, np.arange(0, 401, 20, dtype=np.int64), 0, params=p, seed=1)
    fast = batch.sorted_by_key()
    monkeypatch.setattr(instance_batch, "_native_gather", None)
    slow = batch.sorted_by_key()
    for f in FIELDS:
        a, b = getattr(fast, f), getattr(slow, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
    assert not np.array_equal(batch.keys, fast.keys) and np.all(fast.keys[1:] >= fast.keys[:-1])
