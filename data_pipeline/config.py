"""Schema of the data pipeline's config (``configs/data/*.yaml`` are instances of it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

SourceKind = Literal["wiki", "books", "text", "jsonl"]
InstanceBuilder = Literal["auto", "native", "reference"]
INSTANCE_BUILDERS = get_args(InstanceBuilder)
ParquetEncoding = Literal["dictionary", "byte_stream_split"]
PARQUET_ENCODINGS = get_args(ParquetEncoding)


@dataclass
class InputConfig:
    """One source. ``path`` is a file, directory (books), or glob on any Beam filesystem."""

    kind: SourceKind
    path: str
    text_field: str = "text"  # jsonl only
    id_field: str = ""  # jsonl only; "" = use file name + line number


@dataclass
class BuildConfig:
    inputs: list[InputConfig] = field(default_factory=list)
    output: str = ""
    vocab: str = ""
    # None = infer from the vocab (a vocab with upper-case word pieces is cased)
    lowercase: Optional[bool] = None
    seed: int = 12345
    # --- instances (google-research/bert create_pretraining_data.py semantics) ---
    max_seq_length: int = 128
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    objective: Literal["nsp", "sop", "none"] = "nsp"
    nsp_random_prob: float = 0.5
    masking: Literal["static", "dynamic"] = "static"
    masked_lm_prob: float = 0.15
    max_predictions_per_seq: int = 20
    whole_word_mask: bool = False
    # An NSP negative comes from the document's bucket: documents grouped by hash into buckets of
    # about this many tokens (4.2 M: about 5,000 Wikipedia articles or 40 books; a small corpus is
    # one bucket per split, so there the choice is corpus-wide). A worker holds up to two buckets:
    # about 2 bytes per token (4 with a vocab over 65,536 tokens) plus 16 per sentence
    nsp_bucket_tokens: int = 1 << 22
    # who builds the instances: "native" (C++, data_pipeline._native_instances; bitwise the same
    # output) or the Python "reference"; "auto" takes native when it is built, "native" is an
    # error when it is not
    instance_builder: InstanceBuilder = "auto"
    # --- documents ---
    min_sentences: int = 2  # for nsp/sop; shorter documents are skipped and counted
    max_document_chars: int = 50_000_000  # larger documents are truncated (counted)
    max_document_sentences: int = 20_000  # larger documents are split into parts (counted)
    max_sentence_chars: int = 20_000  # longer "sentences" are cut at whitespace (counted)
    # --- output ---
    heldout_fraction: float = 0.01
    # with heldout_fraction > 0: at least this many held-out documents (at most half of them), so
    # that held-out NSP negatives come from many other held-out documents; the floor is not
    # applied when it would hold out more than heldout_floor_max_fraction of the tokens (a few
    # long books); fewer held-out documents than this is a warning
    heldout_min_documents: int = 20
    heldout_floor_max_fraction: float = 0.25
    num_shards: int = 8
    heldout_num_shards: int = 1
    row_group_size: int = 2048
    # a worker's memory bounds (rows, not bytes; see data_pipeline.sharding): rows it buffers
    # before spilling them to a run file, and rows it sorts at once when cutting shards
    shuffle_spill_rows: int = 32768
    shuffle_bucket_rows: int = 16384
    compression: str = "zstd"
    # how the shards' integer columns are encoded: "dictionary" is Parquet's default, which every
    # reader knows. "byte_stream_split" (no dictionary) made the 10 MB benchmark build about 8%
    # faster on one core and its shards 12% smaller (README), but needs a reader that implements BYTE_STREAM_SPLIT
    # for integer columns (Parquet format PARQUET-2414, 2024; merged into Arrow C++ in February
    # 2024 as apache/arrow GH-39978); older readers may reject the shards
    parquet_encoding: ParquetEncoding = "dictionary"

    def __post_init__(self):
        # from_dict checks the Literal fields; this also catches a BuildConfig built in code
        for name, allowed in (("instance_builder", INSTANCE_BUILDERS), ("parquet_encoding", PARQUET_ENCODINGS)):
            if getattr(self, name) not in allowed:
                from bertdist.config import ConfigError

                raise ConfigError(f"{name}: {getattr(self, name)!r} is not one of {list(allowed)}")
