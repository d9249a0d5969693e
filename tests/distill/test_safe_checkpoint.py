"""The distillation student and teacher loaders refuse checkpoints that would run code when unpickled."""
from __future__ import annotations

import json
import types

import pytest
import torch

from bertdist.distill.student import plan_student
from bertdist.distill.teacher import load_teacher
from bertdist.export.safe_load import UnsafeCheckpointError
from bertdist.model import BertConfig
from tests.distill import fixtures as fx
from tests.export.planted import planted_deepspeed_dir, planted_hf_dir


def test_student_checkpoint_with_planted_pickle_is_refused(tmp_path):
    marker = tmp_path / "ran"
    ckpt = planted_deepspeed_dir(tmp_path / "ckpt", marker)
    teacher = types.SimpleNamespace(config=BertConfig.from_preset("tiny", kernels="reference"))
    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as e:
        plan_student(str(ckpt), teacher, "classification")
    assert str(ckpt / "step_00000001" / "mp_rank_00_model_states.pt") in str(e.value)
    assert not marker.exists()


def test_teacher_with_planted_pytorch_model_bin_is_refused(tmp_path):
    marker = tmp_path / "ran"
    hf = planted_hf_dir(fx.tiny_base(tmp_path / "teacher", fx.write_vocab(tmp_path / "vocab.txt")), marker)
    conf = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**conf, "architectures": ["BertForSequenceClassification"]}))
    with pytest.raises(UnsafeCheckpointError, match="--trust-checkpoint") as e:
        load_teacher(hf, "sst2", "classification", 2, device=torch.device("cpu"), kernels="reference")
    assert str(hf / "pytorch_model.bin") in str(e.value)
    assert not marker.exists()
