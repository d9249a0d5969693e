"""The Beam transform for instances (CreateInstances): tokenized documents to MLM/NSP instances,
or to rows of packed documents.

Documents are spilled to files, grouped into NSP buckets by a build plan (see
data_pipeline.negatives), cut into work units, and built by the instance builder
(data_pipeline.instance_algorithm, or its native bridge data_pipeline.instance_native). With
packing, a bucket's work units are pack groups, fixed hash ranges, each packed on its own
(data_pipeline.packing)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import apache_beam as beam
import numpy as np

from data_pipeline.beam.metrics import Progress, count
from data_pipeline.beam.spill import BufferedSpillDoFn
from data_pipeline.instance_algorithm import InstanceParams, InstanceStats, create_instances, expected_instances
from data_pipeline.instance_batch import InstanceBatch, list_column
from data_pipeline.negatives import (
    HASH_SPACE, BuildPlan, CorpusSummary, NegativeSource, buckets_of_slot, canonical_order, fraction_threshold,
    hash_ranges, make_plan, placement_hash, split_units,
)
from data_pipeline.packing import pack_documents
from data_pipeline.seeds import derive_seed


def _ragged(arrays: list, typ):
    import pyarrow as pa

    offs = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=offs[1:])
    return pa.LargeListArray.from_arrays(pa.array(offs), pa.array(np.concatenate(arrays), type=typ))


class _SpillDocsDoFn(BufferedSpillDoFn):
    """Buffers tokenized documents up to ``spill_tokens`` tokens and writes them to one Arrow IPC
    file, one record batch per *slot* (the top ``slot_bits`` bits of the document's placement
    hash), and emits only a reference per slot, {slot, path, batch, documents, tokens}, and a
    :class:`CorpusSummary` of the file's documents on the ``summaries`` output. The documents
    wait in these files until the plan (corpus totals) says which split and bucket each belongs
    to: a file, not the runner's memory. A bucket is a hash range, so reading it reads the slots
    it covers only."""

    def __init__(self, scratch_dir: str, spill_tokens: int, slot_bits: int, fraction_threshold: int, keep: int):
        self.scratch_dir, self.limit, self.slot_bits = scratch_dir, spill_tokens, slot_bits
        self.fraction_threshold, self.keep = fraction_threshold, keep

    def size_of(self, doc) -> int:
        return doc[1].shape[0]

    def spill(self, docs: list):
        import uuid

        import pyarrow as pa
        from apache_beam.io.filesystems import FileSystems

        hashes = [placement_hash(d[0]) for d in docs]
        slots: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            slots.setdefault(h >> (64 - self.slot_bits), []).append(i)
        dtype = pa.from_numpy_dtype(docs[0][1].dtype)
        path = f"{self.scratch_dir}/docs-{uuid.uuid4().hex}.arrow"
        refs = []
        summary = CorpusSummary(keep=self.keep, fraction_threshold=self.fraction_threshold)
        writer = None
        with FileSystems.create(path) as f:
            for batch, slot in enumerate(sorted(slots)):
                members = slots[slot]
                table = pa.table({
                    "hash": pa.array(np.array([hashes[i] for i in members], np.uint64)),
                    "doc_id": pa.array([docs[i][0] for i in members], pa.string()),
                    "ids": _ragged([docs[i][1] for i in members], dtype),
                    "bounds": _ragged([np.asarray(docs[i][2], np.int64) for i in members], pa.int64())})
                if writer is None:
                    writer = pa.ipc.new_file(f, table.schema)
                writer.write_table(table, max_chunksize=1 << 30)  # one record batch per slot
                tokens = 0
                for i in members:
                    summary.add(hashes[i], int(docs[i][1].shape[0]), len(docs[i][2]) - 1)
                    tokens += int(docs[i][1].shape[0])
                refs.append({"slot": slot, "path": path, "batch": batch, "documents": len(members), "tokens": tokens})
            writer.close()
        yield from refs
        yield beam.pvalue.TaggedOutput("summaries", summary)


@dataclass
class _Document:
    hash: int
    doc_id: str
    ids: np.ndarray
    bounds: np.ndarray
    piece: int  # index of the piece (slot of a spill file) it was read from


def read_documents(pieces: list[dict], lo: int, hi: int) -> list[_Document]:
    """The documents of ``pieces`` whose placement hash lies in [lo, hi), in the bucket's
    canonical order (:func:`data_pipeline.negatives.canonical_order`). Each file is opened once."""
    import pyarrow as pa
    from apache_beam.io.filesystems import FileSystems

    found: list[_Document] = []
    by_path: dict[str, list[int]] = {}
    for k, piece in enumerate(pieces):
        by_path.setdefault(piece["path"], []).append(k)
    for path in sorted(by_path):
        with FileSystems.open(path) as f:  # random access: only the pieces' record batches are read
            reader = pa.ipc.open_file(f)
            for k in by_path[path]:
                table = pa.Table.from_batches([reader.get_batch(pieces[k]["batch"])])
                hashes = table.column("hash").to_numpy()
                keep = np.flatnonzero((hashes >= np.uint64(lo)) & ((hashes < np.uint64(hi)) if hi < HASH_SPACE
                                                                    else True))
                if not keep.size:
                    continue
                ids_all, ids_offs = list_column(table.column("ids"))
                b_all, b_offs = list_column(table.column("bounds"))
                doc_ids = table.column("doc_id").to_pylist()
                for i in keep.tolist():
                    found.append(_Document(int(hashes[i]), doc_ids[i], ids_all[ids_offs[i]:ids_offs[i + 1]],
                                           b_all[b_offs[i]:b_offs[i + 1]], k))
    order = canonical_order([d.hash for d in found], [d.doc_id for d in found], [d.ids for d in found])
    return [found[i] for i in order]


def _write_json(path: str, data) -> None:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as f:
        f.write(json.dumps(data, indent=1).encode())


class _PlanFn(beam.CombineFn):
    """The spill files' corpus summaries (one small summary per file) -> the build plan
    (:func:`data_pipeline.negatives.make_plan`), made once for the whole corpus."""

    def __init__(self, plan_args: dict):
        self.plan_args = plan_args

    def create_accumulator(self) -> CorpusSummary:
        return CorpusSummary(keep=self.plan_args["keep"], fraction_threshold=self.plan_args["fraction_threshold"])

    def add_input(self, total: CorpusSummary, summary: CorpusSummary) -> CorpusSummary:
        return total.merge(summary)

    def merge_accumulators(self, totals):
        totals = iter(totals)
        first = next(totals)
        for t in totals:
            first.merge(t)
        return first

    def extract_output(self, total: CorpusSummary) -> BuildPlan:
        return make_plan(total, **{k: v for k, v in self.plan_args.items() if k not in ("keep", "fraction_threshold")})


def _report_plan(plan: BuildPlan, report_dir: str | None) -> BuildPlan:
    """Writes the plan to ``report_dir/plan-<unique>.json`` (a retried bundle writes another copy:
    the driver checks that all copies are the same and checks the units' reports against it)."""
    if report_dir is not None:
        import uuid

        _write_json(f"{report_dir}/plan-{uuid.uuid4().hex}.json", plan.to_json())
    return plan


def _to_buckets(piece: dict, plan: BuildPlan, slot_bits: int):
    """Piece -> ((split, bucket), piece + the bucket's hash range and the buckets' count), for
    every bucket whose range meets the piece's slot."""
    for split, j in buckets_of_slot(plan, piece["slot"], slot_bits):
        lo, hi = plan.buckets[split][j]
        yield (split, j), {**piece, "lo": lo, "hi": hi, "buckets": plan.num_buckets(),
                           "plan_documents": plan.documents[split], "plan_tokens": plan.tokens[split],
                           "split_buckets": len(plan.buckets[split])}


def _units(kv, target_units: int):
    """A bucket's pieces -> work units: enough per bucket that ``target_units`` units exist in
    all (a small corpus has one bucket per split, and one worker must not build it alone). Each
    unit builds the documents of its pieces; a unit of an NSP bucket reads the whole bucket for
    the negatives (each worker keeps the last buckets it read)."""
    (split, bucket), pieces = kv
    pieces = sorted(pieces, key=lambda p: (p["path"], p["batch"]))
    lo, hi = pieces[0]["lo"], pieces[0]["hi"]
    n = max(1, -(-target_units // max(1, pieces[0]["buckets"])))
    groups = split_units([p["tokens"] for p in pieces], n)
    for u, group in enumerate(groups):
        yield {"split": split, "bucket": bucket, "lo": lo, "hi": hi, "pieces": pieces, "unit": u,
               "units": len(groups), "mine": group, "plan_documents": pieces[0]["plan_documents"]}


def pack_groups(lo: int, hi: int, split_tokens: int, split_buckets: int, group_tokens: int) -> list[tuple[int, int]]:
    """A bucket's pack groups: its hash range [lo, hi) cut into equal ranges of about
    ``group_tokens`` tokens each, by the split's mean tokens per bucket (from the plan: the same
    on every worker and every run of the same corpus, whatever the bundling)."""
    per_bucket = split_tokens / max(1, split_buckets)
    return hash_ranges(lo, hi, max(1, math.ceil(per_bucket / max(1, group_tokens))))


def _pack_units(kv, group_tokens: int):
    """A bucket's pieces -> one work unit per pack group; each reads the pieces of the bucket and
    keeps the documents of its hash range."""
    (split, bucket), pieces = kv
    pieces = sorted(pieces, key=lambda p: (p["path"], p["batch"]))
    first = pieces[0]
    groups = pack_groups(first["lo"], first["hi"], first["plan_tokens"], first["split_buckets"], group_tokens)
    for u, (lo, hi) in enumerate(groups):
        yield {"split": split, "bucket": bucket, "lo": lo, "hi": hi, "pieces": pieces, "unit": u,
               "units": len(groups), "mine": list(range(len(pieces))), "plan_documents": first["plan_documents"]}


YIELD_ROWS = 8192  # the most rows _CreateInstancesDoFn hands on in one element


class _CreateInstancesDoFn(beam.DoFn):
    """A work unit (see :func:`_units`) -> (split, InstanceBatch) per document, all dupes, and a
    small JSON report of the unit's counts under ``report_dir/units`` (the driver checks them
    against the plan and the shards). ``builder`` is the config's ``instance_builder``: the native
    builder (data_pipeline.instance_native, bitwise the same output) when it is built, else the
    Python reference (see ``choose_builder``)."""

    def __init__(self, params: InstanceParams, seed: int, dupe_factor: int, vocab_path: str,
                 builder: str = "auto", report_dir: str | None = None, cache_tokens: int = 1 << 25):
        self.params, self.seed, self.dupe_factor = params, seed, dupe_factor
        self.vocab_path, self.builder, self.report_dir = vocab_path, builder, report_dir
        self.cache_tokens = cache_tokens

    def setup(self):
        from bertdist.data.vocab import continuation_mask
        from data_pipeline import instance_native

        self.continuation = continuation_mask(self.vocab_path) if self.params.needs_words else None
        chosen, why = instance_native.choose_builder(self.builder)
        instance_native.log_choice(chosen, why)
        self.native = instance_native.create_document_instances if chosen == "native" else None
        self.progress = Progress("documents turned into instances")
        # the last buckets read, newest last, while they hold at most cache_tokens tokens (a worker
        # gets units of the train and the held-out bucket in turn: one entry would read each again)
        self.cache: dict[tuple, tuple[list, NegativeSource | None, int]] = {}

    def _bucket(self, unit):
        """The bucket's documents (all of them for NSP negatives, else the unit's) and its source."""
        import pyarrow as pa

        nsp = self.params.objective == "nsp"
        key = (unit["split"], unit["lo"], unit["hi"], tuple((p["path"], p["batch"]) for p in unit["pieces"]),
               None if nsp else tuple(unit["mine"]))
        hit = self.cache.pop(key, None)
        if hit is None:
            pieces = unit["pieces"] if nsp else [unit["pieces"][k] for k in unit["mine"]]
            docs = read_documents(pieces, unit["lo"], unit["hi"])
            if not nsp:
                docs = [_Document(d.hash, d.doc_id, d.ids, d.bounds, unit["mine"][d.piece]) for d in docs]
            source = None
            if nsp and docs:
                source = NegativeSource.from_documents(
                    [(d.doc_id, d.ids, d.bounds) for d in docs],
                    seed=derive_seed(self.seed, "negatives", unit["split"], unit["lo"], unit["hi"]))
                # the documents as views of the source's flat arrays: the Arrow tables can go, and
                # Arrow's allocator gives their memory back (it keeps freed pages otherwise)
                docs = [_Document(d.hash, d.doc_id, *source.document(i)[1:], d.piece) for i, d in enumerate(docs)]
                pa.default_memory_pool().release_unused()
            hit = (docs, source, sum(d.ids.shape[0] for d in docs))
            while self.cache and sum(v[2] for v in self.cache.values()) + hit[2] > self.cache_tokens:
                self.cache.pop(next(iter(self.cache)))  # the oldest goes
        self.cache[key] = hit
        return hit[0], hit[1]

    def finish_bundle(self):
        self.cache.clear()  # the next stages run in this worker too: their memory, not an idle bucket's

    def process(self, unit):
        split = unit["split"]
        docs, source = self._bucket(unit)
        mine = set(unit["mine"])
        total = InstanceStats()
        documents = sentences = tokens = 0
        for place, doc in enumerate(docs):
            if doc.piece not in mine:
                continue
            stats = InstanceStats()
            if self.native is not None:
                batch = self.native(doc.doc_id, doc.ids, doc.bounds, self.dupe_factor, params=self.params,
                                    seed=self.seed, negatives=source, doc_index=place,
                                    continuation=self.continuation, stats=stats)
            else:
                deal = source.dealer(place) if source is not None else None
                batch = InstanceBatch.concat([
                    create_instances(doc.doc_id, doc.ids, doc.bounds, d, params=self.params, seed=self.seed,
                                     negatives=deal, continuation=self.continuation, stats=stats)
                    for d in range(self.dupe_factor)])
                stats.count_windows(deal)
            self.progress.tick()
            total.add(stats)
            documents += 1
            sentences += len(doc.bounds) - 1
            tokens += doc.ids.shape[0]
            # in slices: a long book's dupes are tens of thousands of rows, which would more than
            # double the next stage's row buffer (shuffle_spill_rows) at once
            for lo in range(0, len(batch), YIELD_ROWS):
                yield split, batch.slice(lo, min(lo + YIELD_ROWS, len(batch)))
        count(f"{split}_instances", total.instances)
        count(f"{split}_random_next", total.random_next)
        if total.same_document_fallbacks:
            count("nsp_same_document_fallbacks", total.same_document_fallbacks)
        if total.skipped_short_sentence:
            count("skipped_sop_one_token_chunk", total.skipped_short_sentence)
        if self.report_dir is not None:  # a retried unit rewrites the same file with the same counts
            _write_json(f"{self.report_dir}/units/{split}-{unit['bucket']:05d}-{unit['unit']:05d}.json",
                        {"split": split, "bucket": unit["bucket"], "unit": unit["unit"], "units": unit["units"],
                         "documents": documents, "sentences": sentences, "tokens": tokens,
                         **dataclasses.asdict(total)})


class _PackDocumentsDoFn(beam.DoFn):
    """A pack group (see :func:`_pack_units`) -> (split, InstanceBatch) slices of its packed rows,
    counted, and the unit's JSON report (as :class:`_CreateInstancesDoFn`'s, plus the packing
    counts that the driver reconciles with the shards)."""

    def __init__(self, params: InstanceParams, seed: int, report_dir: str | None = None):
        self.params, self.seed, self.report_dir = params, seed, report_dir

    def setup(self):
        self.progress = Progress("documents packed")

    def process(self, unit):
        split = unit["split"]
        docs = read_documents(unit["pieces"], unit["lo"], unit["hi"])
        p = self.params
        batch, stats = pack_documents([d.ids for d in docs], max_seq_length=p.max_seq_length, cls_id=p.cls_id,
                                      sep_id=p.sep_id, key_seed=derive_seed(self.seed, "pack", split, unit["lo"]),
                                      dtype=np.uint16 if p.vocab_size < 65536 else np.uint32)
        self.progress.tick(len(docs))
        for lo in range(0, len(batch), YIELD_ROWS):
            yield split, batch.slice(lo, min(lo + YIELD_ROWS, len(batch)))
        count(f"{split}_instances", len(batch))
        count("packed_documents_split", stats.split_documents)
        count("packed_padding_tokens", stats.padding)
        if self.report_dir is not None:
            _write_json(f"{self.report_dir}/units/{split}-{unit['bucket']:05d}-{unit['unit']:05d}.json",
                        {"split": split, "bucket": unit["bucket"], "unit": unit["unit"], "units": unit["units"],
                         "documents": len(docs), "sentences": sum(len(d.bounds) - 1 for d in docs),
                         "tokens": stats.document_tokens,
                         **dataclasses.asdict(InstanceStats(instances=len(batch))), "packing": stats.to_json()})


class CreateInstances(beam.PTransform):
    """Tokenized documents -> ``{"instances": (split, InstanceBatch) pairs, one batch per document
    (all dupes), "expected_rows": {split: rows}, one element}``.

    Documents are spilled to files by placement hash (:class:`_SpillDocsDoFn`); a plan made from
    the whole corpus's totals (:func:`data_pipeline.negatives.make_plan`) says which are held
    out (``heldout_fraction`` of the hash space, at least ``heldout_min_documents`` documents
    within ``heldout_floor_max_fraction``) and cuts each split into buckets of about
    ``bucket_tokens`` tokens; every bucket becomes a few work units, and an NSP negative comes
    from the document's own bucket (so held-out negatives from held-out documents only). Only
    file references go through the runner.

    ``expected_rows`` estimates each split's instances from the plan's token counts (the real
    split sizes: the held-out floor can make the held-out split many times ``heldout_fraction``),
    for :class:`WriteShards` to size its buckets by.

    ``report_dir`` (optional) receives the plan (``plan-*.json``) and one JSON report per unit,
    which the driver checks before it commits. ``slot_bits`` (how finely the spill files are cut)
    and ``target_units`` only change how the work is read and spread, never the output.

    ``pack_group_tokens`` (not None): MLM-only rows of packed documents instead
    (:mod:`data_pipeline.packing`): each bucket is cut into pack groups of about that many tokens
    (:func:`pack_groups`), each packed on its own; ``dupe_factor`` must be 1."""

    def __init__(self, params: InstanceParams, *, seed: int, dupe_factor: int, vocab_path: str, scratch_dir: str,
                 report_dir: str | None = None, heldout_fraction: float = 0.0, heldout_min_documents: int = 0,
                 heldout_floor_max_fraction: float = 0.25, bucket_tokens: int = 1 << 22, slot_bits: int = 2,
                 spill_tokens: int = 1 << 20, target_units: int = 32, builder: str = "auto",
                 pack_group_tokens: int | None = None):
        super().__init__()
        if pack_group_tokens is not None and (dupe_factor != 1 or pack_group_tokens < 1):
            raise ValueError(f"packing takes dupe_factor 1 (got {dupe_factor}) and pack_group_tokens >= 1 "
                             f"(got {pack_group_tokens})")
        self.pack_group_tokens = pack_group_tokens
        self.params, self.seed, self.dupe_factor, self.vocab_path = params, seed, dupe_factor, vocab_path
        self.scratch_dir, self.report_dir, self.spill_tokens = scratch_dir, report_dir, spill_tokens
        self.heldout_fraction, self.heldout_min_documents = heldout_fraction, heldout_min_documents
        self.heldout_floor_max_fraction = heldout_floor_max_fraction
        self.bucket_tokens, self.slot_bits = bucket_tokens, slot_bits
        self.target_units, self.builder = target_units, builder

    def expand(self, docs):
        threshold = fraction_threshold(self.heldout_fraction)
        keep = self.heldout_min_documents if self.heldout_fraction > 0 else 0
        spilled = docs | "SpillDocs" >> beam.ParDo(
            _SpillDocsDoFn(self.scratch_dir, self.spill_tokens, self.slot_bits, threshold, keep)
        ).with_outputs("summaries", main="pieces")
        plan_args = {"keep": keep, "fraction_threshold": threshold, "heldout_fraction": self.heldout_fraction,
                     "heldout_min_documents": self.heldout_min_documents,
                     "heldout_floor_max_fraction": self.heldout_floor_max_fraction, "bucket_tokens": self.bucket_tokens}
        plan = (spilled.summaries
                | "Plan" >> beam.CombineGlobally(_PlanFn(plan_args)).without_defaults()
                | "ReportPlan" >> beam.Map(_report_plan, self.report_dir))
        dupe, seq = self.dupe_factor, self.params.max_seq_length
        expected_rows = plan | "ExpectedRows" >> beam.Map(
            lambda plan: {split: expected_instances(tokens, dupe, seq) for split, tokens in plan.tokens.items()})
        buckets = (spilled.pieces
                   | "ToBuckets" >> beam.FlatMap(_to_buckets, beam.pvalue.AsSingleton(plan), self.slot_bits)
                   | "GroupBucket" >> beam.GroupByKey())
        if self.pack_group_tokens is not None:
            instances = (buckets
                         | "PackUnits" >> beam.FlatMap(_pack_units, self.pack_group_tokens)
                         | "Spread" >> beam.Reshuffle()
                         | "Pack" >> beam.ParDo(_PackDocumentsDoFn(self.params, self.seed, self.report_dir)))
            return {"instances": instances, "expected_rows": expected_rows}
        instances = (buckets
                     | "Units" >> beam.FlatMap(_units, self.target_units)
                     | "Spread" >> beam.Reshuffle()  # units, not documents: cheap, and spreads them over workers
                     | "Create" >> beam.ParDo(_CreateInstancesDoFn(
                         self.params, self.seed, self.dupe_factor, self.vocab_path, builder=self.builder,
                         report_dir=self.report_dir, cache_tokens=self.bucket_tokens)))
        return {"instances": instances, "expected_rows": expected_rows}
