"""The manifest file: load it, write it atomically, hash shard files.

The manifest is the commit point of a pipeline run: it is written last, through a temporary
file and a rename, so it only ever points at shards that were completely written.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "bertdist-records"
# 1: one sequence a row, a WordPiece vocab.txt. 2: adds what a version-1 reader would misread:
# rows of packed documents (records.packing, a document_lengths column) and tokenizer.json
# vocabularies (vocab.kind). A build writes 1 when it uses neither, so older readers keep reading it.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


class RecordsError(RuntimeError):
    """A manifest or shard that cannot be trusted; the message names the file."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def path_inside(base: Path, entry: str, manifest: Path, error: type[Exception] = RecordsError) -> Path:
    """``base / entry`` for a file a manifest lists, refused unless it stays inside ``base``: a
    manifest someone hands us must not point a reader (or a later deletion) anywhere else."""
    rel = Path(str(entry))
    try:
        inside = (base / rel).resolve().is_relative_to(base.resolve())
    except (ValueError, OSError):  # a NUL byte, a loop of links
        inside = False
    if not str(entry) or rel.is_absolute() or ".." in rel.parts or not inside:
        raise error(f"{manifest}: lists {str(entry)!r}, which is outside {base}; a manifest's files must be "
                    "relative paths inside its folder")
    return base / rel


def load_manifest(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise RecordsError(f"{p}: manifest not found (was the data build completed?)")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordsError(f"{p}: manifest is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise RecordsError(f"{p}: not a {FORMAT_NAME} manifest (format={data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("format_version") not in READABLE_VERSIONS:
        raise RecordsError(f"{p}: manifest format_version {data.get('format_version')!r}, this reader knows "
                           f"{', '.join(map(str, READABLE_VERSIONS))}: update bertdist to read these records")
    return data


def write_manifest_atomic(manifest: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write JSON to ``path`` via ``path.tmp`` + fsync + rename (atomic on POSIX)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return p
