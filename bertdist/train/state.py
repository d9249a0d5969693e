"""What a checkpoint says about the run besides the weights: ``TrainerState`` (``trainer_state.json``).

The trainer writes one with every checkpoint; ``bertdist import-hf`` writes one for imported
weights (``bertdist/export/trainer_init.py``); resume, phase starts and export read it. Plain
JSON, so a checkpoint can be inspected without torch. No torch import here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

# Version of trainer_state.json's layout; a reader refuses a format it does not know.
STATE_FORMAT = 1


def checkpoint_tag(step: int) -> str:
    """The tag (directory name) of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


@dataclasses.dataclass
class TrainerState:
    step: int  # optimizer steps taken
    phase: int  # 1 = seq 128, 2 = seq 512, 0 = imported weights
    phases: list[dict[str, Any]]  # history: [{phase, init_from, init_step}], the current phase last
    loader: dict[str, int] | None  # LoaderState.to_dict(); None for imported weights
    world_size: int
    model: dict[str, Any]  # the BertConfig as a dict
    optimizer: str  # optimizer.name, or "none" for imported weights
    zero_stage: int
    precision: str
    skipped_steps: int = 0
    seed: int | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    grad_accum: int | None = None
    schedule: dict[str, Any] | None = None  # {"lr": peak lr, **ScheduleConfig}
    imported_from: str | None = None  # the HF directory imported weights came from
    # dtype of the module's weights ("fp32", "fp16"; precision.py); None in checkpoints that predate it,
    # where bf16 meant DeepSpeed's bf16 weights with fp32 master copies in its optimizer wrapper
    weights: str | None = None
    format: int = STATE_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; unset optional fields are left out (imported weights have no schedule)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k == "loader"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainerState":
        fmt = data.get("format")
        if fmt != STATE_FORMAT:
            raise ValueError(f"trainer state format {fmt!r} is not supported (this bertdist reads format "
                             f"{STATE_FORMAT}); was the checkpoint written by another version?")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ValueError(f"trainer state lacks {missing} (has {sorted(data)})")
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"trainer state has unknown keys {unknown} (known: {sorted(known)})")
        return cls(**data)
