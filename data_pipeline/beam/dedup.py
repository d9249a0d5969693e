"""Duplicate removal over one group of sources as a Beam transform (the functions are
data_pipeline.dedup's; the groups are BuildConfig.dedup_groups).

    documents of each source --Sign--> (content hash, (source, id, document))   one shuffle of the text (Keep)
              \\-----> (band key, (hash, (source, id), signature))  --GroupByKey--> candidate pairs
    candidates: the signatures' estimate decides far from the threshold; near it, the exact
                n-gram sets of the two documents (two small joins, only those documents' n-grams)
    verified pairs --one list--> connected components: {hash: (component's kept hash, its source)}
    CoGroupByKey(content hash): keep one document of the exact duplicates, and drop every
    document whose component is kept under another hash.

Which document a cluster keeps: the one of the earliest-listed source, then the smallest
document id. The listed order is the user's statement of preference (a curated source listed
first keeps its copy), and both parts are properties of the documents, never of their arrival,
so the output does not depend on input order or worker count. A hash's rank is the smallest
(source, id) of its documents; every document of one hash has the same signature and so lands in
the same band buckets, which is why each bucket can take that minimum locally.

Only signatures and band keys go through the band shuffle; the one step that sees all of
something holds the duplicate pairs (two 16-byte hashes and their ranks each), never a document.
Counters ``dedup:<source>:<what>``, a removal counted for the source of the removed document
(``cross_source_documents_removed``: those whose kept copy is in another source), a cluster for
the source of its kept document; a stable sample of removed pairs, naming both sources, goes to
``<report>/dedup/<source>.json`` per source of the removed documents.
"""
from __future__ import annotations

import heapq
import json
from typing import Sequence

import apache_beam as beam
import numpy as np

from data_pipeline.beam.filters import SNIPPET_CHARS, counter_name, sample_key, write_json
from data_pipeline.beam.metrics import count
from data_pipeline.config import DedupConfig

BANDS = "bands"
KEPT_ROOT, REMOVED = "kept_root", "removed"


def _kept_tag(pos: int) -> str:
    return f"kept{pos}"


class _SignDoFn(beam.DoFn):
    """(id, document) of the group's ``pos``-th source -> (hash, (pos, id, document)), and its
    band keys."""

    def __init__(self, cfg: DedupConfig, pos: int):
        self.cfg, self.pos = cfg, pos

    def process(self, kv):
        from data_pipeline import dedup

        doc_id, text = kv
        words = dedup.word_hashes(text)
        h = dedup.content_hash(words)
        yield (h, (self.pos, doc_id, text))
        if self.cfg.near and len(words):
            sig = dedup.signature(words, self.cfg.ngram, self.cfg.num_perm, self.cfg.seed)
            bands, rows = dedup.bands_and_rows(self.cfg.threshold, self.cfg.num_perm)
            packed, rank = sig.tobytes(), (self.pos, doc_id)
            for key in dedup.band_keys(sig, bands, rows):
                yield beam.pvalue.TaggedOutput(BANDS, (key, (h, rank, packed)))


# Candidate pairs whose signatures estimate a similarity this far around the threshold are
# checked on their exact n-gram sets (the estimate's standard deviation is about 0.035 at 0.8
# with 128 bins); above the band, the estimate decides, below it, the pair is dropped.
SURE_ABOVE, CHECK_BELOW = 0.1, 0.15
SURE, CHECK = "sure", "check"


def _bucket_pairs(kv, threshold: float, max_comparisons: int):
    """SURE: ((a, rank a), (b, rank b)); CHECK: (a, (b, rank a, rank b))."""
    from data_pipeline.dedup import bucket_pairs

    _, members = kv
    rank: dict[bytes, tuple] = {}
    sigs = []
    for h, r, sig in members:
        if h not in rank or r < rank[h]:  # every document of a hash is in this bucket: its minimum
            rank[h] = r
        sigs.append((h, sig))
    if len(rank) > 1:
        members = [(h, np.frombuffer(sig, np.uint32)) for h, sig in sigs]
        for a, b, est in bucket_pairs(members, threshold - CHECK_BELOW, max_comparisons):
            if est >= threshold + SURE_ABOVE:
                yield beam.pvalue.TaggedOutput(SURE, ((a, rank[a]), (b, rank[b])))
            else:
                yield beam.pvalue.TaggedOutput(CHECK, (a, (b, rank[a], rank[b])))


class _NgramsOfDoFn(beam.DoFn):
    """(hash, document) -> (hash, its n-gram hashes) for the documents in pairs to check only
    (a side input of their hashes: a few, not the corpus)."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def process(self, kv, wanted):
        from data_pipeline import dedup

        h, (_, _, text) = kv
        if h in wanted:
            ngrams = dedup.ngram_hashes(dedup.word_hashes(text), self.cfg.ngram, self.cfg.seed)
            yield h, np.unique(ngrams).tobytes()


def _send_ngrams(kv):
    """At a pair's first document: its n-grams go to the pair's second document (once each)."""
    a, g = kv
    for ngrams in g["ngrams"]:  # one (exact duplicates share the hash and the text's words)
        for b, ra, rb in sorted(set(g["partners"])):
            yield b, (a, ngrams, ra, rb)
        return


def _check_pairs(kv, threshold: float, sources: Sequence[str]):
    b, g = kv
    for ngrams_b in g["ngrams"]:
        nb = np.frombuffer(ngrams_b, np.uint64)
        for a, (ngrams_a, ra, rb) in {a: rest for a, *rest in g["incoming"]}.items():
            na = np.frombuffer(ngrams_a, np.uint64)
            inter = len(np.intersect1d(na, nb, assume_unique=True))
            union = len(na) + len(nb) - inter
            if union and inter / union >= threshold:
                yield (a, ra), (b, rb)
            else:  # counted for the source that would have lost its document
                count(counter_name("dedup", sources[max(ra, rb)[0]], "candidates_rejected_on_exact_check"))
        return


def _components(pairs: list, sources: Sequence[str]):
    """Ranked pairs -> (hash, (its component's kept hash, that hash's source position))."""
    from data_pipeline.dedup import components

    rank = {}
    for (a, ra), (b, rb) in pairs:
        rank[a], rank[b] = ra, rb
    roots = components(((a, b) for (a, _), (b, _) in pairs), rank)
    for n, r in roots.items():
        if n == r:
            count(counter_name("dedup", sources[rank[r][0]], "near_clusters"))
    return sorted((n, (r, rank[r][0])) for n, r in roots.items())


def _words(text: str) -> int:
    return len(text.split())


class _KeepDoFn(beam.DoFn):
    def __init__(self, sources: Sequence[str]):
        self.sources = list(sources)

    def _removed(self, kind: str, doc, kept_pos: int):
        pos, _, text = doc
        src = self.sources[pos]
        count(counter_name("dedup", src, f"{kind}_documents_removed"))
        count(counter_name("dedup", src, f"{kind}_words_removed"), _words(text))
        if pos != kept_pos:
            count(counter_name("dedup", src, "cross_source_documents_removed"))

    def process(self, kv):
        h, grouped = kv
        docs = sorted(grouped["docs"], key=lambda d: (d[0], d[1]))  # the earliest source, then the smallest id
        if not docs:
            return
        roots = list(grouped["root"])
        root, root_pos = roots[0] if roots else (h, docs[0][0])
        keep, rest = docs[0], docs[1:]
        if rest:
            count(counter_name("dedup", self.sources[keep[0]], "exact_clusters"))
            for doc in rest:
                self._removed("exact", doc, keep[0])
                yield beam.pvalue.TaggedOutput(REMOVED, (h, ("exact", doc[0], doc[1], keep[0], keep[1],
                                                             doc[2][:SNIPPET_CHARS])))
        if root != h:  # a near-duplicate of the document its component keeps
            self._removed("near", keep, root_pos)
            yield beam.pvalue.TaggedOutput(REMOVED, (root, ("near", keep[0], keep[1], None, None,
                                                            keep[2][:SNIPPET_CHARS])))
            return
        if roots:  # the kept document of a near-duplicate cluster: the sample pairs need its id
            yield beam.pvalue.TaggedOutput(KEPT_ROOT, (h, (keep[0], keep[1], keep[2][:SNIPPET_CHARS])))
        kept = (keep[1], keep[2])
        yield beam.pvalue.TaggedOutput(_kept_tag(keep[0]), kept) if keep[0] else kept  # the first: main


def _pairs(kv, sources: Sequence[str]):
    """(root hash, {kept, removed}) -> (source of the removed document, sample row); exact pairs
    name their kept document already."""
    _, g = kv
    kept = list(g[KEPT_ROOT])
    for kind, pos, doc_id, kept_pos, kept_id, text in g[REMOVED]:
        if kind == "near" and kept:
            kept_pos, kept_id, kept_text = kept[0]
        else:
            kept_text = None
        row = {"kind": kind, "removed_source": sources[pos], "removed": doc_id,
               "kept_source": sources[kept_pos] if kept_pos is not None else None, "kept": kept_id,
               "removed_text": text, "kept_text": kept_text}
        yield sources[pos], (sample_key(doc_id), doc_id, json.dumps(row, ensure_ascii=False))


class _SmallestPerSource(beam.CombineFn):
    """(source, row) -> {source: its ``limits[source]`` smallest rows, sorted}: one combine for
    the group's samples, not one per source."""

    def __init__(self, limits: dict[str, int]):
        self.limits = limits

    def create_accumulator(self):
        return {}

    def add_input(self, acc, kv):
        source, row = kv
        rows = acc.setdefault(source, [])
        rows.append(row)
        if len(rows) > 2 * self.limits[source] + 16:
            acc[source] = heapq.nsmallest(self.limits[source], rows)
        return acc

    def merge_accumulators(self, accs):
        out: dict[str, list] = {}
        for acc in accs:
            for source, rows in acc.items():
                out.setdefault(source, []).extend(rows)
        return {s: heapq.nsmallest(self.limits[s], rows) for s, rows in out.items()}

    def extract_output(self, acc):
        return {s: heapq.nsmallest(self.limits[s], rows) for s, rows in acc.items()}


class Deduplicate(beam.PTransform):
    """Documents (doc_id, text) without duplicates (see the module docstring).

    ``sources`` names one source (the input is its PCollection and so is the output) or the
    group's sources in listed order (the input and the output are tuples of PCollections in that
    order). ``cfg`` decides what is a duplicate for the whole group; ``sample_pairs`` (default
    ``cfg.sample_pairs`` for each) sizes each source's sample of removed pairs."""

    def __init__(self, sources: str | Sequence[str], cfg: DedupConfig, report_dir: str | None = None,
                 sample_pairs: Sequence[int] | None = None):
        super().__init__()
        self.single = isinstance(sources, str)
        self.sources = [sources] if self.single else list(sources)
        self.cfg, self.report_dir = cfg, report_dir
        self.sample_pairs = list(sample_pairs) if sample_pairs is not None else [cfg.sample_pairs] * len(self.sources)

    def expand(self, docs):
        if not self.cfg.enabled:
            return docs
        cfg, sources = self.cfg, self.sources
        inputs = [docs] if self.single else list(docs)
        if len(inputs) != len(sources):
            raise ValueError(f"Deduplicate: {len(inputs)} inputs for {len(sources)} sources")
        signs = [pc | (f"Sign{pos}" if pos else "Sign") >> beam.ParDo(_SignDoFn(cfg, pos)).with_outputs(BANDS, main="docs")
                 for pos, pc in enumerate(inputs)]
        if len(signs) == 1:
            signed, bands = signs[0]["docs"], signs[0][BANDS]
        else:
            signed = tuple(s["docs"] for s in signs) | "AllDocs" >> beam.Flatten()
            bands = tuple(s[BANDS] for s in signs) | "AllBands" >> beam.Flatten()
        if cfg.near:
            pairs = (bands
                     | "Buckets" >> beam.GroupByKey()
                     | "Pairs" >> beam.FlatMap(_bucket_pairs, cfg.threshold, cfg.max_bucket_comparisons)
                     .with_outputs(SURE, CHECK))
            # a pair found in several bands comes several times: harmless repeats (components take
            # a pair once), cheaper than a Distinct's shuffle stage each
            check = pairs[CHECK]
            wanted = (check | "Ends" >> beam.FlatMap(lambda kv: (kv[0], kv[1][0]))
                      | "AsKeys" >> beam.Map(lambda h: (h, None)))
            ngrams = signed | "NgramsToCheck" >> beam.ParDo(_NgramsOfDoFn(cfg), wanted=beam.pvalue.AsDict(wanted))
            sent = ({"ngrams": ngrams, "partners": check} | "JoinFirst" >> beam.CoGroupByKey()
                    | "SendNgrams" >> beam.FlatMap(_send_ngrams))
            checked = ({"ngrams": ngrams, "incoming": sent} | "JoinSecond" >> beam.CoGroupByKey()
                       | "ExactCheck" >> beam.FlatMap(_check_pairs, cfg.threshold, sources))
            roots = ((pairs[SURE], checked) | "Edges" >> beam.Flatten()
                     # without defaults: no pairs, no components (a default empty list would cost
                     # Beam's default-injection stages, and mean the same)
                     | "AllPairs" >> beam.combiners.ToList().without_defaults()
                     | "Components" >> beam.FlatMap(_components, sources))
        else:
            roots = signed.pipeline | "NoPairs" >> beam.Create([])
        tags = [_kept_tag(pos) for pos in range(len(sources))]
        kept = ({"docs": signed, "root": roots} | "Join" >> beam.CoGroupByKey()
                | "Keep" >> beam.ParDo(_KeepDoFn(sources)).with_outputs(REMOVED, KEPT_ROOT, *tags[1:], main=tags[0]))
        if self.report_dir is not None:
            report, limits = self.report_dir, dict(zip(sources, self.sample_pairs))

            def write(samples):
                # every source of the group gets its file once anything was removed; without
                # removals there is no sample and no file (the commit reads what is there)
                for source in sources:
                    write_json(f"{report}/dedup/{source}.json",
                               {"source": source, "pairs": [json.loads(r) for *_, r in samples.get(source, [])]})

            ({REMOVED: kept[REMOVED], KEPT_ROOT: kept[KEPT_ROOT]} | "JoinKept" >> beam.CoGroupByKey()
             | "PairRows" >> beam.FlatMap(_pairs, sources)
             | "Sample" >> beam.CombineGlobally(_SmallestPerSource(limits)).without_defaults()
             | "WritePairs" >> beam.Map(write))
        outs = tuple(kept[t] for t in tags)
        return outs[0] if self.single else outs
