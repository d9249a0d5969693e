"""make gpu-kit: the kit's layout, its size limit, and a folder it will not overwrite."""
import json
import os

import pytest

from bertdist.gpu_kit import build, records
from bertdist.gpu_kit.image import load_image


def _fake_records(folder, vocab_path=None):
    """The layout records.find checks, each manifest with the build machine's absolute vocab path."""
    folder.mkdir(parents=True)
    (folder / "vocab.txt").write_text("[PAD]\n")
    for kind in records.KINDS:
        for seq in build.BENCH_SEQS:
            m = records.manifest_path(folder, seq, kind)
            m.parent.mkdir()
            m.write_text(json.dumps({"vocab": {"path": str(vocab_path or folder / "vocab.txt")},
                                     "splits": {"train": {"shards": [{"path": "shard-0.parquet"}]}}}))
    return folder


@pytest.fixture
def kit_inputs(tmp_path, repo_root, monkeypatch):
    monkeypatch.setattr(build, "resolve", lambda image, lock: [])  # no wheel to fetch: no network needed
    image_path = repo_root / "configs" / "images" / "gpu-node-cuda13-py312.yaml"
    return load_image(image_path), image_path, _fake_records(tmp_path / "built" / "records")


def test_the_kit_holds_run_sh_its_image_and_records_with_relative_paths(tmp_path, repo_root, kit_inputs):
    image, image_path, recs = kit_inputs
    out = tmp_path / "kit"
    kit = build.build_kit(image, image_path, out, lock=repo_root / "requirements.lock", records_from=recs,
                          log=lambda *_: None)
    assert json.loads((out / "kit.json").read_text()) == kit
    assert kit["image"]["name"] == image.name and kit["wheels"] == [] and kit["records"]["seqs"] == build.BENCH_SEQS
    assert os.access(out / "run.sh", os.X_OK) and (out / "image.yaml").read_text() == image_path.read_text()
    assert kit["records"]["kinds"] == ["static", "unmasked"]
    for kind in records.KINDS:
        for seq in build.BENCH_SEQS:
            manifest = json.loads(records.manifest_path(out / "records", seq, kind).read_text())
            assert manifest["vocab"]["path"] == "../vocab.txt"  # the build machine's path would not exist there
    assert kit["size"]["total_mib"] < kit["size"]["limit_mib"] and kit["size"]["repository_bytes"] > 0


def test_a_kit_over_the_limit_fails_with_its_sizes(tmp_path, repo_root, kit_inputs):
    image, image_path, recs = kit_inputs
    with pytest.raises(SystemExit, match=r"MiB \+ repository .* MiB = .* MiB, over the 0.01 MiB limit"):
        build.build_kit(image, image_path, tmp_path / "kit", lock=repo_root / "requirements.lock",
                        records_from=recs, limit_mib=0.01, log=lambda *_: None)


def test_a_folder_that_is_not_a_kit_is_never_overwritten(tmp_path, repo_root, kit_inputs):
    image, image_path, recs = kit_inputs
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not overwriting"):
        build.build_kit(image, image_path, mine, lock=repo_root / "requirements.lock", records_from=recs,
                        log=lambda *_: None)
    assert (mine / "notes.txt").read_text() == "keep me"
    # an earlier kit is replaced
    kit = tmp_path / "kit"
    for _ in range(2):
        build.build_kit(image, image_path, kit, lock=repo_root / "requirements.lock", records_from=recs,
                        log=lambda *_: None)
    assert (kit / "kit.json").is_file()


def test_records_find_names_what_is_missing(tmp_path):
    recs = _fake_records(tmp_path / "r")
    assert set(records.find(recs, [128, 512])) == {128, 512}
    with pytest.raises(FileNotFoundError, match=r"no static records for seq \[256\]"):
        records.find(recs, [128, 256])
    with pytest.raises(FileNotFoundError, match="no vocab.txt"):
        records.find(tmp_path, [128])


def test_records_of_each_kind_live_apart_and_dynamic_masking_reads_the_unmasked():
    assert records.manifest_path("r", 128).parent.name == "records_128"
    assert records.manifest_path("r", 128, "unmasked").parent.name == "records_128_unmasked"
    assert records.KINDS["unmasked"][1] == {"masking": "dynamic", "objective": "none"}
    assert [records.kind_for_masking(m) for m in ("dynamic", "static", "auto")] == ["unmasked", "static", "static"]


def test_a_kit_without_unmasked_records_is_refused(tmp_path):
    recs = _fake_records(tmp_path / "r")
    import shutil

    shutil.rmtree(records.manifest_path(recs, 512, "unmasked").parent)
    with pytest.raises(FileNotFoundError, match=r"no unmasked records for seq \[512\]"):
        records.find(recs, build.BENCH_SEQS, "unmasked")
