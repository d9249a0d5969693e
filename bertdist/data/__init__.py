"""Training records: the contract between the Beam data pipeline and the trainer.

The pipeline (``data_pipeline/``) writes Parquet shards plus ``manifest.json``; the trainer
reads them through :func:`open_records`, which verifies the manifest before serving rows.

Record columns (one row per training instance, no padding stored):
  - ``input_ids``: list<uint16> (uint32 when the vocab has >= 65,536 entries):
    ``[CLS] A [SEP] B [SEP]`` or ``[CLS] A [SEP]``. With static masking the masked positions
    already hold [MASK] / random / kept ids.
  - ``num_a_tokens``: uint16, length of ``[CLS] A [SEP]``; token_type_ids are 0 for the first
    ``num_a_tokens`` positions and 1 after.
  - ``next_sentence_label``: int8, 0 = B follows A (SOP: in order), 1 = random B (SOP: swapped),
    -1 = no second objective.
  - ``masked_lm_positions``: list<uint16>, ``masked_lm_ids``: list<uint16|uint32> (original ids);
    empty lists when ``records.masking == "dynamic"`` (the trainer's loader masks then).
  - packed records only (``records.packing``, manifest ``format_version`` 2): ``document_lengths``,
    list<uint16>, the lengths of the row's documents, each ``[CLS] tokens [SEP]``, in row order;
    they add up to the row's length (``num_a_tokens`` is the row's length, the label -1).

The vocabulary is a WordPiece ``vocab.txt`` or a Hugging Face ``tokenizer.json``
(:mod:`bertdist.data.tokenizer_file`; manifest ``vocab.kind``, ``format_version`` 2).

The manifest holds two splits, ``train`` and ``heldout`` (a document-hash held-out split);
``open_records(..., split="train")`` picks one (default ``train``). ``records.record_format``
(= ``manifest["records"]``) gives max_seq_length, masking, objective, masking_mode (token,
whole_word or span; whole_word_mask, its older form, too), mask_replace_prob, random_replace_prob,
masked_lm_prob, max_predictions_per_seq and id_dtype in one place; ``records.special_token_ids``
and ``records.vocab`` (path, sha256, size) likewise.

:mod:`bertdist.data.masking` is the masking oracle: the rules, one readable sequence at a time.
The pipeline's static masking and the loader's dynamic masking are vectorised versions of it,
tested against it draw for draw.
"""
from bertdist.data.manifest import MANIFEST_NAME, RecordsError, file_sha256, load_manifest, write_manifest_atomic
from bertdist.data.records import RECORD_COLUMNS, Records, open_records, record_schema
from bertdist.data.vocab import continuation_mask, load_vocab, special_token_ids, vocab_sha256

__all__ = [
    "MANIFEST_NAME",
    "RECORD_COLUMNS",
    "Records",
    "RecordsError",
    "continuation_mask",
    "file_sha256",
    "load_manifest",
    "load_vocab",
    "open_records",
    "record_schema",
    "special_token_ids",
    "vocab_sha256",
    "write_manifest_atomic",
]
