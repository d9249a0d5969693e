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

from cluster.errors import SubmitError

# Input paths of a TrainConfig (bertdist/train/config.py) that must exist before a job is queued.
DATA_KEYS = ("data.train_manifest", "data.vocab_file")


def _get(data: dict, dotted: str) -> Any:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Dotted overrides applied to the raw YAML, so paths changed on the command line are the ones checked.
    (The trainer validates overrides against its schema; here they only redirect lookups.)"""
    from bertdist.config.schema import _parse_scalar  # same scalar rules as the trainer

    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise SubmitError(f"override {item!r} is not of the form key.path=value")
        path, raw = item.split("=", 1)
        keys = path.strip().split(".")
        node = data
        for k in keys[:-1]:
            nxt = node.get(k)
            if not isinstance(nxt, dict):
                nxt = node[k] = {}
            node = nxt
        node[keys[-1]] = _parse_scalar(raw)
    return data


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


def _facts_from_train_config(cfg_path: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """The trainer's own schema (bertdist.train.config): overrides are validated here, before queueing."""
    from bertdist.train.config import load_train_config

    tc = load_train_config(cfg_path, overrides)
    data_paths = [v for k in DATA_KEYS if (v := getattr(tc.data, k.split(".", 1)[1], None))]
    return {
        "run_dir": tc.run_dir,
        "data_paths": data_paths,
        "global_batch": tc.data.global_batch_size,
        "micro_batch": tc.data.micro_batch_size,
        "checkpoint_every": tc.checkpoint.every_steps,
    }


def _facts_from_yaml(cfg_path: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """Fallback when the trainer's schema module is not installed: the same keys, read from the YAML."""
    from bertdist.config import load_yaml

    data = _apply_overrides(load_yaml(cfg_path), overrides)
    return {
        "run_dir": _get(data, "run_dir") or "runs/pretrain",
        "data_paths": [v for k in DATA_KEYS if (v := _get(data, k))],
        "global_batch": _get(data, "data.global_batch_size") or 256,
        "micro_batch": _get(data, "data.micro_batch_size") or 32,
        "checkpoint_every": _get(data, "checkpoint.every_steps"),
    }


def read_training_job(
    config_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    check_data: bool = True,
    name: str | None = None,
) -> TrainingJob:
    from bertdist.config import ConfigError

    cfg = Path(config_path).expanduser()
    if not cfg.is_file():
        raise SubmitError(f"training config not found: {cfg}")
    cfg = cfg.resolve()
    try:
        try:
            facts = _facts_from_train_config(cfg, overrides)
        except ImportError:
            facts = _facts_from_yaml(cfg, overrides)
    except ConfigError as e:
        raise SubmitError(f"{cfg}: {e}") from None

    def _path(v: Any) -> Path:
        p = Path(str(v)).expanduser()
        # Relative paths in a config are relative to where the run starts; the job
        # starts in the submit directory (sbatch --chdir), so resolve against the cwd.
        return (p if p.is_absolute() else (Path.cwd() / p)).resolve()

    data_paths = tuple(_path(p) for p in facts["data_paths"])
    if check_data:
        for p in data_paths:
            if not p.exists():
                raise SubmitError(f"data path in {cfg.name} does not exist: {p} (build it with `bertdist data build`)")
    return TrainingJob(
        config_path=cfg,
        overrides=tuple(overrides),
        run_dir=_path(facts["run_dir"]),
        data_paths=data_paths,
        name=name or f"bertdist-{cfg.stem}",
        global_batch=int(facts["global_batch"]) if facts["global_batch"] else None,
        micro_batch=int(facts["micro_batch"]) if facts["micro_batch"] else None,
        checkpoint_every=int(facts["checkpoint_every"]) if facts.get("checkpoint_every") else None,
    )
