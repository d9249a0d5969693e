"""The data build's output commit: verify what the pipeline staged, then publish it atomically.

The commit protocol (so a killed run never leaves a manifest pointing at partial shards):
  1. Beam writes every shard and a ``.json`` sidecar into ``<output>/.staging-<run>/``
     (on an object store, straight into ``<output>/shards-<run>/``: see output_dir.py).
  2. After the pipeline finished, the driver checks that every shard is there with its
     recorded size and that the build adds up (:func:`verify`: the plan's documents, the
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
import json
import logging
from typing import Any

from bertdist.config import to_dict
from bertdist.data.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME
from bertdist.data.records import DOCUMENT_LENGTHS, record_schema
from bertdist.redaction import redact_args
from data_pipeline.beam.metrics import NS
from data_pipeline.beam.shards import parquet_writer_options, shard_name
from data_pipeline.build_vocab import BuildVocab
from data_pipeline.config import BuildConfig, source_label
from data_pipeline.instance_batch import InstanceBatch
from data_pipeline.negatives import BuildPlan
from data_pipeline.output_dir import OutputDir
from data_pipeline.packing import PackStats
from data_pipeline.sources import DIRECTORY_SUFFIX, match_file_sizes

log = logging.getLogger("data_pipeline")


def input_sizes(cfg: BuildConfig) -> dict[str, int]:
    """{path: bytes} of every input file."""
    return {path: size for src in cfg.inputs
            for path, size in match_file_sizes(src.path, directory_suffix=DIRECTORY_SUFFIX[src.kind]).items()}


def query_counters(result) -> dict[str, int] | None:
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


class EmptyBuildError(RuntimeError):
    """A build that would commit an empty or unverifiable dataset; the message names the runner."""


def _write_empty_shard(path: str, vocab_size: int, cfg: BuildConfig) -> dict[str, Any]:
    import hashlib
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    table = InstanceBatch.empty("uint16" if vocab_size < 65536 else "uint32", cfg.pack_documents).to_arrow(vocab_size)
    pq.write_table(table, buf, row_group_size=cfg.row_group_size,
                   **parquet_writer_options(table.schema, cfg.compression, cfg.parquet_encoding))
    data = buf.getvalue()
    OutputDir.write_bytes(path, data)
    return {"path": path.rsplit("/", 1)[-1], "rows": 0, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tokens": 0, "masked_tokens": 0, "random_next": 0}


UNIT_COUNTS = ("documents", "sentences", "tokens", "instances", "random_next", "same_document_fallbacks",
               "distinct_windows")


def read_report(out: OutputDir, report: str) -> tuple[BuildPlan | None, dict[str, dict[str, int]]]:
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
        if "packing" in u:  # packed rows: the packing's own counts, reconciled in verify_packing
            acc.setdefault("packing", PackStats()).add(PackStats(**u["packing"]))
    return plan, units


def verify(cfg: BuildConfig, runner: str, plan: BuildPlan | None, units: dict, rows: dict[str, int],
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


def verify_packing(cfg: BuildConfig, plan: BuildPlan, units: dict, shard_tokens: dict[str, int]) -> dict[str, Any]:
    """Packed rows: every document token of the plan is in the rows, once, with two framing tokens
    per piece, and the shards hold exactly the rows' tokens. Returns the manifest's per-split
    packing counts; EmptyBuildError (nothing committed) when anything does not add up."""
    out = {}
    for split in ("train", "heldout"):
        st = units[split].get("packing") or PackStats()
        try:
            st.check(cfg.max_seq_length)
        except ValueError as e:
            raise EmptyBuildError(f"{split}: {e}. Nothing was committed.") from None
        if st.document_tokens != plan.tokens[split] or st.row_tokens != shard_tokens[split] or \
                st.documents != plan.documents[split]:
            raise EmptyBuildError(
                f"{split}: the plan counted {plan.documents[split]:,} documents of {plan.tokens[split]:,} tokens; the "
                f"packing took {st.documents:,} documents of {st.document_tokens:,} tokens into {st.row_tokens:,} row "
                f"tokens; the shards hold {shard_tokens[split]:,} tokens: tokens were lost. Nothing was committed.")
        out[split] = {**st.to_json(), "fill": round(st.row_tokens / (st.rows * cfg.max_seq_length), 4) if st.rows
                      else None}
    return out


REMOVED_PAIRS_NAME = "dedup_removed_pairs.jsonl"
DEDUP_COUNTS = ("exact_documents_removed", "exact_words_removed", "exact_clusters", "near_documents_removed",
                "near_words_removed", "near_clusters", "cross_source_documents_removed")


def _per_source(counters: dict[str, int], kind: str) -> dict[str, dict[str, int]]:
    """Counters ``<kind>:<source>:<what>`` -> {source: {what: n}}."""
    out: dict[str, dict[str, int]] = {}
    for name, v in counters.items():
        k, _, rest = name.partition(":")
        if k == kind and ":" in rest:
            source, _, what = rest.partition(":")
            out.setdefault(source, {})[what] = v
    return out


def _report_files(out: OutputDir, folder: str) -> list[dict]:
    from apache_beam.io.filesystems import FileSystems

    if not out.exists(folder):
        return []
    paths = sorted(m.path for r in FileSystems.match([f"{folder}/*.json"]) for m in r.metadata_list)
    return [out.read_json(p) for p in paths]


def cleaning_sections(cfg: BuildConfig, out: OutputDir, staging: str, final: str, counters: dict | None
                      ) -> dict[str, Any]:
    """The manifest's "encodings", "quality" and "dedup" sections, from the counters and the
    examples the build wrote under ``<staging>/report``; writes the sample of removed duplicate
    pairs into the run's folder (``REMOVED_PAIRS_NAME``, one JSON object a line). Counts are
    null when the runner reports no metrics."""
    from data_pipeline.dedup import bands_and_rows

    known = counters is not None
    dropped = _per_source(counters, "filtered") if known else {}
    dropped_words = _per_source(counters, "filtered_words") if known else {}
    removed = _per_source(counters, "dedup") if known else {}
    examples: dict[str, dict[str, list]] = {}
    for f in _report_files(out, f"{staging}/report/quality"):
        examples.setdefault(f["source"], {})[f["rule"]] = f["examples"]
    pairs = [row for f in _report_files(out, f"{staging}/report/dedup") for row in f["pairs"]]
    if pairs:
        out.write_bytes(f"{staging}/{REMOVED_PAIRS_NAME}",
                        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pairs).encode("utf-8"))
    quality, dedup = {}, {}
    group_of = {i: g for g in cfg.dedup_groups() for i in g}
    for i, src in enumerate(cfg.inputs):
        name = source_label(i, src)
        q, d = cfg.source_quality(i), cfg.source_dedup(i)
        quality[name] = {"path": src.path, "enabled": q.enabled,
                         "documents_dropped": dict(sorted(dropped.get(name, {}).items())) if known else None,
                         "words_dropped": dict(sorted(dropped_words.get(name, {}).items())) if known else None,
                         "examples": examples.get(name, {})}
        bands, rows = bands_and_rows(d.threshold, d.num_perm)
        dedup[name] = {"path": src.path, "enabled": d.enabled, "near": d.near, "threshold": d.threshold,
                       "ngram": d.ngram, "bands": bands, "rows": rows,
                       "deduplicated_with": [source_label(j, cfg.inputs[j]) for j in group_of.get(i, [])],
                       **({k: removed.get(name, {}).get(k, 0) for k in DEDUP_COUNTS} if known
                          else dict.fromkeys(DEDUP_COUNTS))}
    encodings = ({k[len("decoded_"):]: v for k, v in counters.items() if k.startswith("decoded_")} if known else None)
    return {"encodings": encodings, "quality": quality,
            "dedup": {"sources": dedup,
                      "cross_source_documents_removed": (sum(d["cross_source_documents_removed"] for d in dedup.values())
                                                         if known else None),
                      "removed_pairs_sample": f"{final}/{REMOVED_PAIRS_NAME}" if pairs else None}}


def _negatives(units: dict, split: str) -> dict[str, Any]:
    u = units[split]
    return {"random_next": u["random_next"], "distinct_windows": u["distinct_windows"],
            "distinct_fraction": round(u["distinct_windows"] / u["random_next"], 4) if u["random_next"] else None,
            "max_window_reuse": u["max_window_reuse"], "same_document_fallbacks": u["same_document_fallbacks"]}


def commit(cfg, out: OutputDir, staging: str, final: str, run_id: str, vocab: BuildVocab, counters, args,
           wall, runner: str = "DirectRunner") -> dict[str, Any]:
    """Verify the staged shards against the build's own reports, move them to ``final`` and write
    the manifest (the commit, step 2 above); returns the manifest. Raises EmptyBuildError, and
    commits nothing, when the output is empty or does not add up."""
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
    plan, units = read_report(out, f"{staging}/report")
    verify(cfg, runner, plan, units, rows, counters)
    packing = (verify_packing(cfg, plan, units, {s: sum(st["tokens"] for *_, st in v if st) for s, v in shard_stats.items()})
               if cfg.pack_documents else None)
    cleaning = cleaning_sections(cfg, out, staging, final, counters)
    for w in plan.warnings:
        log.warning("%s", w)
    for split, n in (("train", cfg.num_shards), ("heldout", cfg.heldout_num_shards)):
        entries = []
        for name, shard, side, st in shard_stats[split]:
            if st is None:  # a tiny corpus: an empty, valid shard keeps N fixed
                st = _write_empty_shard(shard, vocab.size, cfg)
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
    schema = record_schema(vocab.size, cfg.pack_documents)
    manifest = {
        "format": FORMAT_NAME,
        # a reader of version 1 would misread packed rows or a tokenizer.json: it refuses them
        "format_version": FORMAT_VERSION if cfg.pack_documents or vocab.tokenizer is not None else 1,
        "run_id": run_id,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "records": {
            "max_seq_length": cfg.max_seq_length, "masking": cfg.masking, "objective": cfg.objective,
            # masking_mode is the setting; whole_word_mask (masking_mode == whole_word) stays for
            # readers that know only it
            "masking_mode": cfg.resolved_masking_mode, "whole_word_mask": cfg.resolved_masking_mode == "whole_word",
            "mask_replace_prob": cfg.mask_replace_prob, "random_replace_prob": cfg.random_replace_prob,
            "masked_lm_prob": cfg.masked_lm_prob, "max_predictions_per_seq": cfg.resolved_max_predictions,
            "id_dtype": str(schema.field("input_ids").type.value_type),
            "columns": [f.name for f in schema],
            **({"packing": {"documents": True, "column": DOCUMENT_LENGTHS, "framing": "[CLS] document [SEP]",
                            "algorithm": "best_fit_decreasing", "group_tokens": cfg.pack_group_tokens,
                            "attention": "within each document"}} if cfg.pack_documents else {}),
        },
        "vocab": vocab.manifest_vocab(),
        "special_token_ids": dict(vocab.special),
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
            # packed rows, per split: documents and their tokens in; pieces, rows, tokens out (the
            # document tokens + 2 per piece, checked against the plan and the shards) and padding
            **({"packing": packing} if packing is not None else {}),
        },
        # NSP negatives: (document, start sentence) windows of the random-next rows (see data_pipeline.negatives)
        "negatives": ({"train": _negatives(units, "train"), "heldout": _negatives(units, "heldout"),
                       "buckets": {s: len(b) for s, b in plan.buckets.items()}, "bucket_tokens": plan.bucket_tokens}
                      if cfg.objective == "nsp" else None),
        "heldout": {"fraction": cfg.heldout_fraction, "min_documents": cfg.heldout_min_documents,
                    "floor_max_fraction": cfg.heldout_floor_max_fraction, "documents": plan.documents["heldout"],
                    "tokens": plan.tokens["heldout"]},
        "warnings": list(plan.warnings),
        # per source: documents decoded from each encoding, dropped by each quality rule, and
        # removed as duplicates (a sample of the removed pairs is in the run's folder)
        **cleaning,
        "skips": {k: v for k, v in counters.items() if k.startswith(("skipped_", "truncated_"))} if known else None,
        "repairs": ({k: v for k, v in counters.items()
                     if k.startswith("repaired_") or k == "nsp_same_document_fallbacks"} if known else None),
        "metrics": counters,
        "runner": runner,
        "beam_args": redact_args(args),  # credentials' values never reach a manifest
        "wall_seconds": round(wall, 3),
    }
    previous = out.current_shards(MANIFEST_NAME)
    out.write_manifest(manifest, MANIFEST_NAME)  # the commit
    # older outputs and dead runs' staging dirs are garbage now; the replaced manifest's shards
    # stay one more build for the trainers still reading them
    out.remove_other_runs(keep=final, previous=previous)
    return manifest
