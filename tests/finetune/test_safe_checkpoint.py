"""`bertdist finetune --checkpoint` refuses a checkpoint that would run code when unpickled."""
from __future__ import annotations

from bertdist.cli.main import main
from tests.distill import fixtures as fx
from tests.export.planted import planted_deepspeed_dir


def test_finetune_refuses_planted_checkpoint(tmp_path, capsys):
    marker = tmp_path / "ran"
    ckpt = planted_deepspeed_dir(tmp_path / "ckpt", marker)
    data = fx.write_sst2(tmp_path / "sst2")
    rc = main(["finetune", "sst2", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert str(ckpt / "step_00000001" / "mp_rank_00_model_states.pt") in out and "--trust-checkpoint" in out, out
    assert not marker.exists()
