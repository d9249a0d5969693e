"""Duplicate removal within one source as a Beam transform (the functions are data_pipeline.dedup's).

    documents --Sign--> (content hash, document)          one shuffle of the text (Keep)
              \\-----> (band key, (hash, signature))  --GroupByKey--> candidate pairs
    candidates: the signatures' estimate decides far from the threshold; near it, the exact
                n-gram sets of the two documents (two small joins, only those documents' n-grams)
    verified pairs --one list--> connected components: {hash: component's smallest hash}
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


# Candidate pairs whose signatures estimate a similarity this far around the threshold are
# checked on their exact n-gram sets (the estimate's standard deviation is about 0.035 at 0.8
# with 128 bins); above the band, the estimate decides, below it, the pair is dropped.
SURE_ABOVE, CHECK_BELOW = 0.1, 0.15
SURE, CHECK = "sure", "check"


def _bucket_pairs(kv, threshold: float, max_comparisons: int):
    from data_pipeline.dedup import bucket_pairs

    _, members = kv
    members = [(h, np.frombuffer(sig, np.uint32)) for h, sig in members]
    if len(members) > 1:
        for a, b, est in bucket_pairs(members, threshold - CHECK_BELOW, max_comparisons):
            yield beam.pvalue.TaggedOutput(SURE if est >= threshold + SURE_ABOVE else CHECK, (a, b))


class _NgramsOfDoFn(beam.DoFn):
    """(hash, document) -> (hash, its n-gram hashes) for the documents in pairs to check only
    (a side input of their hashes: a few, not the corpus)."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg

    def process(self, kv, wanted):
        from data_pipeline import dedup

        h, (_, value) = kv
        if h in wanted:
            ngrams = dedup.ngram_hashes(dedup.word_hashes(document_text(value)), self.cfg.ngram, self.cfg.seed)
            yield h, np.unique(ngrams).tobytes()


def _send_ngrams(kv):
    """At a pair's first document: its n-grams go to the pair's second document (once each)."""
    a, g = kv
    for ngrams in g["ngrams"]:  # one (exact duplicates share the hash and the text's words)
        for b in sorted(set(g["partners"])):
            yield b, (a, ngrams)
        return


def _check_pairs(kv, threshold: float, source: str):
    b, g = kv
    for ngrams_b in g["ngrams"]:
        nb = np.frombuffer(ngrams_b, np.uint64)
        for a, ngrams_a in dict(g["incoming"]).items():
            na = np.frombuffer(ngrams_a, np.uint64)
            inter = len(np.intersect1d(na, nb, assume_unique=True))
            union = len(na) + len(nb) - inter
            if union and inter / union >= threshold:
                yield a, b
            else:
                count(counter_name("dedup", source, "candidates_rejected_on_exact_check"))
        return


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
            pairs = (signed[BANDS]
                     | "Buckets" >> beam.GroupByKey()
                     | "Pairs" >> beam.FlatMap(_bucket_pairs, cfg.threshold, cfg.max_bucket_comparisons)
                     .with_outputs(SURE, CHECK))
            # a pair found in several bands comes several times: harmless repeats (components take
            # a pair once), cheaper than a Distinct's shuffle stage each
            check = pairs[CHECK]
            wanted = check | "Ends" >> beam.FlatMap(lambda ab: ab) | "AsKeys" >> beam.Map(lambda h: (h, None))
            ngrams = signed["docs"] | "NgramsToCheck" >> beam.ParDo(_NgramsOfDoFn(cfg), wanted=beam.pvalue.AsDict(wanted))
            sent = ({"ngrams": ngrams, "partners": check} | "JoinFirst" >> beam.CoGroupByKey()
                    | "SendNgrams" >> beam.FlatMap(_send_ngrams))
            checked = ({"ngrams": ngrams, "incoming": sent} | "JoinSecond" >> beam.CoGroupByKey()
                       | "ExactCheck" >> beam.FlatMap(_check_pairs, cfg.threshold, source))
            roots = ((pairs[SURE], checked) | "Edges" >> beam.Flatten()
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
