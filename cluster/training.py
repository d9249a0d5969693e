"""What a cluster job needs to know about a training config, read from the config file itself.

The job never gets a copy of the config: the rendered command re-reads the very
file given to ``bertdist submit`` (by absolute path, on the shared filesystem),
with the same dotted overrides. Here we only read the few keys that the job
script itself needs (run directory, data paths, batch sizes) to check them
before anything is queued.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bertdist.config import ConfigError
from bertdist.train.config import load_train_config
from cluster.errors import SubmitError

# Input paths of a TrainConfig (bertdist/train/config.py) that must exist before a job is queued.
DATA_KEYS = ("data.train_manifest", "data.vocab_file")


@dataclass(frozen=True)
class TrainingJob:
    """A pretraining run as a cluster job sees it."""

    config_path: Path  # absolute: the job re-reads this file
    overrides: tuple[str, ...]
    run_dir: Path  # absolute
    data_paths: tuple[Path, ...]
    name: str
    global_batch: int | None = None
    micro_batch: int | None = None
    checkpoint_every: int | None = None

    def command(self, python: str = sys.executable, *, launcher_module: bool = False) -> list[str]:
        """argv of one training process: ``bertdist pretrain --resume auto <config> <overrides>``.

        ``--resume`` goes first: argparse binds the config and the ``nargs="*"`` overrides as one
        run of positionals, so an option between them would leave the overrides unparsed.
        ``launcher_module`` gives the form after ``torchrun``/``deepspeed --module``:
        the module and its arguments without the interpreter."""
        tail = ["bertdist.cli.main", "pretrain", "--resume", "auto", str(self.config_path), *self.overrides]
        return ["-m", *tail] if launcher_module else [python, "-m", *tail]

    def check_world_size(self, world_size: int) -> None:
        """The global batch must split evenly over the processes (the trainer checks it again at start;
        catching it here saves a trip through the queue)."""
        if not self.global_batch:
            return
        if self.global_batch % world_size:
            raise SubmitError(
                f"global batch {self.global_batch} does not divide over {world_size} processes "
                f"({self.global_batch}/{world_size} = {self.global_batch / world_size:g} per process); "
                "change --nodes/--gpus-per-node or the config's global batch size"
            )
        if self.micro_batch and (self.global_batch // world_size) % self.micro_batch:
            per = self.global_batch // world_size
            raise SubmitError(
                f"global batch {self.global_batch} over {world_size} processes is {per} per process, "
                f"which is not a multiple of the micro batch {self.micro_batch} "
                f"(global = micro x accumulation x world size = {self.micro_batch} x ? x {world_size})"
            )


def read_training_job(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    check_data: bool = True,
    name: str | None = None,
) -> TrainingJob:
    """The job's view of a training config, read through the trainer's own (torch-free) schema, so
    overrides are validated here, before queueing, exactly as the job will validate them."""
    cfg = Path(config_path).expanduser()
    if not cfg.is_file():
        raise SubmitError(f"training config not found: {cfg}")
    cfg = cfg.resolve()
    try:
        tc = load_train_config(cfg, overrides)
    except ConfigError as e:
        raise SubmitError(f"{cfg}: {e}") from None

    def _path(v: Any) -> Path:
        p = Path(str(v)).expanduser()
        # Relative paths in a config are relative to where the run starts; the job
        # starts in the submit directory (sbatch --chdir), so resolve against the cwd.
        return (p if p.is_absolute() else (Path.cwd() / p)).resolve()

    data_paths = tuple(_path(v) for k in DATA_KEYS if (v := getattr(tc.data, k.split(".", 1)[1])))
    if check_data:
        for p in data_paths:
            if not p.exists():
                raise SubmitError(f"data path in {cfg.name} does not exist: {p} (build it with `bertdist data build`)")
    return TrainingJob(
        config_path=cfg,
        overrides=tuple(overrides),
        run_dir=_path(tc.run_dir),
        data_paths=data_paths,
        name=name or f"bertdist-{cfg.stem}",
        global_batch=tc.data.global_batch_size,
        micro_batch=tc.data.micro_batch_size,
        checkpoint_every=tc.checkpoint.every_steps or None,
    )
