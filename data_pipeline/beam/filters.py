"""Document quality filtering as a Beam transform (the rules are data_pipeline.quality's).

Every dropped document is counted as ``filtered:<source>:<rule>`` and the few with the
smallest id hash per rule (a stable sample, whatever the worker count) are written as JSON
under the build's report directory, for the manifest."""
from __future__ import annotations

import hashlib
import json

import apache_beam as beam

from data_pipeline.beam.metrics import count
from data_pipeline.config import QualityConfig

DROPPED = "dropped"
SNIPPET_CHARS = 300


def sample_key(doc_id: str) -> bytes:
    """Sort key of the stable samples: a hash of the id, so the sample spreads over the input."""
    return hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()


def write_json(path: str, data) -> None:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as f:
        f.write(json.dumps(data, indent=1, ensure_ascii=False).encode("utf-8"))


def counter_name(kind: str, source: str, what: str) -> str:
    """``<kind>:<source>:<what>``: the commit step reads the manifest's sections back from these."""
    return f"{kind}:{source}:{what}"


class _QualityDoFn(beam.DoFn):
    def __init__(self, source: str, cfg: QualityConfig):
        self.source, self.cfg = source, cfg

    def process(self, kv):
        from data_pipeline.quality import check

        doc_id, text = kv
        rule, stats = check(text, self.cfg)
        if rule is None:
            yield kv
            return
        count(counter_name("filtered", self.source, rule))
        count(counter_name("filtered_words", self.source, rule), stats.words)
        example = {"doc_id": doc_id, "stats": {k: round(v, 4) if isinstance(v, float) else v
                                               for k, v in vars(stats).items()},
                   "text": text[:SNIPPET_CHARS]}
        yield beam.pvalue.TaggedOutput(DROPPED, (rule, (sample_key(doc_id), doc_id, json.dumps(example))))


class FilterQuality(beam.PTransform):
    """(doc_id, text) -> the documents that pass every rule of ``cfg``."""

    def __init__(self, source: str, cfg: QualityConfig, report_dir: str | None = None, examples: int = 3):
        super().__init__()
        self.source, self.cfg, self.report_dir, self.examples = source, cfg, report_dir, examples

    def expand(self, docs):
        if not self.cfg.enabled:
            return docs
        out = docs | "Rules" >> beam.ParDo(_QualityDoFn(self.source, self.cfg)).with_outputs(DROPPED, main="kept")
        if self.report_dir is not None:
            source, report = self.source, self.report_dir

            def write(kv):
                rule, picked = kv
                write_json(f"{report}/quality/{source}.{rule}.json",
                           {"source": source, "rule": rule, "examples": [json.loads(e) for *_, e in sorted(picked)]})

            (out[DROPPED] | "Sample" >> beam.combiners.Top.SmallestPerKey(self.examples)
             | "WriteExamples" >> beam.Map(write))
        return out["kept"]
