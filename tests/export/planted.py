"""Checkpoint files that run code when unpickled: each touches a marker file, so a test can tell
whether anything unpickled it with full pickle."""
from __future__ import annotations

import json
import pathlib
from pathlib import Path

import torch


class _TouchOnLoad:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: code of the file's choosing."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def plant(path: Path, marker: Path) -> Path:
    """A torch.save file at ``path`` that touches ``marker`` when loaded with full pickle."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": _TouchOnLoad(marker), "dp_world_size": 1}, path)
    return path


def planted_deepspeed_dir(root: Path, marker: Path, tag: str = "step_00000001") -> Path:
    """A DeepSpeed save dir (``latest`` -> ``tag``) whose model states file is planted; the trainer's
    layout (COMPLETE, trainer_state.json) so every reader gets as far as that file."""
    tdir = root / tag
    plant(tdir / "mp_rank_00_model_states.pt", marker)
    (tdir / "COMPLETE").write_text(f"{tag}\n")
    (tdir / "config.yaml").write_text(json.dumps({"model": {"preset": "tiny"}}))
    (root / "latest").write_text(f"{tag}\n")
    return root


def planted_hf_dir(hf_dir: Path, marker: Path) -> Path:
    """An HF directory (from ``write_hf_dir``) whose weights are a planted ``pytorch_model.bin``."""
    for f in hf_dir.glob("model*.safetensors*"):
        f.unlink()
    return plant(hf_dir / "pytorch_model.bin", marker).parent
