"""``run()``: wire sources -> sentences -> tokens -> instances -> shards, then hand the staged
output to :func:`data_pipeline.commit.commit` (verify, then commit atomically)."""
from __future__ import annotations

import dataclasses
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
from bertdist.data.manifest import MANIFEST_NAME
from bertdist.data.masking import default_max_predictions
from bertdist.redaction import redact_args
from data_pipeline.build_vocab import BuildVocab
from data_pipeline.config import BuildConfig, InputConfig, source_label
from data_pipeline.instance_algorithm import InstanceParams, expected_instances
from data_pipeline.instance_native import choose_builder
from data_pipeline.negatives import slot_bits
from data_pipeline.output_dir import OutputDir
from data_pipeline.beam.instance_transform import CreateInstances
from data_pipeline.beam.dedup import Deduplicate
from data_pipeline.beam.filters import FilterQuality
from data_pipeline.beam.read import ReadBertFormatText, ReadBooks, ReadJsonLines, ReadWikipediaDump
from data_pipeline.beam.shards import SplitShards, WriteShards
from data_pipeline.beam.tokenize import SplitLines, SplitSentences, Tokenize
from data_pipeline.commit import commit, query_counters
from data_pipeline.sources import DIRECTORY_SUFFIX, match_file_sizes

log = logging.getLogger("data_pipeline")


def default_pipeline_args() -> list[str]:
    """DirectRunner, multi-processing on every local core (named explicitly: the default
    Prism runner downloads a binary, which is not possible here)."""
    return ["--runner=DirectRunner", "--direct_running_mode=multi_processing",
            f"--direct_num_workers={os.cpu_count() or 1}"]


def read_source(p: beam.Pipeline, i: int, src: InputConfig, cfg: BuildConfig, report_dir: str | None = None):
    """One input -> (doc_id, text): read and quality-filtered (dedup is
    :func:`deduplicate`'s, over groups of sources)."""
    label = f"Read{i}_{src.kind}"
    if src.kind == "wiki":
        docs = p | label >> ReadWikipediaDump(src.path)
    elif src.kind == "books":
        docs = p | label >> ReadBooks(src.path, cfg.max_document_chars)
    elif src.kind == "jsonl":
        docs = p | label >> ReadJsonLines(src.path, src.text_field, src.id_field)
    elif src.kind == "text":
        docs = p | label >> ReadBertFormatText(src.path)
    else:
        raise ValueError(f"unknown source kind {src.kind!r}")
    return docs | f"Quality{i}" >> FilterQuality(source_label(i, src), cfg.source_quality(i), report_dir)


def deduplicate(docs: list, cfg: BuildConfig, report_dir: str | None = None) -> list:
    """Per source's documents -> the same without duplicates: one Deduplicate per group of
    sources with the same dedup settings (BuildConfig.dedup_groups), across the group's sources."""
    docs = list(docs)
    for group in cfg.dedup_groups():
        names = [source_label(i, cfg.inputs[i]) for i in group]
        kept = tuple(docs[i] for i in group) | f"Dedup{group[0]}" >> Deduplicate(
            names, cfg.source_dedup(group[0]), report_dir, [cfg.source_dedup(i).sample_pairs for i in group])
        for i, pc in zip(group, kept):
            docs[i] = pc
    return docs


# Beam infers each transform's output type from its code (bytecode analysis of every lambda and
# DoFn) while a pipeline is built, to check the types of user pipelines. This pipeline is fixed
# and its tests run it on every runner we support, so the check finds nothing here; it cost
# 0.11 s (418 inferences) of a 3.1 s one-core build of the 10 MB benchmark input.
NO_TYPE_CHECK = "--no_pipeline_type_check"


def with_build_defaults(args: Sequence[str]) -> list[str]:
    """The Beam args a build runs with: the caller's, plus :data:`NO_TYPE_CHECK`."""
    args = list(args)
    return args if NO_TYPE_CHECK in args else [*args, NO_TYPE_CHECK]


def instance_params(cfg: BuildConfig, vocab: BuildVocab | list[str]) -> InstanceParams:
    """``vocab``: the build's vocabulary (a vocab.txt's tokens will do)."""
    if not isinstance(vocab, BuildVocab):
        vocab = BuildVocab.from_tokens(vocab)
    sp = vocab.special
    return InstanceParams(
        max_seq_length=cfg.max_seq_length, short_seq_prob=cfg.short_seq_prob, objective=cfg.objective,
        nsp_random_prob=cfg.nsp_random_prob, masking=cfg.masking, masked_lm_prob=cfg.masked_lm_prob,
        max_predictions_per_seq=cfg.resolved_max_predictions,
        whole_word_mask=cfg.resolved_masking_mode == "whole_word", masking_mode=cfg.resolved_masking_mode,
        mask_replace_prob=cfg.mask_replace_prob, random_replace_prob=cfg.random_replace_prob,
        cls_id=sp["cls"], sep_id=sp["sep"], mask_id=sp["mask"], vocab_size=vocab.size,
    )


def validate(cfg: BuildConfig) -> None:
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
    if cfg.max_predictions_per_seq is not None and cfg.max_predictions_per_seq < 0:
        raise ConfigError(f"max_predictions_per_seq {cfg.max_predictions_per_seq} must be >= 0 (or unset: "
                          f"ceil(masked_lm_prob x max_seq_length) = "
                          f"{default_max_predictions(cfg.masked_lm_prob, cfg.max_seq_length)})")
    if cfg.pack_documents:
        validate_packing(cfg)
    validate_vocab(cfg)
    if cfg.heldout_min_documents < 0:
        raise ConfigError(f"heldout_min_documents {cfg.heldout_min_documents} must be >= 0")
    if not 0.0 <= cfg.heldout_floor_max_fraction <= 1.0:
        raise ConfigError(f"heldout_floor_max_fraction {cfg.heldout_floor_max_fraction} must be in [0, 1]")


def validate_packing(cfg: BuildConfig) -> None:
    from bertdist.config import ConfigError

    wrong = {k: v for k, v in (("objective", cfg.objective), ("masking", cfg.masking), ("dupe_factor", cfg.dupe_factor))
             if v != {"objective": "none", "masking": "dynamic", "dupe_factor": 1}[k]}
    if wrong:
        raise ConfigError(f"pack_documents: true builds MLM-only rows masked by the trainer's loader, so it needs "
                          f"objective: none, masking: dynamic and dupe_factor: 1 (train more epochs instead of dupes); "
                          f"got {', '.join(f'{k}: {v}' for k, v in wrong.items())}")
    if cfg.pack_group_tokens < cfg.max_seq_length:
        raise ConfigError(f"pack_group_tokens {cfg.pack_group_tokens} must be at least max_seq_length "
                          f"{cfg.max_seq_length} (a group packs many rows' worth of documents)")


def validate_vocab(cfg: BuildConfig) -> None:
    """A tokenizer.json must name its five special tokens, leave the case to its normalizer, and
    mark word pieces for whole-word or span masking (``bertdist.data.tokenizer_file``)."""
    from bertdist.config import ConfigError
    from bertdist.data.tokenizer_file import is_tokenizer_json, load_tokenizer_file, require_continuation

    if not is_tokenizer_json(cfg.vocab):
        return
    tf = load_tokenizer_file(cfg.vocab)
    if cfg.lowercase is not None:
        raise ConfigError(f"lowercase: {cfg.lowercase} with the tokenizer {cfg.vocab}: a tokenizer.json's own "
                          "normalizer decides the case; leave lowercase unset")
    require_continuation(tf, cfg.resolved_masking_mode)


TOKENS_PER_TEXT_BYTE = 0.24  # WordPiece tokens per byte of English prose (about 1.3 per 5.5-byte word)


def expected_tokens(cfg: BuildConfig) -> int:
    """Rough token count from the input sizes, made before the run: it only sizes the shuffle
    buckets and the spill files' slots (memory and reads), never the output."""
    tokens = 0.0
    for src in cfg.inputs:
        for path, size in match_file_sizes(src.path, directory_suffix=DIRECTORY_SUFFIX[src.kind]).items():
            expand = 4.0 if path.endswith((".bz2", ".gz")) else 1.0  # typical text compression
            prose = 0.5 if src.kind == "wiki" else 1.0  # about half of a dump is markup
            tokens += size * expand * prose * TOKENS_PER_TEXT_BYTE
    return int(tokens)


def expected_rows(cfg: BuildConfig) -> int:
    """Rough row count from the input sizes (see :func:`expected_tokens`)."""
    return expected_instances(expected_tokens(cfg), cfg.dupe_factor, cfg.max_seq_length)


def work_units(options: PipelineOptions) -> int:
    """How many instance work units to aim for: four per local worker on the DirectRunner (more
    only adds per-unit costs there), 32 on other runners, whose worker count is not known here."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    runner = str(options.view_as(StandardOptions).runner or "DirectRunner")
    if runner.rsplit(".", 1)[-1] == "DirectRunner":
        return 4 * max(1, options.view_as(DirectOptions).direct_num_workers or 1)
    return 32


def build_pipeline(p: beam.Pipeline, cfg: BuildConfig, staging: str, vocab: BuildVocab) -> None:
    docs = deduplicate([read_source(p, i, src, cfg, f"{staging}/report") for i, src in enumerate(cfg.inputs)],
                       cfg, f"{staging}/report")
    docs = [d | f"Lines{i}" >> SplitLines() if src.kind == "text" else d | f"Sentences{i}" >> SplitSentences()
            for i, (d, src) in enumerate(zip(docs, cfg.inputs))]
    sentences = docs[0] if len(docs) == 1 else tuple(docs) | "AllSources" >> beam.Flatten()
    min_sents = cfg.min_sentences if cfg.objective != "none" else 1
    tokenized = sentences | "Tokenize" >> Tokenize(
        cfg.vocab, vocab.lowercase, min_sentences=min_sents, max_document_sentences=cfg.max_document_sentences,
        max_sentence_chars=cfg.max_sentence_chars)
    frac = cfg.heldout_fraction
    rows = expected_rows(cfg)
    # one branch for both splits, keyed by split: a document's split comes from a hash of its id
    built = tokenized | "Instances" >> CreateInstances(
        instance_params(cfg, vocab), seed=cfg.seed, dupe_factor=cfg.dupe_factor, vocab_path=cfg.vocab,
        scratch_dir=f"{staging}/docs", report_dir=f"{staging}/report", heldout_fraction=frac,
        heldout_min_documents=cfg.heldout_min_documents, heldout_floor_max_fraction=cfg.heldout_floor_max_fraction,
        bucket_tokens=cfg.nsp_bucket_tokens,
        slot_bits=slot_bits(expected_tokens(cfg), cfg.nsp_bucket_tokens), target_units=work_units(p.options),
        builder=cfg.instance_builder, pack_group_tokens=cfg.pack_group_tokens if cfg.pack_documents else None)
    built["instances"] | "Write" >> WriteShards(
        staging, {"train": SplitShards(cfg.num_shards, round(rows * (1 - frac))),
                  "heldout": SplitShards(cfg.heldout_num_shards, round(rows * frac))},
        vocab.size, cfg.row_group_size, cfg.compression, rows_per_bucket=cfg.shuffle_bucket_rows,
        spill_rows=cfg.shuffle_spill_rows, encoding=cfg.parquet_encoding, expected_rows=built["expected_rows"])


def runner_name(options: PipelineOptions) -> str:
    from apache_beam.options.pipeline_options import StandardOptions

    return str(options.view_as(StandardOptions).runner or "DirectRunner")


def local_runner(options: PipelineOptions):
    """For a DirectRunner build, the runner that Beam's DirectRunner ends up with for this batch
    pipeline: the FnApiRunner, given the pipeline options for its workers, as the DirectRunner
    makes it. None for any other runner (Beam makes it from ``--runner``).

    Why not the DirectRunner itself: it first tries the Prism runner, a Go binary it downloads at
    first use. Offline the attempt fails, after 0.1 s of a 2.8 s one-core build of the 10 MB
    benchmark input and with a gRPC worker pool left running; online the build would run on a
    runner that the tests never ran."""
    if runner_name(options).rsplit(".", 1)[-1] not in ("DirectRunner", "SwitchingDirectRunner"):
        return None
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(
        beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)))


def run(cfg: BuildConfig, pipeline_args: Sequence[str] | None = None) -> dict[str, Any]:
    """Build the records described by ``cfg``; returns the manifest (also written to disk).

    ``pipeline_args`` are Beam options (``--runner=...`` etc.); None = :func:`default_pipeline_args`.
    Raises :class:`EmptyBuildError` instead of committing when no row was written, or when the
    runner's output does not add up (see :func:`_verify`).
    """
    validate(cfg)
    t0 = time.time()
    vocab = BuildVocab.load(cfg.vocab, cfg.lowercase)
    out = OutputDir(cfg.output)
    run_id = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    # an impossible instance_builder=native fails here, before any work, not on every worker
    builder, why = choose_builder(cfg.instance_builder)
    log.info("training instances: %s builder (%s)", builder, why)  # every run; workers log once per process
    staging, final = out.prepare(run_id)
    try:
        # workers read a copy of the vocab beside the output, never the launcher's path
        worker_cfg = dataclasses.replace(cfg, vocab=out.stage_vocab(cfg.vocab, run_id))
        args = with_build_defaults(default_pipeline_args() if pipeline_args is None else pipeline_args)
        options = PipelineOptions(args)
        log.info("data build: %d input(s) -> %s (run %s), Beam args %s", len(cfg.inputs), out.url, run_id,
                 redact_args(args))
        p = beam.Pipeline(runner=local_runner(options), options=options)
        build_pipeline(p, worker_cfg, staging, vocab)
        result = p.run()
        result.wait_until_finish()
        counters = query_counters(result)
        return commit(cfg, out, staging, final, run_id, vocab, counters, args, time.time() - t0,
                      runner=runner_name(options))
    except BaseException:
        # A failed build leaves nothing of its own behind (a killed process cannot clean up:
        # the next successful build removes what it left, as it is marked as a build's).
        out.discard_run(run_id, final, MANIFEST_NAME)
        raise


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

    ``inputs``: ``KIND:PATH`` strings (see :func:`parse_input`); ``overrides``: BuildConfig fields
    (e.g. ``max_seq_length=64, dupe_factor=1, num_shards=2``). ``in_process=True`` runs the
    DirectRunner in this process (no worker start-up cost), fine for a few MB of text.
    """
    data = {"inputs": [to_dict(parse_input(s)) for s in inputs], "output": os.fspath(output),
            "vocab": os.fspath(vocab), **overrides}
    cfg = from_dict(BuildConfig, data)
    if pipeline_args is None and in_process:
        pipeline_args = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    run(cfg, pipeline_args)
    out = OutputDir(os.fspath(output))
    return Path(out.url) / MANIFEST_NAME if out.local else out.join(MANIFEST_NAME)
