"""``run()``: wire sources -> sentences -> tokens -> instances -> shards, then commit atomically.

The commit protocol (so a killed run never leaves a manifest pointing at partial shards):
  1. Beam writes every shard and a ``.json`` sidecar into ``<output>/.staging-<run>/``
     (on an object store, straight into ``<output>/shards-<run>/``: see output_dir.py).
  2. After the pipeline finished, the driver checks that every shard is there with its
     recorded size and that the build adds up (:func:`_verify`: the plan's documents, the
     instance stage's unit reports and the rows written agree, and rows were written; else
     :class:`EmptyBuildError`, naming the runner, and nothing is committed), renames the
     staging dir to ``<output>/shards-<run>/`` and writes ``manifest.json`` through a
     temporary file and a rename (on an object store, in one PUT). Writing the manifest is
     the commit.
  3. Older ``shards-*`` dirs and stale ``.staging-*`` dirs are removed afterwards.
A run killed before step 2 leaves the previous manifest (if any) pointing at the previous,
complete shards; a re-run replaces both cleanly.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from bertdist.config import from_dict, to_dict
from bertdist.data.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from bertdist.data.records import record_schema
from bertdist.data.vocab import load_vocab, special_token_ids, vocab_sha256
from data_pipeline.config import DataConfig, InputConfig
from data_pipeline.instance_batch import InstanceBatch
from data_pipeline.instances import InstanceParams
from data_pipeline.negatives import BuildPlan, slot_bits
from data_pipeline.native_instances import choose_builder
from data_pipeline.output_dir import OutputDir
from data_pipeline.tokenization import vocab_is_cased
from data_pipeline.transforms import (
    DIRECTORY_SUFFIX, NS, CreateInstances, ReadBertFormatText, ReadBooks, ReadJsonLines, ReadWikipediaDump,
    SplitShards, SplitSentences, Tokenize, WriteShards, match_file_sizes, parquet_writer_options, shard_name,
)

log = logging.getLogger("data_pipeline")


def default_pipeline_args() -> list[str]:
    """DirectRunner, multi-processing on every local core (named explicitly: the default
    Prism runner downloads a binary, which is not possible here)."""
    return ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
            f"--direct_num_workers={os.cpu_count() or 1}"]


def read_source(p: beam.Pipeline, i: int, src: InputConfig, cfg: DataConfig):
    label = f"Read{i}_{src.kind}"
    if src.kind == "wiki":
        return p | label >> ReadWikipediaDump(src.path) | f"Sentences{i}" >> SplitSentences()
    if src.kind == "books":
        return p | label >> ReadBooks(src.path, cfg.max_document_chars) | f"Sentences{i}" >> SplitSentences()
    if src.kind == "jsonl":
        return p | label >> ReadJsonLines(src.path, src.text_field, src.id_field) | f"Sentences{i}" >> SplitSentences()
    if src.kind == "text":
        return p | label >> ReadBertFormatText(src.path)
    raise ValueError(f"unknown source kind {src.kind!r}")


def instance_params(cfg: DataConfig, tokens: list[str]) -> InstanceParams:
    sp = special_token_ids(tokens)
    return InstanceParams(
        max_seq_length=cfg.max_seq_length, short_seq_prob=cfg.short_seq_prob, objective=cfg.objective,
        nsp_random_prob=cfg.nsp_random_prob, masking=cfg.masking, masked_lm_prob=cfg.masked_lm_prob,
        max_predictions_per_seq=cfg.max_predictions_per_seq, whole_word_mask=cfg.whole_word_mask,
        cls_id=sp["cls"], sep_id=sp["sep"], mask_id=sp["mask"], vocab_size=len(tokens),
    )


def validate(cfg: DataConfig) -> None:
    from bertdist.config import ConfigError

    if not cfg.inputs:
        raise ConfigError("inputs: at least one input is needed")
    if not cfg.output:
        raise ConfigError("output: an output directory is needed")
    if not cfg.vocab or not os.path.isfile(cfg.vocab):
        raise ConfigError(f"vocab: {cfg.vocab!r} is not a file (train one with `bertdist data vocab`)")
    if not 8 <= cfg.max_seq_length <= 65535:
        raise ConfigError(f"max_seq_length {cfg.max_seq_length} must be in [8, 65535]")
    counts = {k: getattr(cfg, k) for k in ("num_shards", "heldout_num_shards", "dupe_factor", "shuffle_spill_rows",
                                           "shuffle_bucket_rows", "nsp_bucket_tokens")}
    if min(counts.values()) < 1:
        raise ConfigError("these must be >= 1: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    if not 0.0 <= cfg.heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction {cfg.heldout_fraction} must be in [0, 1)")
    if cfg.heldout_min_documents < 0:
        raise ConfigError(f"heldout_min_documents {cfg.heldout_min_documents} must be >= 0")
    if not 0.0 <= cfg.heldout_floor_max_fraction <= 1.0:
        raise ConfigError(f"heldout_floor_max_fraction {cfg.heldout_floor_max_fraction} must be in [0, 1]")


TOKENS_PER_TEXT_BYTE = 0.24  # WordPiece tokens per byte of English prose (about 1.3 per 5.5-byte word)


def input_sizes(cfg: DataConfig) -> dict[str, int]:
    """{path: bytes} of every input file."""
    return {path: size for src in cfg.inputs
            for path, size in match_file_sizes(src.path, directory_suffix=DIRECTORY_SUFFIX[src.kind]).items()}


def expected_tokens(cfg: DataConfig) -> int:
    """Rough token count from the input sizes, made before the run: it only sizes the shuffle
    buckets and the spill files' slots (memory and reads), never the output."""
    tokens = 0.0
    for src in cfg.inputs:
        for path, size in match_file_sizes(src.path, directory_suffix=DIRECTORY_SUFFIX[src.kind]).items():
            expand = 4.0 if path.endswith((".bz2", ".gz")) else 1.0  # typical text compression
            prose = 0.5 if src.kind == "wiki" else 1.0  # about half of a dump is markup
            tokens += size * expand * prose * TOKENS_PER_TEXT_BYTE
    return int(tokens)


def expected_rows(cfg: DataConfig) -> int:
    """Rough row count from the input sizes (see :func:`expected_tokens`)."""
    return int(cfg.dupe_factor * expected_tokens(cfg) / (0.9 * (cfg.max_seq_length - 3))) + 1


def work_units(options: PipelineOptions) -> int:
    """How many instance work units to aim for: four per local worker on the DirectRunner (more
    only adds per-unit costs there), 32 on other runners, whose worker count is not known here."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    runner = str(options.view_as(StandardOptions).runner or "DirectRunner")
    if runner.rsplit(".", 1)[-1] == "DirectRunner":
        return 4 * max(1, options.view_as(DirectOptions).direct_num_workers or 1)
    return 32


def build_pipeline(p: beam.Pipeline, cfg: DataConfig, staging: str, tokens: list[str], lowercase: bool) -> None:
    docs = [read_source(p, i, src, cfg) for i, src in enumerate(cfg.inputs)]
    sentences = docs[0] if len(docs) == 1 else tuple(docs) | "AllSources" >> beam.Flatten()
    min_sents = cfg.min_sentences if cfg.objective != "none" else 1
    tokenized = sentences | "Tokenize" >> Tokenize(
        cfg.vocab, lowercase, min_sentences=min_sents, max_document_sentences=cfg.max_document_sentences,
        max_sentence_chars=cfg.max_sentence_chars)
    frac = cfg.heldout_fraction
    rows = expected_rows(cfg)
    # one branch for both splits, keyed by split: a document's split comes from a hash of its id
    (tokenized
     | "Instances" >> CreateInstances(
         instance_params(cfg, tokens), seed=cfg.seed, dupe_factor=cfg.dupe_factor, vocab_path=cfg.vocab,
         scratch_dir=f"{staging}/docs", report_dir=f"{staging}/report", heldout_fraction=frac,
         heldout_min_documents=cfg.heldout_min_documents, heldout_floor_max_fraction=cfg.heldout_floor_max_fraction,
         bucket_tokens=cfg.nsp_bucket_tokens,
         slot_bits=slot_bits(expected_tokens(cfg), cfg.nsp_bucket_tokens), target_units=work_units(p.options),
         builder=cfg.instance_builder)
     | "Write" >> WriteShards(
         staging, {"train": SplitShards(cfg.num_shards, round(rows * (1 - frac))),
                   "heldout": SplitShards(cfg.heldout_num_shards, round(rows * frac))},
         len(tokens), cfg.row_group_size, cfg.compression,
         rows_per_bucket=cfg.shuffle_bucket_rows, spill_rows=cfg.shuffle_spill_rows, encoding=cfg.parquet_encoding))


def _query_counters(result) -> dict[str, int] | None:
    """The data_pipeline namespace's counters (and distributions' max and count), or None when the
    runner reports no metrics (Beam's Dask runner raises; a runner may also report none): then
    the counts that only metrics give are recorded as unknown, never as 0."""
    out: dict[str, int] = {}
    try:
        metrics = result.metrics().query()
        for c in metrics["counters"]:
            if c.key.metric.namespace == NS:
                v = c.committed if c.committed is not None else c.attempted
                out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(v or 0)
        for d in metrics["distributions"]:  # e.g. rows per shuffle bucket: max and count
            v = d.committed if d.committed is not None else d.attempted
            if d.key.metric.namespace == NS and v is not None and v.count:
                out[f"{d.key.metric.name}_max"] = max(out.get(f"{d.key.metric.name}_max", 0), int(v.max))
                out[f"{d.key.metric.name}_count"] = out.get(f"{d.key.metric.name}_count", 0) + int(v.count)
    except Exception as e:  # noqa: BLE001 - any runner's failure to report is "unknown"
        log.warning("the runner reports no Beam metrics (%s): counts that only metrics give are recorded as "
                    "unknown (null)", e)
        return None
    if not out:
        log.warning("the runner reported no data_pipeline metrics: counts that only metrics give are recorded "
                    "as unknown (null)")
        return None
    return dict(sorted(out.items()))


def runner_name(options: PipelineOptions) -> str:
    from apache_beam.options.pipeline_options import StandardOptions

    return str(options.view_as(StandardOptions).runner or "DirectRunner")


class EmptyBuildError(RuntimeError):
    """A build that would commit an empty or unverifiable dataset; the message names the runner."""


def run(cfg: DataConfig, pipeline_args: Sequence[str] | None = None) -> dict[str, Any]:
    """Build the records described by ``cfg``; returns the manifest (also written to disk).

    ``pipeline_args`` are Beam options (``--runner=...`` etc.); None = :func:`default_pipeline_args`.
    Raises :class:`EmptyBuildError` instead of committing when no row was written, or when the
    runner's output does not add up (see :func:`_verify`).
    """
    validate(cfg)
    t0 = time.time()
    tokens = load_vocab(cfg.vocab)
    lowercase = cfg.lowercase if cfg.lowercase is not None else not vocab_is_cased(tokens)
    out = OutputDir(cfg.output)
    run_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    # an impossible instance_builder=native fails here, before any work, not on every worker
    builder, why = choose_builder(cfg.instance_builder)
    log.info("training instances: %s builder (%s)", builder, why)  # every run; workers log once per process
    staging, final = out.prepare(run_id)
    args = list(default_pipeline_args() if pipeline_args is None else pipeline_args)
    options = PipelineOptions(args)
    log.info("data build: %d input(s) -> %s (run %s), Beam args %s", len(cfg.inputs), out.url, run_id, args)
    p = beam.Pipeline(options=options)
    build_pipeline(p, cfg, staging, tokens, lowercase)
    result = p.run()
    result.wait_until_finish()
    counters = _query_counters(result)
    manifest = _commit(cfg, out, staging, final, run_id, tokens, lowercase, counters, args, time.time() - t0,
                       runner=runner_name(options))
    return manifest


def _write_empty_shard(path: str, vocab_size: int, cfg: DataConfig) -> dict[str, Any]:
    import hashlib
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    table = InstanceBatch.empty("uint16" if vocab_size < 65536 else "uint32").to_arrow(vocab_size)
    pq.write_table(table, buf, row_group_size=cfg.row_group_size,
                   **parquet_writer_options(table.schema, cfg.compression, cfg.parquet_encoding))
    data = buf.getvalue()
    OutputDir.write_bytes(path, data)
    return {"path": path.rsplit("/", 1)[-1], "rows": 0, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tokens": 0, "masked_tokens": 0, "random_next": 0}


UNIT_COUNTS = ("documents", "sentences", "tokens", "instances", "random_next", "same_document_fallbacks",
               "distinct_windows")


def _read_report(out: OutputDir, report: str) -> tuple[BuildPlan | None, dict[str, dict[str, int]]]:
    """The plan (every copy must be the same) and the units' counts summed per split (max for
    max_window_reuse)."""
    from apache_beam.io.filesystems import FileSystems

    def matching(pattern: str) -> list[str]:
        return sorted(m.path for r in FileSystems.match([f"{report}/{pattern}"]) for m in r.metadata_list)

    plans = [out.read_json(p) for p in matching("plan-*.json")] if out.exists(report) else []
    if any(p != plans[0] for p in plans):
        raise EmptyBuildError(f"the {len(plans)} copies of the build plan under {report} differ: the workers saw "
                              "different corpora. Nothing was committed.")
    plan = BuildPlan.from_json(plans[0]) if plans else None
    units: dict[str, dict[str, int]] = {s: {**dict.fromkeys(UNIT_COUNTS, 0), "max_window_reuse": 0, "units": 0}
                                        for s in ("train", "heldout")}
    for path in matching("units/*.json") if out.exists(f"{report}/units") else []:
        u = out.read_json(path)
        acc = units[u["split"]]
        for k in UNIT_COUNTS:
            acc[k] += u[k]
        acc["max_window_reuse"] = max(acc["max_window_reuse"], u["max_window_reuse"])
        acc["units"] += 1
    return plan, units


def _verify(cfg: DataConfig, runner: str, plan: BuildPlan | None, units: dict, rows: dict[str, int],
            counters: dict | None) -> None:
    """Refuse to commit an empty or unverifiable dataset: the plan (corpus totals), the units'
    reports and the shards' sidecars come from different stages and must agree."""
    sizes = input_sizes(cfg)
    where = (f"runner {runner}; inputs {sum(sizes.values()):,} bytes in {len(sizes)} file(s). The tested runner is "
             "DirectRunner; Beam's Dask runner is known to drop output branches")
    built = sum(u["units"] for u in units.values())
    if plan is None and built:
        raise EmptyBuildError(f"the pipeline built {built} work units but wrote no build plan, so its output cannot "
                              f"be verified ({where}). Nothing was committed.")
    if plan is None or sum(plan.documents.values()) == 0:
        skips = ("unknown: the runner reports no metrics" if counters is None else
                 ", ".join(f"{k}={v:,}" for k, v in counters.items() if k.startswith(("skipped_", "truncated_")))
                 or "none")
        raise EmptyBuildError(f"no document reached the instance stage: every input was skipped, or the runner "
                              f"dropped the stages after reading ({where}; skips: {skips}). Nothing was committed.")
    for split in ("train", "heldout"):
        u = units[split]
        if u["documents"] != plan.documents[split] or u["instances"] != rows[split]:
            raise EmptyBuildError(
                f"{split}: the plan counted {plan.documents[split]:,} documents, the instance stage built "
                f"{u['documents']:,} of them into {u['instances']:,} instances ({u['units']} unit reports), and "
                f"{rows[split]:,} rows reached the shards: the runner lost work ({where}). Nothing was committed.")
    if sum(rows.values()) == 0:
        raise EmptyBuildError(f"{sum(plan.documents.values()):,} documents gave no instance at all ({where}). "
                              "Nothing was committed.")


def _negatives(units: dict, split: str) -> dict[str, Any]:
    u = units[split]
    return {"random_next": u["random_next"], "distinct_windows": u["distinct_windows"],
            "distinct_fraction": round(u["distinct_windows"] / u["random_next"], 4) if u["random_next"] else None,
            "max_window_reuse": u["max_window_reuse"], "same_document_fallbacks": u["same_document_fallbacks"]}


def _commit(cfg, out: OutputDir, staging: str, final: str, run_id: str, tokens, lowercase, counters, args,
            wall, runner: str = "DirectRunner") -> dict[str, Any]:
    splits: dict[str, Any] = {}
    totals = {"instances": 0, "tokens": 0, "masked_tokens": 0, "random_next": 0}
    shard_stats: dict[str, list] = {}
    for split, n in (("train", cfg.num_shards), ("heldout", cfg.heldout_num_shards)):
        shard_stats[split] = []
        for i in range(n):
            name = shard_name(split, i, n)
            shard, side = f"{staging}/{name}", f"{staging}/{name}.json"
            if out.exists(side):
                st = out.read_json(side)
                if out.size(shard) != st["bytes"]:
                    raise RuntimeError(f"{shard}: size differs from what the writer recorded")
            else:
                st = None  # no rows reached this shard; written below once the build is verified
            shard_stats[split].append((name, shard, side, st))
    rows = {s: sum(st["rows"] for *_, st in v if st) for s, v in shard_stats.items()}
    plan, units = _read_report(out, f"{staging}/report")
    _verify(cfg, runner, plan, units, rows, counters)
    for w in plan.warnings:
        log.warning("%s", w)
    for split, n in (("train", cfg.num_shards), ("heldout", cfg.heldout_num_shards)):
        entries = []
        for name, shard, side, st in shard_stats[split]:
            if st is None:  # a tiny corpus: an empty, valid shard keeps N fixed
                st = _write_empty_shard(shard, len(tokens), cfg)
            else:
                out.delete([side])
            for k in totals:
                totals[k] += st["rows" if k == "instances" else k]
            entries.append({"path": f"{final}/{name}", "rows": st["rows"], "bytes": st["bytes"],
                            "sha256": st["sha256"]})
        rows_ = [e["rows"] for e in entries]
        splits[split] = {"rows": sum(rows_), "documents": plan.documents[split], "num_shards": n,
                         "max_row_difference": max(rows_) - min(rows_), "shards": entries}
    # spilled documents and rows (now in shards), the emptied part dir, the verified reports
    out.delete_dirs([f"{staging}/{d}" for d in ("docs", "parts", "runs", "report") if out.exists(f"{staging}/{d}")])
    out.finish(staging, final)
    nsp_total = totals["instances"] if cfg.objective != "none" else 0
    known = counters is not None
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "records": {
            "max_seq_length": cfg.max_seq_length, "masking": cfg.masking, "objective": cfg.objective,
            "whole_word_mask": cfg.whole_word_mask, "masked_lm_prob": cfg.masked_lm_prob,
            "max_predictions_per_seq": cfg.max_predictions_per_seq,
            "id_dtype": str(record_schema(len(tokens)).field("input_ids").type.value_type),
            "columns": [f.name for f in record_schema(len(tokens))],
        },
        "vocab": {"path": os.path.abspath(cfg.vocab), "sha256": vocab_sha256(cfg.vocab), "size": len(tokens),
                  "lowercase": lowercase},
        "special_token_ids": special_token_ids(tokens),
        "seed": cfg.seed,
        "config": to_dict(cfg),
        "splits": splits,
        # documents, sentences and tokens come from the data (the plan), the rest from the shards;
        # input_words, skips, repairs and metrics only from Beam metrics: null when the runner has none
        "counts": {
            "documents": sum(plan.documents.values()),
            "sentences": sum(plan.sentences.values()),
            "input_tokens": sum(plan.tokens.values()),
            "input_words": counters.get("input_words", 0) if known else None,
            **totals,
            "random_next_fraction": (totals["random_next"] / nsp_total) if nsp_total else None,
            "masked_fraction": (totals["masked_tokens"] / totals["tokens"]) if totals["tokens"] else None,
        },
        # NSP negatives: (document, start sentence) windows of the random-next rows (see data_pipeline.negatives)
        "negatives": ({"train": _negatives(units, "train"), "heldout": _negatives(units, "heldout"),
                       "buckets": {s: len(b) for s, b in plan.buckets.items()}, "bucket_tokens": plan.bucket_tokens}
                      if cfg.objective == "nsp" else None),
        "heldout": {"fraction": cfg.heldout_fraction, "min_documents": cfg.heldout_min_documents,
                    "floor_max_fraction": cfg.heldout_floor_max_fraction, "documents": plan.documents["heldout"],
                    "tokens": plan.tokens["heldout"]},
        "warnings": list(plan.warnings),
        "skips": {k: v for k, v in counters.items() if k.startswith(("skipped_", "truncated_"))} if known else None,
        "repairs": ({k: v for k, v in counters.items()
                     if k.startswith("repaired_") or k == "nsp_same_document_fallbacks"} if known else None),
        "metrics": counters,
        "runner": runner,
        "beam_args": list(args),
        "wall_seconds": round(wall, 3),
    }
    out.write_manifest(manifest, MANIFEST_NAME)  # the commit
    out.remove_other_runs(keep=final)  # older outputs and dead runs' staging dirs are garbage now
    return manifest


def parse_input(spec: str) -> InputConfig:
    """``KIND:PATH`` (kind in wiki|books|text|jsonl) or a bare path whose kind is guessed:
    .xml/.xml.bz2 -> wiki, .jsonl -> jsonl, a directory -> books, anything else -> text."""
    kind, sep, rest = spec.partition(":")
    if sep and kind in ("wiki", "books", "text", "jsonl"):
        return InputConfig(kind=kind, path=rest)
    path = spec
    if ".xml" in os.path.basename(path):
        return InputConfig(kind="wiki", path=path)
    if ".jsonl" in os.path.basename(path):
        return InputConfig(kind="jsonl", path=path)
    if os.path.isdir(path):
        return InputConfig(kind="books", path=path)
    return InputConfig(kind="text", path=path)


def build_records(inputs: Sequence[str], output: str | os.PathLike, vocab: str | os.PathLike, *,
                  in_process: bool = True, pipeline_args: Sequence[str] | None = None, **overrides) -> Path | str:
    """Small-corpus helper for the demo and tests: build records, return the manifest path (a
    ``Path`` for local output, a URL string otherwise).

    ``inputs``: ``KIND:PATH`` strings (see :func:`parse_input`); ``overrides``: DataConfig fields
    (e.g. ``max_seq_length=64, dupe_factor=1, num_shards=2``). ``in_process=True`` runs the
    DirectRunner in this process (no worker start-up cost), fine for a few MB of text.
    """
    data = {"inputs": [to_dict(parse_input(s)) for s in inputs], "output": os.fspath(output),
            "vocab": os.fspath(vocab), **overrides}
    cfg = from_dict(DataConfig, data)
    if pipeline_args is None and in_process:
        pipeline_args = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    run(cfg, pipeline_args)
    out = OutputDir(os.fspath(output))
    return Path(out.url) / MANIFEST_NAME if out.local else out.join(MANIFEST_NAME)
