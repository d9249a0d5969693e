"""Beam DoFns and composite PTransforms (sources, Tokenize, CreateInstances, WriteShards).

Parse DoFns count every skipped or repaired input with a Beam Metrics counter in the
``data_pipeline`` namespace (``skipped_*``, ``repaired_*``) and log it; nothing is dropped silently.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from itertools import repeat

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from data_pipeline import beam_tuning, sharding, sources, text as textlib
from data_pipeline.config import PARQUET_ENCODINGS
from data_pipeline.instance_batch import InstanceBatch, list_column
from data_pipeline.instances import InstanceParams, InstanceStats, create_instances, derive_seed
from data_pipeline.negatives import (
    HASH_SPACE, CorpusSummary, NegativeSource, buckets_of_slot, canonical_order, fraction_threshold,
    make_plan, placement_hash, split_units,
)

NS = "data_pipeline"
beam_tuning.shorten_state_sampler_period()  # see beam_tuning: up to 200 ms idle per bundle otherwise
log = logging.getLogger("data_pipeline")
_counters: dict[object, object] = {}


def count(name: str, n: int = 1) -> None:
    c = _counters.get(name)
    if c is None:
        c = _counters[name] = Metrics.counter(NS, name)
    c.inc(n)


def distribution(name: str, value: int) -> None:
    d = _counters.get(("dist", name))
    if d is None:
        d = _counters[("dist", name)] = Metrics.distribution(NS, name)
    d.update(value)


def event(name: str, where: str) -> None:
    count(name)
    if name.startswith(("skipped_", "truncated_")) or name == "repaired_truncated_enormous_document":
        log.warning("%s: %s", name, where)


class _Progress:
    """A log line per worker every ``every`` seconds, so a long run shows it is moving."""

    def __init__(self, what: str, every: float = 15.0):
        self.what, self.every, self.n, self.last = what, every, 0, time.monotonic()

    def tick(self, n: int = 1):
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.info("progress [pid %d]: %s %d", os.getpid(), self.what, self.n)


# ---------------------------------------------------------------- sources


def _relative_ids(paths: list[str]) -> dict[str, str]:
    """Document-id prefix per file: its path relative to the files' common directory, so ids
    (and so the output) do not depend on where the corpus is mounted."""
    if len(paths) == 1:
        return {paths[0]: os.path.basename(paths[0])}
    common = os.path.commonpath(paths) if all(p.startswith("/") for p in paths) else os.path.dirname(os.path.commonprefix(paths))
    return {p: os.path.relpath(p, common) if common else p for p in paths}


# which files a directory input means, per source kind
DIRECTORY_SUFFIX = {"wiki": "*.xml*", "books": "*.txt", "jsonl": "*.jsonl*", "text": "*"}


def match_file_sizes(pattern: str, *, directory_suffix: str = "*") -> dict[str, int]:
    """Expand a path, directory or glob on any Beam filesystem: {path: size in bytes}, sorted by
    path (for stable ids)."""
    from apache_beam.io.filesystems import FileSystems

    pat = pattern
    if not any(ch in pattern for ch in "*?[") and FileSystems.exists(pattern) and os.path.isdir(pattern):
        pat = os.path.join(pattern, directory_suffix)
    sizes = {m.path: m.size_in_bytes for r in FileSystems.match([pat]) for m in r.metadata_list}
    if not sizes:
        raise FileNotFoundError(f"no input files match {pattern!r}")
    return dict(sorted(sizes.items()))


def match_files(pattern: str, *, directory_suffix: str = "*") -> list[str]:
    return list(match_file_sizes(pattern, directory_suffix=directory_suffix))


class _ReadWikiPages(beam.DoFn):
    def __init__(self, max_page_bytes: int):
        self.max_page_bytes = max_page_bytes

    def process(self, item):
        path, prefix = item
        from data_pipeline.wikitext import iter_page_blobs

        with sources.open_input(path) as stream:
            try:
                for kind, blob in iter_page_blobs(stream, self.max_page_bytes):
                    if kind == "page":
                        yield blob
                    else:
                        event(f"skipped_wiki_{kind}_page", path)
            except sources.STREAM_ERRORS as e:
                event("truncated_input_file", f"{path}: {e}; pages before the damage are kept")


class _ParseWikiPage(beam.DoFn):
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.progress = None

    def process(self, blob: bytes):
        from data_pipeline.wikitext import article_paragraphs, parse_page

        if self.progress is None:
            self.progress = _Progress("wiki pages parsed")
        self.progress.tick()
        page, repaired = parse_page(blob)
        if repaired:
            event("repaired_non_utf8", "wiki page")
        if page is None:
            event("skipped_wiki_malformed_page", blob[:120].decode("utf-8", "replace"))
            return
        if page.ns != 0:
            count("skipped_wiki_not_article_namespace")
            return
        if page.redirect:
            count("skipped_wiki_redirect")
            return
        try:
            paras = article_paragraphs(page.title, page.text)
        except Exception as e:  # the parser on pathological markup: one page lost, counted
            event("skipped_wiki_unparseable_page", f"{page.title}: {e!r}")
            return
        if paras is None:
            count("skipped_wiki_disambiguation")
            return
        yield (f"{self.prefix}{page.page_id}", "\n\n".join(paras))


class ReadWikipediaDump(beam.PTransform):
    """pages-articles XML (.xml / .xml.bz2, multistream ok) -> (doc_id, text), articles only."""

    def __init__(self, pattern: str, max_page_bytes: int = 64 << 20):
        super().__init__()
        self.files = match_files(pattern, directory_suffix=DIRECTORY_SUFFIX["wiki"])
        self.max_page_bytes = max_page_bytes

    def expand(self, pbegin):
        return (
            pbegin
            | "Files" >> beam.Create([(f, "") for f in self.files])
            | "SplitPages" >> beam.ParDo(_ReadWikiPages(self.max_page_bytes))
            | "Spread" >> beam.Reshuffle()
            | "Parse" >> beam.ParDo(_ParseWikiPage("wiki:"))
        )


class _ReadBook(beam.DoFn):
    def __init__(self, max_chars: int):
        self.max_chars = max_chars

    def process(self, item):
        path, rel = item
        with sources.open_input(path) as stream:
            text, events = sources.read_text_document(stream, self.max_chars)
        for e in events:
            event(e, path)
        text, stripped = textlib.strip_gutenberg(text)
        if stripped:
            count("repaired_gutenberg_boilerplate_stripped")
        yield (f"books:{rel}", text)


class ReadBooks(beam.PTransform):
    """A directory (or glob) of plain-text books -> (doc_id, text), one book per document."""

    def __init__(self, pattern: str, max_document_chars: int = 50_000_000):
        super().__init__()
        self.files = match_files(pattern, directory_suffix=DIRECTORY_SUFFIX["books"])
        self.max_chars = max_document_chars

    def expand(self, pbegin):
        ids = _relative_ids(self.files)
        return (pbegin | "Files" >> beam.Create([(f, ids[f]) for f in self.files])
                | "Read" >> beam.ParDo(_ReadBook(self.max_chars)))


class _ReadBertText(beam.DoFn):
    def process(self, item):
        path, rel, start, end = item
        with sources.open_input(path) as stream:
            for a, b in sources.iter_bert_format(stream, start, end):
                if a == "!event":
                    event(b, path)
                else:
                    yield (f"text:{rel}:{a}", b)


def byte_ranges(path: str, size: int, split_bytes: int) -> list[tuple[int, int | None]]:
    """[start, end) ranges of about ``split_bytes`` for an uncompressed file; one open range
    for a compressed one (it can only be read from the start)."""
    if path.endswith((".bz2", ".gz")) or size <= split_bytes:
        return [(0, None)]
    cuts = list(range(0, size, split_bytes))
    return [(a, b) for a, b in zip(cuts, cuts[1:] + [None])]


class ReadBertFormatText(beam.PTransform):
    """One sentence per line, blank line between documents -> (doc_id, [sentences]).

    Uncompressed files are read as byte ranges in parallel (documents are cut at blank lines,
    the id is the document's byte offset), so text never goes through a shuffle; compressed
    files are read whole and then spread over the workers."""

    def __init__(self, pattern: str, split_bytes: int | None = None):
        super().__init__()
        self.sizes = match_file_sizes(pattern, directory_suffix=DIRECTORY_SUFFIX["text"])
        self.files = list(self.sizes)
        self.split_bytes = split_bytes or self.auto_split_bytes(sum(self.sizes.values()))

    @staticmethod
    def auto_split_bytes(total: int, ranges: int = 32, lo: int = 1 << 20, hi: int = 8 << 20) -> int:
        """About ``ranges`` ranges for a small input, so that every worker gets a balanced share
        (runners hand out whole elements: two 8 MB-ranges of a 10 MB file are 8 MB against 2),
        and ranges of at most ``hi`` bytes for a large one."""
        return max(lo, min(hi, total // ranges))

    def expand(self, pbegin):
        ids = _relative_ids(self.files)
        ranges = [(f, ids[f], a, b) for f in self.files for a, b in byte_ranges(f, self.sizes[f], self.split_bytes)]
        docs = pbegin | "Ranges" >> beam.Create(ranges) | "Read" >> beam.ParDo(_ReadBertText())
        if any(f.endswith((".bz2", ".gz")) for f in self.files):
            docs = docs | "Spread" >> beam.Reshuffle()
        return docs


class _ReadJsonl(beam.DoFn):
    def __init__(self, text_field: str, id_field: str):
        self.text_field, self.id_field = text_field, id_field

    def process(self, item):
        path, rel = item
        with sources.open_input(path) as stream:
            for a, b in sources.iter_json_lines(stream, self.text_field, self.id_field):
                if a == "!event":
                    event(b, path)
                else:
                    yield (f"jsonl:{rel}:{a}", b)


class ReadJsonLines(beam.PTransform):
    """JSON Lines with a configurable text field -> (doc_id, text)."""

    def __init__(self, pattern: str, text_field: str = "text", id_field: str = ""):
        super().__init__()
        self.files = match_files(pattern, directory_suffix=DIRECTORY_SUFFIX["jsonl"])
        self.text_field, self.id_field = text_field, id_field

    def expand(self, pbegin):
        ids = _relative_ids(self.files)
        return (pbegin | "Files" >> beam.Create([(f, ids[f]) for f in self.files])
                | "Read" >> beam.ParDo(_ReadJsonl(self.text_field, self.id_field))
                | "Spread" >> beam.Reshuffle())


# ---------------------------------------------------------------- text -> tokens


class SplitSentences(beam.PTransform):
    """(doc_id, text) -> (doc_id, [sentences]) with blingfire (see data_pipeline.text)."""

    def expand(self, docs):
        return docs | "Split" >> beam.Map(lambda kv: (kv[0], textlib.text_to_sentences(kv[1])))


class _TokenizeDoFn(beam.DoFn):
    def __init__(self, vocab_path: str, lowercase, min_sentences: int, max_sentences: int, max_sentence_chars: int):
        self.vocab_path, self.lowercase = vocab_path, lowercase
        self.min_sentences, self.max_sentences, self.max_sentence_chars = min_sentences, max_sentences, max_sentence_chars

    def setup(self):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker: honest per-core rates
        from data_pipeline.tokenization import load_tokenizer
        from data_pipeline.wordpiece import WordPieceEncoder

        tok, lowercase = load_tokenizer(self.vocab_path, self.lowercase)
        self.encoder = WordPieceEncoder(tok, lowercase)
        log.info("tokenizer: %s", self.encoder.native_reason)
        self.progress = _Progress("documents tokenized")

    def process(self, kv):
        doc_id, sentences = kv
        self.progress.tick()
        sents: list[str] = []
        for s in sentences:
            if len(s) > self.max_sentence_chars:
                count("repaired_long_sentence_cut")
                sents.extend(textlib.cut_long_sentence(s, self.max_sentence_chars))
            else:
                sents.append(s)
        if not sents:
            count("skipped_empty_document")
            return
        count("input_words", sum(map(str.count, sents, repeat(" "))) + len(sents))  # words = spaces + 1
        ids, bounds = self.encoder.encode_document(sents)
        n = len(bounds) - 1
        if n < self.min_sentences:
            count("skipped_empty_document" if n == 0 else "skipped_too_few_sentences")
            return
        cuts = list(range(0, n, self.max_sentences)) + [n]
        if len(cuts) > 2:
            count("repaired_enormous_document_split")
        for j in range(len(cuts) - 1):
            lo, hi = cuts[j], cuts[j + 1]
            if hi - lo < self.min_sentences:
                continue
            part_bounds = bounds[lo:hi + 1] - bounds[lo]
            count("documents")
            count("sentences", hi - lo)
            yield ((doc_id if len(cuts) == 2 else f"{doc_id}#part{j}"), ids[bounds[lo]:bounds[hi]], part_bounds)


class Tokenize(beam.PTransform):
    """(doc_id, [sentences]) -> (doc_id, ids, sentence bounds), fast WordPiece in batches."""

    def __init__(self, vocab_path: str, lowercase=None, *, min_sentences: int = 2,
                 max_document_sentences: int = 20_000, max_sentence_chars: int = 20_000):
        super().__init__()
        self.fn = _TokenizeDoFn(vocab_path, lowercase, min_sentences, max_document_sentences, max_sentence_chars)

    def expand(self, docs):
        return docs | "Tokenize" >> beam.ParDo(self.fn)


# ---------------------------------------------------------------- instances


class _BufferedSpillDoFn(beam.DoFn):
    """Buffers elements until their ``size_of`` reaches ``limit``, then hands the buffer to
    ``spill`` (which writes a file and yields small references); the rest is spilled when the
    bundle ends."""

    limit: int

    def size_of(self, element) -> int:
        raise NotImplementedError

    def spill(self, buffer: list):
        raise NotImplementedError

    def start_bundle(self):
        self.buffer, self.size = [], 0

    def process(self, element):
        self.buffer.append(element)
        self.size += self.size_of(element)
        if self.size >= self.limit:
            yield from self._flush()

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.timestamp import MIN_TIMESTAMP
        from apache_beam.utils.windowed_value import WindowedValue

        for out in self._flush():
            if isinstance(out, beam.pvalue.TaggedOutput):
                yield beam.pvalue.TaggedOutput(out.tag, WindowedValue(out.value, MIN_TIMESTAMP, [GlobalWindow()]))
            else:
                yield WindowedValue(out, MIN_TIMESTAMP, [GlobalWindow()])

    def _flush(self):
        if self.buffer:
            buffer, self.buffer, self.size = self.buffer, [], 0
            yield from self.spill(buffer)


def _ragged(arrays: list, typ):
    import pyarrow as pa

    offs = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=offs[1:])
    return pa.LargeListArray.from_arrays(pa.array(offs), pa.array(np.concatenate(arrays), type=typ))


class _SpillDocsDoFn(_BufferedSpillDoFn):
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


class _ToBucketsDoFn(beam.DoFn):
    """Piece -> ((split, bucket), piece + the bucket's hash range and the buckets' count), for
    every bucket whose range meets the piece's slot. The plan comes from the spill files'
    summaries (a side input, one small summary per file), made once per DoFn instance; each
    instance also writes it to ``report_dir/plan-<unique>.json`` (all copies are the same: the
    driver checks them against the units' reports)."""

    def __init__(self, plan_args: dict, slot_bits: int, report_dir: str | None):
        self.plan_args, self.slot_bits, self.report_dir = plan_args, slot_bits, report_dir
        self.plan = None

    def process(self, piece, summaries):
        if self.plan is None:
            total = CorpusSummary(keep=self.plan_args["keep"], fraction_threshold=self.plan_args["fraction_threshold"])
            for summary in summaries:
                total.merge(summary)
            self.plan = make_plan(total, **{k: v for k, v in self.plan_args.items()
                                            if k not in ("keep", "fraction_threshold")})
            if self.report_dir is not None:
                import uuid

                _write_json(f"{self.report_dir}/plan-{uuid.uuid4().hex}.json", self.plan.to_json())
        plan = self.plan
        for split, j in buckets_of_slot(plan, piece["slot"], self.slot_bits):
            lo, hi = plan.buckets[split][j]
            yield (split, j), {**piece, "lo": lo, "hi": hi, "buckets": plan.num_buckets(),
                               "plan_documents": plan.documents[split]}


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


YIELD_ROWS = 8192  # the most rows _CreateInstancesDoFn hands on in one element


class _CreateInstancesDoFn(beam.DoFn):
    """A work unit (see :func:`_units`) -> (split, InstanceBatch) per document, all dupes, and a
    small JSON report of the unit's counts under ``report_dir/units`` (the driver checks them
    against the plan and the shards). ``builder`` is the config's ``instance_builder``: the native
    builder (data_pipeline.native_instances, bitwise the same output) when it is built, else the
    Python reference (see ``choose_builder``)."""

    def __init__(self, params: InstanceParams, seed: int, dupe_factor: int, vocab_path: str,
                 builder: str = "auto", report_dir: str | None = None, cache_tokens: int = 1 << 25):
        self.params, self.seed, self.dupe_factor = params, seed, dupe_factor
        self.vocab_path, self.builder, self.report_dir = vocab_path, builder, report_dir
        self.cache_tokens = cache_tokens

    def setup(self):
        from bertdist.data.vocab import continuation_mask
        from data_pipeline import native_instances

        self.continuation = continuation_mask(self.vocab_path) if self.params.whole_word_mask else None
        chosen, why = native_instances.choose_builder(self.builder)
        native_instances.log_choice(chosen, why)
        self.native = native_instances.create_document_instances if chosen == "native" else None
        self.progress = _Progress("documents turned into instances")
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


class CreateInstances(beam.PTransform):
    """Tokenized documents -> (split, InstanceBatch), one batch per document (all dupes).

    Documents are spilled to files by placement hash (:class:`_SpillDocsDoFn`); a plan made from
    the whole corpus's totals (:func:`data_pipeline.negatives.make_plan`) says which are held
    out (``heldout_fraction`` of the hash space, at least ``heldout_min_documents`` documents
    within ``heldout_floor_max_fraction``)
    and cuts each split into buckets of about ``bucket_tokens`` tokens; every bucket becomes a
    few work units, and an NSP negative comes from the document's own bucket (so held-out
    negatives from held-out documents only). Only file references go through the runner.

    ``report_dir`` (optional) receives the plan (``plan-*.json``, one identical copy per
    ToBuckets worker) and one JSON report per unit, which the driver checks before it commits.
    ``slot_bits`` (how finely the spill files are cut) and ``target_units`` only change how the
    work is read and spread, never the output."""

    def __init__(self, params: InstanceParams, *, seed: int, dupe_factor: int, vocab_path: str, scratch_dir: str,
                 report_dir: str | None = None, heldout_fraction: float = 0.0, heldout_min_documents: int = 0,
                 heldout_floor_max_fraction: float = 0.25, bucket_tokens: int = 1 << 22, slot_bits: int = 2,
                 spill_tokens: int = 1 << 20, target_units: int = 32, builder: str = "auto"):
        super().__init__()
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
        return (spilled.pieces
                | "ToBuckets" >> beam.ParDo(_ToBucketsDoFn(plan_args, self.slot_bits, self.report_dir),
                                            beam.pvalue.AsList(spilled.summaries))
                | "GroupBucket" >> beam.GroupByKey()
                | "Units" >> beam.FlatMap(_units, self.target_units)
                | "Spread" >> beam.Reshuffle()  # units, not documents: cheap, and spreads them over workers
                | "Create" >> beam.ParDo(_CreateInstancesDoFn(self.params, self.seed, self.dupe_factor, self.vocab_path,
                                                              builder=self.builder, report_dir=self.report_dir,
                                                              cache_tokens=self.bucket_tokens)))


# ---------------------------------------------------------------- balanced shards


class _HashingWriter:
    """A write-only stream that forwards to ``raw`` and keeps the sha256 and size of what passed."""

    def __init__(self, raw):
        self.raw, self.sha, self.size, self.closed = raw, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        data = bytes(data)
        self.sha.update(data)
        self.size += len(data)
        self.raw.write(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.raw.close()


class _SpillRunsDoFn(_BufferedSpillDoFn):
    """Buffers (split, InstanceBatch) pairs up to ``spill_rows`` rows, then writes them as one
    Arrow IPC run file, (split, bucket) by (split, bucket) (one record batch each), and emits
    only ``((split, bucket), where)``. The rows themselves never go through the runner's
    shuffle, so neither the workers nor the runner hold more than a buffer of them. File names
    are unique per attempt: a retried bundle's files are simply never referenced."""

    def __init__(self, runs_dir: str, vocab_size: int, bits: dict[str, int], spill_rows: int):
        self.runs_dir, self.vocab_size, self.bits, self.limit = runs_dir, vocab_size, bits, spill_rows

    def size_of(self, item) -> int:
        return len(item[1])

    def spill(self, items: list):
        import uuid

        import pyarrow as pa
        from apache_beam.io.filesystems import FileSystems

        by_split: dict[str, list[InstanceBatch]] = {}
        for split, batch in items:
            if split not in self.bits:
                raise ValueError(f"instances of split {split!r} reached WriteShards, which writes {sorted(self.bits)}")
            by_split.setdefault(split, []).append(batch)
        pieces = [((split, bucket), rows) for split in sorted(by_split)
                  for bucket, rows in sharding.split_by_bucket(InstanceBatch.concat(by_split[split]), self.bits[split])]
        if not pieces:
            return
        path = f"{self.runs_dir}/{uuid.uuid4().hex}.arrow"
        with FileSystems.create(path) as f:
            with pa.ipc.new_file(f, pieces[0][1].to_arrow(self.vocab_size, with_keys=True).schema) as w:
                for _, rows in pieces:
                    w.write_table(rows.to_arrow(self.vocab_size, with_keys=True), max_chunksize=1 << 30)
        for split in by_split:
            count(f"{split}_spill_files")
        for i, (key, rows) in enumerate(pieces):
            yield (key, {"path": path, "batch": i, "rows": len(rows)})


def read_run_pieces(metas: list[dict]) -> InstanceBatch:
    """The rows of one bucket, gathered from the run files that hold a piece of it."""
    import pyarrow as pa
    from apache_beam.io.filesystems import FileSystems

    parts = []
    for m in sorted(metas, key=lambda m: (m["path"], m["batch"])):
        with FileSystems.open(m["path"]) as f:  # random access: only this bucket's record batch is read
            table = pa.Table.from_batches([pa.ipc.open_file(f).get_batch(m["batch"])])
        if table.num_rows != m["rows"]:
            raise RuntimeError(f"{m['path']} batch {m['batch']}: {table.num_rows} rows, {m['rows']} were written")
        parts.append(InstanceBatch.from_arrow(table))
    return InstanceBatch.concat(parts)


class _WritePartDoFn(beam.DoFn):
    """((split, shard), bucket, rows) -> an Arrow IPC part file; yields ((split, shard), part description)."""

    def __init__(self, parts_dir: str, vocab_size: int):
        self.parts_dir, self.vocab_size = parts_dir, vocab_size

    def process(self, item):
        import pyarrow as pa
        from apache_beam.io.filesystems import FileSystems

        (split, shard), bucket, batch = item
        path = f"{self.parts_dir}/{split}-{shard:05d}-{bucket:08d}.arrow"
        table = batch.to_arrow(self.vocab_size)
        with FileSystems.create(path) as f:
            with pa.ipc.new_stream(f, table.schema) as w:
                w.write_table(table)
        yield ((split, shard), {"bucket": bucket, "path": path, "rows": len(batch), "tokens": batch.num_tokens(),
                       "masked_tokens": batch.num_masked(), "random_next": int((batch.nsp == 1).sum())})


def parquet_writer_options(schema, compression: str, encoding: str = "dictionary") -> dict:
    """``pq.ParquetWriter`` options for a shard (DataConfig.parquet_encoding explains the choice).
    "byte_stream_split" names every leaf column (``input_ids.list.element`` for a list)."""
    options = dict(compression=compression, write_statistics=False)
    if encoding == "byte_stream_split":
        import pyarrow as pa

        leaves = [f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name for f in schema]
        options.update(use_dictionary=False, column_encoding={leaf: "BYTE_STREAM_SPLIT" for leaf in leaves})
    elif encoding not in PARQUET_ENCODINGS:
        raise ValueError(f"parquet encoding {encoding!r} is not one of {list(PARQUET_ENCODINGS)}")
    return options


class _AssembleShardDoFn(beam.DoFn):
    """((split, shard), parts) -> the shard's Parquet file, parts streamed in bucket order, plus a sidecar."""

    def __init__(self, staging: str, num_shards: dict[str, int], row_group_size: int, compression: str,
                 encoding: str = "dictionary"):
        self.staging, self.num_shards = staging, num_shards
        self.row_group_size, self.compression, self.encoding = row_group_size, compression, encoding

    def process(self, kv):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from apache_beam.io.filesystems import FileSystems

        (split, shard), parts = kv
        parts = sorted(parts, key=lambda d: d["bucket"])
        name = shard_name(split, shard, self.num_shards[split])
        out = _HashingWriter(FileSystems.create(f"{self.staging}/{name}"))
        writer = None
        for part in parts:
            with FileSystems.open(part["path"]) as f:
                table = pa.ipc.open_stream(f).read_all()
            if writer is None:
                writer = pq.ParquetWriter(out, table.schema, **parquet_writer_options(table.schema, self.compression,
                                                                                      self.encoding))
            writer.write_table(table, row_group_size=self.row_group_size)
        writer.close()
        out.close()
        FileSystems.delete([p["path"] for p in parts])
        stats = {"path": name, "rows": sum(p["rows"] for p in parts), "bytes": out.size,
                 "sha256": out.sha.hexdigest(),
                 **{k: sum(p[k] for p in parts) for k in ("tokens", "masked_tokens", "random_next")}}
        with FileSystems.create(f"{self.staging}/{name}.json") as f:
            f.write(json.dumps(stats).encode())
        count(f"{split}_rows_written", stats["rows"])
        yield stats


def shard_name(split: str, i: int, n: int) -> str:
    return f"{split}-{i:05d}-of-{n:05d}.parquet"


@dataclass(frozen=True)
class SplitShards:
    """What WriteShards makes of one split: ``num_shards`` shards. ``expected_rows`` is an
    estimate made before the run; it only sizes the buckets (memory), never the output."""

    num_shards: int
    expected_rows: int


class WriteShards(beam.PTransform):
    """(split, InstanceBatch) pairs -> exactly balanced Parquet shards per split in ``staging``,
    rows sorted by key (see :mod:`data_pipeline.sharding`); each shard also gets a ``.json``
    sidecar with size, sha256 and counts. Workers hold one bucket (about ``rows_per_bucket``
    rows) at a time, never a shard. All splits share the transforms, keyed by split.
    ``encoding``: DataConfig.parquet_encoding."""

    def __init__(self, staging: str, splits: dict[str, SplitShards], vocab_size: int, row_group_size: int,
                 compression: str, *, rows_per_bucket: int = 16384, spill_rows: int = 32768,
                 encoding: str = "dictionary"):
        super().__init__()
        self.staging, self.splits = staging, dict(splits)
        self.vocab_size, self.row_group_size, self.compression = vocab_size, row_group_size, compression
        self.encoding = encoding
        # the bucket count comes from an estimate made before the run, so bucketing needs no
        # extra pass over the rows; the manifest records the real bucket sizes
        self.bits = {s: sharding.bucket_bits(v.expected_rows, rows_per_bucket) for s, v in self.splits.items()}
        self.spill_rows = spill_rows

    def expand(self, batches):
        num_shards = {s: v.num_shards for s, v in self.splits.items()}

        def place(kv, ranks):
            (split, bucket), metas = kv
            batch = read_run_pieces(list(metas))
            distribution(f"{split}_bucket_rows", len(batch))
            return (((split, s), bucket, rows)
                    for s, rows in sharding.place_bucket(bucket, batch, ranks[split], num_shards[split]))

        runs = batches | "Spill" >> beam.ParDo(_SpillRunsDoFn(f"{self.staging}/runs", self.vocab_size, self.bits,
                                                              self.spill_rows))
        ranks = (runs | "BucketRows" >> beam.Map(lambda kv: (kv[0], kv[1]["rows"]))
                 | "CountPerBucket" >> beam.CombinePerKey(sum)
                 | "BySplit" >> beam.MapTuple(lambda key, n: (key[0], (key[1], n)))
                 | "GroupSplit" >> beam.GroupByKey()
                 | "Ranks" >> beam.MapTuple(lambda split, counts: (split, sharding.bucket_ranks(dict(counts)))))
        return (
            runs
            | "GroupBucket" >> beam.GroupByKey()
            | "Place" >> beam.FlatMap(place, beam.pvalue.AsDict(ranks))
            | "WritePart" >> beam.ParDo(_WritePartDoFn(f"{self.staging}/parts", self.vocab_size))
            | "GroupShard" >> beam.GroupByKey()
            | "Assemble" >> beam.ParDo(_AssembleShardDoFn(self.staging, num_shards, self.row_group_size,
                                                          self.compression, self.encoding))
        )
