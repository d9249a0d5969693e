"""The teacher: a fine-tuned task model directory (ours from `finetune` with ``save_model``, or any
Hugging Face ``BertFor<Task>``, ``ElectraFor<Task>`` or ``ModernBertFor<Task>`` directory), loaded once, in eval
mode; bf16 on a GPU.

Its identity (``bertdist.stored_set.model_sha256``, vocab sha256, casing) is what a pseudo-label set records and what a
student run checks before it reuses one.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from bertdist.export.encoders import family_named
from bertdist.export.hf import ExportError, is_hf_dir
from bertdist.export.safe_load import UnsafeCheckpointError
from bertdist.export.tokenizer import tokenizer_sha256
from bertdist.finetune.errors import DataError
from bertdist.finetune.heads import BertForTask, task_model
from bertdist.model import BertConfig
from bertdist.stored_set import model_sha256


class TeacherError(DataError):
    """A teacher directory that is not a fine-tuned model for the task; the message names the file."""


@dataclasses.dataclass
class Teacher:
    path: Path
    model: BertForTask  # eval mode, on `device` (an ElectraForTask on an ELECTRA backbone)
    config: BertConfig
    head_state: dict[str, torch.Tensor]  # the task head's tensors (classifier.* or qa_outputs.*)
    backbone_state: dict[str, torch.Tensor]  # BertForPreTraining layout (bert.*, cls.*); ELECTRA: discriminator.*
    vocab_file: Path | None  # None: the model has its own tokenizer files (ModernBERT)
    do_lower_case: bool
    sha256: str  # model_sha256 of the directory
    device: torch.device
    dtype: torch.dtype
    tokenizer_files: list[Path] = dataclasses.field(default_factory=list)
    hf_config: dict = dataclasses.field(default_factory=dict)

    @property
    def vocab_sha256(self) -> str:
        """The tokenizer's fingerprint: the WordPiece vocab's, or the own tokenizer.json's."""
        return tokenizer_sha256(self.vocab_file, self.tokenizer_files)

    def identity(self) -> dict:
        """What a pseudo-label set made by this teacher records about it."""
        return {"path": str(self.path), "sha256": self.sha256,
                "vocab_sha256": self.vocab_sha256, "do_lower_case": self.do_lower_case}


def _line_of(path: Path, key: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if f'"{key}"' in line:
            return i
    return 1


def load_teacher(path: str | Path, task: str, kind: str, num_labels: int, *, device: torch.device,
                 precision: str = "auto", kernels: str = "auto") -> Teacher:
    """The task model at ``path`` for a runner of head ``kind`` with ``num_labels`` outputs."""
    p = Path(path)
    if not is_hf_dir(p):
        raise TeacherError(f"{p}: not a task model directory (no config.json with model.safetensors or "
                           f"pytorch_model.bin); make one with `bertdist finetune ... --set save_model=true`")
    from bertdist.export.sources import read_task_dir

    conf_path = p / "config.json"
    hf = json.loads(conf_path.read_text())
    family = family_named(hf.get("model_type"))
    if family is None:
        raise TeacherError(f"{conf_path}:{_line_of(conf_path, 'model_type')}: model_type {hf.get('model_type')!r} is "
                           f"not one a teacher can be (bert, electra, modernbert)")
    want = family.hf_architecture(kind)
    archs = hf.get("architectures") or []
    if want not in archs:
        raise TeacherError(f"{conf_path}:{_line_of(conf_path, 'architectures')}: architectures {archs} is not a "
                           f"{task} task model (expected {want})")
    try:
        w, raw, _ = read_task_dir(p, kernels=kernels)
    except UnsafeCheckpointError:
        raise  # its message names the file and --trust-checkpoint
    except ExportError as e:
        raise TeacherError(str(e)) from None
    keys = family.head_keys(kind)
    head = {k: raw[k] for k in keys if k in raw}
    if len(head) != len(keys):
        raise TeacherError(f"{p}: {want} in config.json but the weights lack the task head "
                           f"{[k for k in keys if k not in head]}: not a fine-tuned task model")
    out_dim = 2 if kind == "span" else (1 if kind == "regression" else num_labels)
    if head[keys[0]].shape[0] != out_dim:
        n = hf.get("num_labels", len(hf.get("id2label") or {}))
        raise TeacherError(f"{conf_path}:{_line_of(conf_path, 'id2label')}: the teacher's head has "
                           f"{head[keys[0]].shape[0]} outputs (num_labels {n}); {task} needs {out_dim}")
    model = task_model(w.config, kind, num_labels, device_type=device.type, **family.head_options_of(hf))
    model.load_backbone(w.state_dict)
    model.load_state_dict({**model.state_dict(), **{k: v.float() for k, v in head.items()}})
    dtype = torch.float32
    if device.type == "cuda" and precision in ("auto", "bf16"):
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model.to(device=device, dtype=dtype).eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return Teacher(p, model, w.config, head, w.state_dict, Path(w.vocab_file) if w.vocab_file else None,
                   bool(w.do_lower_case), model_sha256(p), device, dtype, list(w.tokenizer_files), hf)
