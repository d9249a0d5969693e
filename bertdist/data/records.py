"""The trainer's view of a pipeline output: verify the manifest, then serve shards.

``open_records(manifest_path)`` checks that every shard exists with the recorded size and
sha256 (``verify=True``), that the vocab hash and ``max_seq_length`` match what the trainer
expects, and returns a :class:`Records`. Any mismatch raises :class:`RecordsError` naming the
file; nothing is skipped silently.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from bertdist.data.manifest import MANIFEST_NAME, RecordsError, file_sha256, load_manifest, path_inside

RECORD_COLUMNS = ("input_ids", "num_a_tokens", "next_sentence_label", "masked_lm_positions", "masked_lm_ids")
# packed records only: the lengths of the documents (each framed [CLS] ... [SEP]) that make up the
# row, in row order; they add up to the row's length
DOCUMENT_LENGTHS = "document_lengths"


def record_schema(vocab_size: int, packed: bool = False) -> pa.Schema:
    """Arrow schema of a record shard; ids are uint16 while the vocab fits, else uint32. Positions
    and lengths are uint16: rows hold at most 65,535 tokens. ``packed`` adds DOCUMENT_LENGTHS."""
    id_type = pa.uint16() if vocab_size < 65536 else pa.uint32()
    fields = [
        pa.field("input_ids", pa.list_(id_type), nullable=False),
        pa.field("num_a_tokens", pa.uint16(), nullable=False),
        pa.field("next_sentence_label", pa.int8(), nullable=False),
        pa.field("masked_lm_positions", pa.list_(pa.uint16()), nullable=False),
        pa.field("masked_lm_ids", pa.list_(id_type), nullable=False),
    ]
    if packed:
        fields.append(pa.field(DOCUMENT_LENGTHS, pa.list_(pa.uint16()), nullable=False))
    return pa.schema(fields)


@dataclass
class Records:
    manifest_path: Path
    manifest: dict[str, Any]
    split: str
    shards: list[tuple[Path, int]]
    _sha256: list[str] = field(repr=False, default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(r for _, r in self.shards)

    @property
    def record_format(self) -> dict[str, Any]:
        return self.manifest["records"]

    @property
    def max_seq_length(self) -> int:
        return int(self.record_format["max_seq_length"])

    @property
    def masking(self) -> str:
        return self.record_format["masking"]

    @property
    def objective(self) -> str:
        return self.record_format["objective"]

    @property
    def packed(self) -> bool:
        """Whether rows hold several documents (DOCUMENT_LENGTHS gives their lengths)."""
        return bool((self.record_format.get("packing") or {}).get("documents"))

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self.manifest["special_token_ids"])

    @property
    def vocab(self) -> dict[str, Any]:
        return dict(self.manifest["vocab"])

    def read_shard(self, i: int, columns: list[str] | None = None) -> pa.Table:
        path, rows = self.shards[i]
        if not path.is_file():
            raise RecordsError(f"{path}: shard listed in {self.manifest_path} is missing")
        try:
            table = pq.read_table(path, columns=columns)
        except (pa.ArrowException, OSError) as e:
            raise RecordsError(f"{path}: unreadable Parquet shard ({e})") from None
        if table.num_rows != rows:
            raise RecordsError(f"{path}: has {table.num_rows} rows, manifest {self.manifest_path} says {rows}")
        return table

    def iter_shards(self) -> Iterator[pa.Table]:
        for i in range(len(self.shards)):
            yield self.read_shard(i)


def open_records(
    manifest_path: str | os.PathLike,
    *,
    expect_vocab_sha256: str | None = None,
    expect_max_seq_length: int | None = None,
    verify: bool = True,
    split: str = "train",
) -> Records:
    """Open and verify a pipeline output. ``manifest_path`` may be the manifest or its directory."""
    mpath = Path(manifest_path)
    if mpath.is_dir():
        mpath = mpath / MANIFEST_NAME
    manifest = load_manifest(mpath)
    try:
        return _open(mpath, manifest, expect_vocab_sha256, expect_max_seq_length, verify, split)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a RecordsError passes through
        what = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise RecordsError(f"{mpath}: not a well-formed records manifest ({what})") from None


def _open(mpath: Path, manifest: dict, expect_vocab_sha256: str | None, expect_max_seq_length: int | None,
          verify: bool, split: str) -> Records:
    splits = manifest.get("splits", {})
    if split not in splits:
        raise RecordsError(f"{mpath}: no split {split!r} (has {sorted(splits)})")
    if expect_vocab_sha256 is not None and manifest["vocab"]["sha256"] != expect_vocab_sha256:
        raise RecordsError(
            f"{mpath}: records were built with vocab sha256 {manifest['vocab']['sha256']} "
            f"({manifest['vocab'].get('path')}), the training config expects {expect_vocab_sha256}"
        )
    msl = int(manifest["records"]["max_seq_length"])
    if expect_max_seq_length is not None and msl != int(expect_max_seq_length):
        raise RecordsError(f"{mpath}: records have max_seq_length {msl}, the training config expects {expect_max_seq_length}")
    base = mpath.parent
    shards: list[tuple[Path, int]] = []
    sums: list[str] = []
    for entry in splits[split]["shards"]:
        p = path_inside(base, entry["path"], mpath)
        shards.append((p, int(entry["rows"])))
        sums.append(entry["sha256"])
        if not verify:
            continue
        if not p.is_file():
            raise RecordsError(f"{p}: shard listed in {mpath} is missing")
        size = p.stat().st_size
        if "bytes" in entry and size != int(entry["bytes"]):
            raise RecordsError(f"{p}: size {size} bytes, manifest says {entry['bytes']} (truncated or altered shard)")
        digest = file_sha256(p)
        if digest != entry["sha256"]:
            raise RecordsError(f"{p}: sha256 {digest} does not match the manifest ({entry['sha256']}): altered shard")
    return Records(mpath, manifest, split, shards, sums)
