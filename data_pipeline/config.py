"""Schema of the data pipeline's config (``configs/data/*.yaml`` are instances of it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

SourceKind = Literal["wiki", "books", "text", "jsonl"]
InstanceBuilder = Literal["auto", "native", "reference"]
INSTANCE_BUILDERS = get_args(InstanceBuilder)
ParquetEncoding = Literal["dictionary", "byte_stream_split"]
PARQUET_ENCODINGS = get_args(ParquetEncoding)
MaskingMode = Literal["token", "whole_word", "span"]


@dataclass
class QualityConfig:
    """Document quality rules (data_pipeline.quality; Gopher and C4 style). A document failing
    one is dropped and counted (manifest "quality": per source and rule, with a few examples).
    The defaults keep every Wikipedia article and book in ../shared/data, as text and as BERT
    format (a sentence a line), whose extremes are: 54 words, letters 0.85 of non-space
    characters, mean word length 4.2-6.5, 0.005 symbols per word, repeated lines 34% (Hamlet a
    sentence a line: its speakers' names) holding 3.6% of the characters, repeated paragraphs 6.3%."""

    enabled: bool = True
    min_words: int = 50
    max_replacement_fraction: float = 0.001  # U+FFFD per character
    max_control_fraction: float = 0.001  # control characters (not tab, newline) per character
    min_letter_fraction: float = 0.5  # letters per non-whitespace character
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # "#", "...", "|", bullets per word
    max_duplicate_line_fraction: float = 0.5  # Gopher's 0.3 drops Shakespeare's plays a sentence a line
    max_duplicate_line_char_fraction: float = 0.2
    max_duplicate_paragraph_fraction: float = 0.3
    max_duplicate_paragraph_char_fraction: float = 0.2


@dataclass
class DedupConfig:
    """Duplicate removal before instances are made (data_pipeline.dedup): exact duplicates by a
    hash of the normalized text, near-duplicates by MinHash over word n-grams with LSH banding.
    It runs once over every group of sources with the same settings (see :func:`dedup_groups`),
    so a duplicate across two sources is caught too. One document of each cluster is kept: the
    one of the earliest-listed source, then the smallest document id, so the output does not
    depend on input order or worker count."""

    enabled: bool = True
    near: bool = True  # False: exact duplicates only
    threshold: float = 0.8  # Jaccard similarity of word n-gram sets above which two documents are duplicates
    ngram: int = 5
    num_perm: int = 128  # MinHash signature length (one-permutation bins); LSH bands x rows come from it and threshold
    seed: int = 1
    # a bucket larger than this (many documents sharing one band) compares each document with this
    # many neighbours in hash order, not with all: linear work in a bucket of boilerplate copies
    max_bucket_comparisons: int = 64
    sample_pairs: int = 50  # removed (kept, dropped) pairs per source written beside the manifest


def dedup_group_key(d: DedupConfig) -> tuple:
    """What two sources must share to be deduplicated together: everything that decides whether
    two documents are duplicates (``sample_pairs`` only sizes a report)."""
    if not d.near:
        return (False,)
    return (True, d.threshold, d.ngram, d.num_perm, d.seed, d.max_bucket_comparisons)


@dataclass
class InputConfig:
    """One source. ``path`` is a file, directory (books), or glob on any Beam filesystem.
    ``quality`` and ``dedup`` override the build's sections for this source (None: the build's)."""

    kind: SourceKind
    path: str
    text_field: str = "text"  # jsonl only
    id_field: str = ""  # jsonl only; "" = use file name + line number
    quality: Optional[QualityConfig] = None
    dedup: Optional[DedupConfig] = None


def source_label(i: int, src: InputConfig) -> str:
    """A source's name in counters, the manifest and the report files: its index and kind."""
    return f"{i}-{src.kind}"


@dataclass
class BuildConfig:
    inputs: list[InputConfig] = field(default_factory=list)
    output: str = ""
    # a WordPiece vocab.txt (BERT's tokenizer, id = line number), or a Hugging Face tokenizer.json
    # (any model: ModernBERT's BPE, ...; its special tokens are read from it and from a
    # tokenizer_config.json beside it, see bertdist/data/tokenizer_file.py)
    vocab: str = ""
    # None = infer from the vocab (a vocab with upper-case word pieces is cased); a tokenizer.json's
    # own normalizer decides, so it must stay None there
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
    # the most masked positions a row may have. None: ceil(masked_lm_prob x max_seq_length), so the
    # rate holds at every length (20 at 0.15 x 128, BERT's; 2,458 at 0.30 x 8,192)
    max_predictions_per_seq: Optional[int] = None
    # which positions are masked: "token" (BERT), "whole_word" (all pieces of a word together) or
    # "span" (SpanBERT: spans of whole words; bertdist/data/masking.py has the rules). None: from
    # whole_word_mask, the older setting (true is whole_word, false or unset token); both set and
    # meaning different modes is an error
    masking_mode: Optional[MaskingMode] = None
    whole_word_mask: Optional[bool] = None  # the older setting: true is masking_mode whole_word, false token
    # a masked position becomes [MASK] with mask_replace_prob, a random token with
    # random_replace_prob and stays itself otherwise (BERT: 0.8 / 0.1; 1.0 / 0.0 is all [MASK])
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1  # mask_replace_prob + random_replace_prob <= 1
    # An NSP negative comes from the document's bucket: documents grouped by hash into buckets of
    # about this many tokens (4.2 M: about 5,000 Wikipedia articles or 40 books; a small corpus is
    # one bucket per split, so there the choice is corpus-wide). A worker holds up to two buckets:
    # about 2 bytes per token (4 with a vocab over 65,536 tokens) plus 16 per sentence
    nsp_bucket_tokens: int = 1 << 22
    # who builds the instances: "native" (C++, data_pipeline._native_instances; bitwise the same
    # output) or the Python "reference"; "auto" takes native when it is built, "native" is an
    # error when it is not
    instance_builder: InstanceBuilder = "auto"
    # --- packed rows (MLM only, for encoders that attend within each document: ModernBERT) ---
    # true: whole documents, each framed [CLS] ... [SEP], packed greedily (best fit, longest
    # first) into rows of max_seq_length tokens; a document longer than a row is cut into
    # row-sized pieces. The rows record their documents' lengths (column document_lengths), the
    # manifest records.packing. Needs objective: none, masking: dynamic and dupe_factor: 1;
    # short_seq_prob is not used
    pack_documents: bool = False
    # documents are packed within groups of about this many tokens (fixed hash ranges of the
    # corpus, the same on any runner and worker count); a larger group packs a little tighter
    pack_group_tokens: int = 1 << 20
    # --- documents ---
    # defaults for every source (an input's own section replaces them for that input)
    quality: QualityConfig = field(default_factory=QualityConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
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
    # faster on one core and its shards 12% smaller in one measurement, but needs a reader that implements BYTE_STREAM_SPLIT
    # for integer columns (Parquet format PARQUET-2414, 2024; merged into Arrow C++ in February
    # 2024 as apache/arrow GH-39978); older readers may reject the shards
    parquet_encoding: ParquetEncoding = "dictionary"

    def source_quality(self, i: int) -> QualityConfig:
        return self.inputs[i].quality or self.quality

    def source_dedup(self, i: int) -> DedupConfig:
        return self.inputs[i].dedup or self.dedup

    def dedup_groups(self) -> list[list[int]]:
        """The sources deduplicated together, as lists of input indices in listed order, the
        groups ordered by their first source: one group per distinct :func:`dedup_group_key`
        among the sources with dedup enabled (a source with ``dedup.enabled: false`` is in none).
        With the defaults every source is in one group, so an article repeated in a book is
        caught; a source with its own threshold, n-gram, signature length, seed or bucket limit
        (or exact-only, ``near: false``) is deduplicated only with the sources that share them."""
        groups: dict[tuple, list[int]] = {}
        for i in range(len(self.inputs)):
            d = self.source_dedup(i)
            if d.enabled:
                groups.setdefault(dedup_group_key(d), []).append(i)
        return list(groups.values())

    @property
    def resolved_max_predictions(self) -> int:
        """max_predictions_per_seq, or ceil(masked_lm_prob x max_seq_length) when unset."""
        from bertdist.data.masking import default_max_predictions

        if self.max_predictions_per_seq is not None:
            return self.max_predictions_per_seq
        return default_max_predictions(self.masked_lm_prob, self.max_seq_length)

    @property
    def resolved_masking_mode(self) -> str:
        """token, whole_word or span, from masking_mode and whole_word_mask (checked to agree)."""
        from bertdist.data.masking import resolve_masking_mode

        return resolve_masking_mode(self.masking_mode, self.whole_word_mask) or "token"

    def __post_init__(self):
        from bertdist.config import ConfigError
        from bertdist.data.masking import check_replace_probs

        # from_dict checks the Literal fields; this also catches a BuildConfig built in code
        for name, allowed in (("instance_builder", INSTANCE_BUILDERS), ("parquet_encoding", PARQUET_ENCODINGS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not one of {list(allowed)}")
        try:
            _ = self.resolved_masking_mode
            check_replace_probs(self.mask_replace_prob, self.random_replace_prob)
        except ValueError as e:
            raise ConfigError(str(e)) from None
