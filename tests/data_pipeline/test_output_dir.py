"""Output on an object store: a fake ``memstore://`` Beam filesystem that behaves like GCS or S3
(flat keys, no directories, no rename, a directory is a key prefix) carries a whole build."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from apache_beam.io.filesystem import BeamIOError, FileMetadata, FileSystem

from data_pipeline.output_dir import MARKER
from tests.conftest import SAMPLES


class MemStore(FileSystem):
    """Objects are files under ``ROOT`` named by their key; listing is by key prefix."""

    ROOT: Path | None = None
    PREFIX = "memstore://"

    @classmethod
    def scheme(cls):
        return "memstore"

    def _local(self, path: str) -> Path:
        assert path.startswith(self.PREFIX) and self.ROOT is not None, path
        return self.ROOT / path[len(self.PREFIX):]

    def join(self, basepath, *paths):
        return "/".join([basepath.rstrip("/"), *(p.strip("/") for p in paths)])

    def split(self, path):
        head, _, tail = path.rpartition("/")
        return head, tail

    def mkdirs(self, path):
        pass  # no directories on an object store

    def has_dirs(self):
        return False

    def _keys(self):
        for dirpath, _, files in os.walk(self.ROOT):
            for name in files:
                yield self.PREFIX + str(Path(dirpath, name).relative_to(self.ROOT))

    def _list(self, dir_or_prefix):
        for key in self._keys():
            if key.startswith(dir_or_prefix):
                yield self.metadata(key)

    def create(self, path, mime_type="application/octet-stream", compression_type=None):
        p = self._local(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        return open(p, "wb")

    def open(self, path, mime_type="application/octet-stream", compression_type=None):
        return open(self._local(path), "rb")

    def copy(self, source_file_names, destination_file_names):
        raise NotImplementedError("the pipeline must not need copy")

    def rename(self, source_file_names, destination_file_names):
        raise NotImplementedError("object stores have no rename: the pipeline must not need it")

    def exists(self, path):
        p = self._local(path)
        return p.is_file() or any(k.startswith(path.rstrip("/") + "/") for k in self._keys())

    def size(self, path):
        return self._local(path).stat().st_size

    def last_updated(self, path):
        return self._local(path).stat().st_mtime

    def checksum(self, path):
        return str(self.size(path))

    def metadata(self, path):
        return FileMetadata(path, self.size(path), self.last_updated(path))

    def delete(self, paths):
        errors = {}
        for path in paths:
            keys = [k for k in self._keys() if k.startswith(path)] if path.endswith("/") else [path]
            if not keys or not all(self._local(k).is_file() for k in keys):
                errors[path] = IOError(f"not found: {path}")
            for k in keys:
                if self._local(k).is_file():
                    self._local(k).unlink()
        if errors:
            raise BeamIOError("Delete operation failed", errors)


@pytest.fixture
def memstore(tmp_path):
    MemStore.ROOT = tmp_path / "store"
    MemStore.ROOT.mkdir()
    yield MemStore.ROOT
    MemStore.ROOT = None


def _objects(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_build_on_an_object_store_commits_by_manifest_and_matches_local_output(memstore, tmp_path, small_vocab):
    from data_pipeline import build_records

    inputs = [f"books:{SAMPLES / 'books'}"]
    kw = dict(max_seq_length=64, dupe_factor=1, num_shards=2)
    local = build_records(inputs, tmp_path / "local", small_vocab, **kw)
    first = build_records(inputs, "memstore://bucket/out", small_vocab, **kw)
    assert first == "memstore://bucket/out/manifest.json"
    man = json.loads((memstore / "bucket/out/manifest.json").read_text())
    shards = [s for sp in man["splits"].values() for s in sp["shards"]]
    run_dir = shards[0]["path"].split("/")[0]
    # exactly the manifest, its shards and the build's mark remain: no staging, sidecars, spill or part files
    assert _objects(memstore) == sorted(["bucket/out/manifest.json", f"bucket/out/{run_dir}/{MARKER}",
                                         *(f"bucket/out/{s['path']}" for s in shards)])
    local_man = json.loads(Path(local).read_text())
    for s, ls in zip(shards, (s for sp in local_man["splits"].values() for s in sp["shards"])):
        data = (memstore / "bucket/out" / s["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == s["sha256"] == ls["sha256"]  # same bytes as a local build
        assert len(data) == s["bytes"]
    # the next commit removes a dead build's leftovers (marked as a build's), never a folder of the
    # user's, and keeps the previous output one more build for the trainers still reading it
    for name, mark in (("shards-dead", True), ("shards-mine", False)):
        folder = memstore / "bucket/out" / name
        folder.mkdir()
        (folder / "train-00000-of-00002.parquet").write_bytes(b"partial")
        if mark:
            (folder / MARKER).write_text("dead")
    build_records(inputs, "memstore://bucket/out", small_vocab, **kw)
    man2 = json.loads((memstore / "bucket/out/manifest.json").read_text())
    run_dir2 = man2["splits"]["train"]["shards"][0]["path"].split("/")[0]
    assert run_dir2 != run_dir
    assert {o.split("/")[2] for o in _objects(memstore)} == {"manifest.json", run_dir2, run_dir, "shards-mine"}
    build_records(inputs, "memstore://bucket/out", small_vocab, **kw)
    tops = {o.split("/")[2] for o in _objects(memstore)}
    assert run_dir not in tops and run_dir2 in tops and "shards-mine" in tops and len(tops) == 4
    shutil.rmtree(memstore / "bucket")


def test_the_vocab_is_staged_beside_the_output_and_read_through_beam(memstore, small_vocab):
    from bertdist.data.vocab import continuation_mask, load_vocab
    from data_pipeline.output_dir import OutputDir

    staged = OutputDir("memstore://bucket/out").stage_vocab(str(small_vocab), "run1")
    assert staged == "memstore://bucket/out/.staging-run1-vocab/vocab.txt"
    assert (memstore / "bucket/out/.staging-run1-vocab/vocab.txt").read_bytes() == small_vocab.read_bytes()
    assert load_vocab(staged) == load_vocab(small_vocab)
    assert (continuation_mask(staged) == continuation_mask(small_vocab)).all()


def test_a_relative_local_output_is_made_absolute(tmp_path, monkeypatch):
    from data_pipeline.output_dir import OutputDir

    monkeypatch.chdir(tmp_path)
    assert OutputDir("runs/records/").url == str(tmp_path / "runs" / "records")


def test_a_failed_build_removes_its_own_folders_and_nothing_else(tmp_path, small_vocab, monkeypatch):
    from data_pipeline import build_records, pipeline

    out = tmp_path / "out"
    inputs = [f"books:{SAMPLES / 'books'}"]
    build_records(inputs, out, small_vocab, max_seq_length=64, dupe_factor=1, num_shards=1)
    before = sorted(p.name for p in out.iterdir())
    (out / "shards-mine").mkdir()  # a user's folder that happens to share the prefix

    def broken_commit(*a, **k):
        raise RuntimeError("the runner lost a worker")

    monkeypatch.setattr(pipeline, "commit", broken_commit)
    with pytest.raises(RuntimeError, match="lost a worker"):
        build_records(inputs, out, small_vocab, max_seq_length=64, dupe_factor=1, num_shards=1)
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "shards-mine"])
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["rows"] > 0
