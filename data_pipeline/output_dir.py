"""The build's output directory on any filesystem Beam knows (local, gs://, s3://, hdfs://).

Local output keeps the POSIX commit: shards are staged in ``.staging-<run>/``, the directory is
renamed to ``shards-<run>/`` and the manifest is written through a temporary file and a rename.
Object stores have no directory rename (it would be a copy of every shard) but write an object
atomically, so there Beam writes straight into ``shards-<run>/`` and the manifest, written last
in one piece, is the commit: a directory no manifest names is garbage, removed by the next
successful run in both cases.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems

from bertdist.data.manifest import write_manifest_atomic

STAGING_PREFIX, SHARDS_PREFIX = ".staging-", "shards-"
# Written into every folder a build creates: only folders holding it are ever deleted, so a
# user's own `shards-*` folder in the output directory is left alone.
MARKER = ".bertdist-build"


class OutputDir:
    def __init__(self, url: str):
        self.url = url.rstrip("/") or url  # "/" stays "/"
        self.local = FileSystems.get_scheme(self.url) in (None, "file")
        if self.local and FileSystems.get_scheme(self.url) is None:
            # workers run elsewhere (another folder, another machine): never a launcher-relative path
            self.url = os.path.abspath(self.url)

    def join(self, *parts: str) -> str:
        return FileSystems.join(self.url, *parts)

    def prepare(self, run_id: str) -> tuple[str, str]:
        """(staging dir Beam writes into, final shard dir name) for a new run."""
        final = f"{SHARDS_PREFIX}{run_id}"
        if not self.local:
            self.write_bytes(self.join(final, MARKER), run_id.encode())
            return self.join(final), final
        staging = Path(self.url) / f"{STAGING_PREFIX}{run_id}"
        staging.mkdir(parents=True)
        (staging / MARKER).write_text(run_id)
        return str(staging), final

    def stage_vocab(self, vocab: str, run_id: str) -> str:
        """Copy the (launcher-local) vocab beside the run's output and return the copy's path:
        every worker writes the output, so every worker can read it there, on any runner. It
        lies in a ``.staging-`` folder of its own, which the commit's sweep of other runs' folders
        removes, as it removes a failed run's."""
        folder = self.join(f"{STAGING_PREFIX}{run_id}-vocab")
        if self.local:
            os.makedirs(folder)
        self.write_bytes(FileSystems.join(folder, MARKER), run_id.encode())
        # a tokenizer.json keeps its name (the file's kind) and the tokenizer_config.json beside it,
        # which may name its special tokens
        from bertdist.data.tokenizer_file import TOKENIZER_CONFIG_NAME, is_tokenizer_json

        path = FileSystems.join(folder, "tokenizer.json" if is_tokenizer_json(vocab) else "vocab.txt")
        with open(vocab, "rb") as f:
            self.write_bytes(path, f.read())
        config = os.path.join(os.path.dirname(os.path.abspath(vocab)), TOKENIZER_CONFIG_NAME)
        if is_tokenizer_json(vocab) and os.path.isfile(config):
            with open(config, "rb") as f:
                self.write_bytes(FileSystems.join(folder, TOKENIZER_CONFIG_NAME), f.read())
        return path

    # ---- files the driver reads and writes at commit time (small) ----
    @staticmethod
    def exists(path: str) -> bool:
        return FileSystems.exists(path)

    @staticmethod
    def size(path: str) -> int:
        return FileSystems.get_filesystem(path).size(path)

    @staticmethod
    def read_json(path: str) -> Any:
        with FileSystems.open(path) as f:
            return json.loads(f.read().decode("utf-8"))

    @staticmethod
    def write_bytes(path: str, data: bytes) -> None:
        with FileSystems.create(path) as f:
            f.write(data)

    @staticmethod
    def delete(paths: list[str]) -> None:
        """Delete files or whole directories; missing ones are fine (a retried commit)."""
        try:
            FileSystems.delete(paths)
        except BeamIOError as e:
            if any(FileSystems.exists(p) for p in e.exception_details):
                raise

    def delete_dirs(self, dirs: list[str]) -> None:
        """Whole directories: a local path names the directory, an object-store prefix needs
        its trailing slash."""
        self.delete([d.rstrip("/") + ("" if self.local else "/") for d in dirs])

    # ---- the commit ----
    def finish(self, staging: str, final: str) -> None:
        """Local: rename the staging dir to its final name (atomic). Remote: it already is."""
        if self.local:
            os.rename(staging, os.path.join(self.url, final))

    def write_manifest(self, manifest: dict[str, Any], name: str) -> None:
        if self.local:
            write_manifest_atomic(manifest, os.path.join(self.url, name))
        else:  # one object PUT: readers see the old manifest or the new one, never a part
            self.write_bytes(self.join(name), (json.dumps(manifest, indent=2) + "\n").encode())

    def current_shards(self, manifest_name: str) -> str | None:
        """The shard folder the committed manifest names, or None (no manifest yet, or unreadable)."""
        path = self.join(manifest_name)
        try:
            if not self.exists(path):
                return None
            entries = self.read_json(path)["splits"]["train"]["shards"]
            return entries[0]["path"].split("/", 1)[0] if entries else None
        except (OSError, ValueError, KeyError, IndexError, TypeError, BeamIOError):
            return None

    def _our_folders(self) -> list[str]:
        """The names of the folders in the output that a build made (they hold MARKER)."""
        if self.local:
            return sorted(d.name for d in Path(self.url).iterdir()
                          if d.is_dir() and d.name.startswith((SHARDS_PREFIX, STAGING_PREFIX)) and (d / MARKER).is_file())
        tops = {m.path[len(self.url) + 1:].split("/", 1)[0] for m in FileSystems.match([self.join("**")])[0].metadata_list}
        return sorted(t for t in tops
                      if t.startswith((SHARDS_PREFIX, STAGING_PREFIX)) and self.exists(self.join(t, MARKER)))

    def _remove(self, names: list[str]) -> None:
        if not names:
            return
        if self.local:
            for name in names:
                shutil.rmtree(Path(self.url) / name, ignore_errors=True)
        else:
            self.delete_dirs([self.join(n) for n in names])

    def remove_other_runs(self, keep: str, previous: str | None = None) -> None:
        """Delete the folders earlier builds made, except ``keep`` (just committed) and ``previous``
        (the shards the replaced manifest named: a trainer opened on it may still be reading them;
        the next build removes them)."""
        self._remove([n for n in self._our_folders() if n not in (keep, previous)])

    def discard_run(self, run_id: str, final: str, manifest_name: str) -> None:
        """A failed build's own folders: its staging, its vocab copy, and its shard folder unless
        the manifest names it (the commit had happened). Nothing of another run is touched."""
        mine = {f"{STAGING_PREFIX}{run_id}", f"{STAGING_PREFIX}{run_id}-vocab", final}
        if self.current_shards(manifest_name) == final:
            mine.discard(final)
        self._remove([n for n in self._our_folders() if n in mine])
