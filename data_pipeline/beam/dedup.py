"""Duplicate removal within one source as a Beam transform (the functions are data_pipeline.dedup's).

    documents --Sign--> (content hash, document)          one shuffle of the text (Keep)
              \\-----> (band key, (hash, signature))  --GroupByKey--> candidate pairs, verified
                        pairs --one list--> connected components: {hash: component's smallest hash}
    CoGroupByKey(content hash): keep the smallest id of exact duplicates, and drop every document
    whose component's smallest hash is not its own.

Only signatures and band keys go through the band shuffle; the one step that sees all of
something holds the duplicate pairs (two 16-byte hashes each), never a document. Every decision
is a function of the set of documents (smallest id, smallest hash), so the output does not
depend on input order or worker count. Counters ``dedup:<source>:<what>``; a stable sample of
removed pairs goes to ``<report>/dedup/<source>.json``.
"""
from __future__ import annotations

import json

import apache_beam as beam
import numpy as np

from data_pipeline.beam.filters import SNIPPET_CHARS, counter_name, document_text, sample_key, write_json
from data_pipeline.beam.metrics import count
from data_pipeline.config import DedupConfig

BANDS = "bands"
KEPT_ROOT, REMOVED = "kept_root", "removed"


class _SignDoFn(beam.DoFn):
    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def process(self, kv):
        from data_pipeline import dedup

        doc_id, value = kv
        words = dedup.word_hashes(document_text(value))
        h = dedup.content_hash(words)
        yield (h, kv)
        if self.cfg.near and len(words):
            sig = dedup.minhash(dedup.ngram_hashes(words, self.cfg.ngram, self.cfg.seed), self.cfg.num_perm,
                                self.cfg.seed)
            bands, rows = dedup.bands_and_rows(self.cfg.threshold, self.cfg.num_perm)
            packed = sig.tobytes()
            for key in dedup.band_keys(sig, bands, rows):
                yield beam.pvalue.TaggedOutput(BANDS, (key, (h, packed)))


def _bucket_pairs(kv, threshold: float, max_comparisons: int):
    from data_pipeline.dedup import bucket_pairs

    _, members = kv
    members = [(h, np.frombuffer(sig, np.uint32)) for h, sig in members]
    if len(members) > 1:
        yield from bucket_pairs(members, threshold, max_comparisons)


def _components(pairs: list, source: str):
    from data_pipeline.dedup import components

    roots = components(pairs)
    count(counter_name("dedup", source, "near_clusters"), sum(1 for n, r in roots.items() if n == r))
    return sorted(roots.items())


def _words(value) -> int:
    return len(document_text(value).split())


class _KeepDoFn(beam.DoFn):
    def __init__(self, source: str):
        self.source = source

    def process(self, kv):
        h, grouped = kv
        docs = sorted(grouped["docs"], key=lambda d: d[0])  # exact duplicates: the smallest id is kept
        if not docs:
            return
        roots = list(grouped["root"])
        root = roots[0] if roots else h
        keep, rest = docs[0], docs[1:]
        if rest:
            count(counter_name("dedup", self.source, "exact_clusters"))
            count(counter_name("dedup", self.source, "exact_documents_removed"), len(rest))
            count(counter_name("dedup", self.source, "exact_words_removed"), sum(_words(v) for _, v in rest))
            for doc_id, value in rest:
                yield beam.pvalue.TaggedOutput(REMOVED, (h, ("exact", doc_id, keep[0], document_text(value)[:SNIPPET_CHARS])))
        if root != h:  # a near-duplicate of the component's smallest hash
            count(counter_name("dedup", self.source, "near_documents_removed"))
            count(counter_name("dedup", self.source, "near_words_removed"), _words(keep[1]))
            yield beam.pvalue.TaggedOutput(REMOVED, (root, ("near", keep[0], None, document_text(keep[1])[:SNIPPET_CHARS])))
            return
        if roots:  # the kept document of a near-duplicate cluster: the sample pairs need its id
            yield beam.pvalue.TaggedOutput(KEPT_ROOT, (h, (keep[0], document_text(keep[1])[:SNIPPET_CHARS])))
        yield keep


def _pairs(kv):
    """(root hash, {kept, removed}) -> sample rows: exact pairs name their kept id already."""
    _, g = kv
    kept = list(g[KEPT_ROOT])
    for kind, doc_id, kept_id, text in g[REMOVED]:
        if kind == "near" and kept:
            kept_id, kept_text = kept[0]
        else:
            kept_text = None
        yield (sample_key(doc_id), doc_id, json.dumps({"kind": kind, "removed": doc_id, "kept": kept_id,
                                                        "removed_text": text, "kept_text": kept_text},
                                                       ensure_ascii=False))


class Deduplicate(beam.PTransform):
    """(doc_id, text or [sentences]) of one source -> the same without duplicates (see the
    module docstring)."""

    def __init__(self, source: str, cfg: DedupConfig, report_dir: str | None = None):
        super().__init__()
        self.source, self.cfg, self.report_dir = source, cfg, report_dir

    def expand(self, docs):
        if not self.cfg.enabled:
            return docs
        cfg, source = self.cfg, self.source
        signed = docs | "Sign" >> beam.ParDo(_SignDoFn(cfg)).with_outputs(BANDS, main="docs")
        if cfg.near:
            roots = (signed[BANDS]
                     | "Buckets" >> beam.GroupByKey()
                     | "Pairs" >> beam.FlatMap(_bucket_pairs, cfg.threshold, cfg.max_bucket_comparisons)
                     | "DistinctPairs" >> beam.Distinct()
                     | "AllPairs" >> beam.combiners.ToList()
                     | "Components" >> beam.FlatMap(_components, source))
        else:
            roots = docs.pipeline | "NoPairs" >> beam.Create([])
        kept = ({"docs": signed["docs"], "root": roots} | "Join" >> beam.CoGroupByKey()
                | "Keep" >> beam.ParDo(_KeepDoFn(source)).with_outputs(REMOVED, KEPT_ROOT, main="kept"))
        if self.report_dir is not None:
            path = f"{self.report_dir}/dedup/{source}.json"

            def write(rows):
                write_json(path, {"source": source, "pairs": [json.loads(r) for *_, r in sorted(rows)]})

            ({REMOVED: kept[REMOVED], KEPT_ROOT: kept[KEPT_ROOT]} | "JoinKept" >> beam.CoGroupByKey()
             | "PairRows" >> beam.FlatMap(_pairs)
             | "Sample" >> beam.combiners.Top.Smallest(cfg.sample_pairs)
             | "WritePairs" >> beam.Map(write))
        return kept["kept"]
