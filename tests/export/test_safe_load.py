"""No code runs from a checkpoint file someone hands us: `export` and `import-hf` refuse a planted
pickle naming the file and --trust-checkpoint, and the trusted path loads it with a warning."""
from __future__ import annotations

import pytest
import torch

from bertdist.cli.main import main
from bertdist.export.safe_load import UnsafeCheckpointError, load_file, trust_checkpoints
from tests.distill import fixtures as fx
from tests.export.planted import plant, planted_deepspeed_dir, planted_hf_dir


def test_planted_file_is_refused_and_trust_loads_it_with_a_warning(tmp_path):
    marker = tmp_path / "ran"
    f = plant(tmp_path / "evil.pt", marker)
    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as e:
        load_file(f)
    assert str(f) in str(e.value) and "it names getattr" in str(e.value)  # the file, and what it wanted to call
    assert not marker.exists()
    with trust_checkpoints(), pytest.warns(UserWarning, match=str(f)):
        load_file(f)
    assert marker.exists()  # the opt-in does what it says


def test_export_refuses_planted_deepspeed_checkpoint(tmp_path, capsys):
    marker = tmp_path / "ran"
    ckpt = planted_deepspeed_dir(tmp_path / "ckpt", marker)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert str(ckpt / "step_00000001" / "mp_rank_00_model_states.pt") in out and "--trust-checkpoint" in out, out
    assert not marker.exists()


def test_export_refuses_planted_torch_format_dir(tmp_path, capsys):
    marker = tmp_path / "ran"
    d = tmp_path / "torchdir"
    plant(d / "bertdist_model.pt", marker)
    (d / "bertdist_model.yaml").write_text("preset: tiny\n")
    assert main(["export", str(d), "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert str(d / "bertdist_model.pt") in out and "--trust-checkpoint" in out, out
    assert not marker.exists()


def test_import_hf_reads_nothing_from_a_non_hf_dir(tmp_path, capsys):
    marker = tmp_path / "ran"
    ckpt = planted_deepspeed_dir(tmp_path / "ckpt", marker)
    assert main(["import-hf", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert f"{ckpt} is not a Hugging Face model directory" in out, out
    assert not marker.exists()


def test_import_hf_refuses_planted_pytorch_model_bin(tmp_path, capsys):
    marker = tmp_path / "ran"
    hf = planted_hf_dir(fx.tiny_base(tmp_path / "hf", fx.write_vocab(tmp_path / "vocab.txt")), marker)
    assert main(["import-hf", str(hf), "--out", str(tmp_path / "out"), "--no-verify"]) == 2
    out = capsys.readouterr().out
    assert str(hf / "pytorch_model.bin") in out and "--trust-checkpoint" in out, out
    assert not marker.exists()


@pytest.mark.parametrize("cut", [0.5, 0.02])
def test_a_truncated_checkpoint_file_is_an_error_naming_it(tmp_path, cut):
    from bertdist.export.safe_load import DamagedCheckpointError, load_file

    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.arange(4096.0)}}, path)
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * cut)])
    with pytest.raises(DamagedCheckpointError, match=r"mp_rank_00_model_states.pt: cannot read this checkpoint file"):
        load_file(path)
