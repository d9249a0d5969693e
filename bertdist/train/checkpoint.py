"""Atomic DeepSpeed checkpoints with a ``latest`` pointer, retention and world-size changes.

Layout of ``<checkpoint dir>``::

    latest                      # text: the tag of the newest COMPLETE checkpoint
    step_00000500/              # one DeepSpeed checkpoint (tag = step_<global step>)
        mp_rank_00_model_states.pt           # DeepSpeed: module weights, client state
        *zero_pp_rank_<r>_mp_rank_00_optim_states.pt   # DeepSpeed: ZeRO shards, one per rank
        bertdist_config.yaml    # the resolved TrainConfig of the run
        trainer_state.json      # step, phase, loader state, world size, batch sizes, model config
        rng_state_rank<r>.json  # python / numpy / torch (/ cuda) RNG states of rank r, and those of an
                                # objective's own generators (ELECTRA's sampling); JSON: nothing to unpickle
        COMPLETE                # written last, before the directory is published
    universal/step_00000500/    # made on demand: DeepSpeed universal checkpoint for a new world size
    .staging/                   # checkpoints being written; never read

A save writes everything under ``.staging/<tag>``, then rank 0 renames it to
``<tag>`` and only then replaces ``latest`` (write tmp, fsync, rename). A
crash at any point leaves the previous ``latest`` and its directory untouched.
All paths must be on a file system shared by the ranks (as DeepSpeed assumes).
"""
from __future__ import annotations

import base64
import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from bertdist.config import ConfigError, save_config
from bertdist.train.state import TrainerState, checkpoint_tag

LATEST = "latest"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "bertdist_config.yaml"
STAGING = ".staging"
UNIVERSAL = "universal"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_file(tag_dir: Path, rank: int) -> Path:
    return Path(tag_dir) / f"rng_state_rank{rank}.json"


def legacy_rng_file(tag_dir: Path, rank: int) -> Path:
    """Where older checkpoints kept the RNG states, pickled (numpy arrays): readable only when trusted."""
    return Path(tag_dir) / f"rng_state_rank{rank}.pt"


def _bytes_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _b64_bytes(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """This process's RNG states as plain JSON values; ``generators``: named ``torch.Generator``s
    of the run besides the global ones (ELECTRA's sampling RNG), saved under "generators"."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _bytes_b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = _bytes_b64(torch.cuda.get_rng_state())
    if generators:
        state["generators"] = {name: _bytes_b64(g.get_state()) for name, g in generators.items()}
    return state


def set_rng_state(state: dict[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> list[str]:
    """Restore ``rng_state()``'s JSON form, or the pickled form of older checkpoints, into the
    global RNGs and ``generators``; returns the names of ``generators`` the state does not hold."""
    if isinstance(state["torch"], torch.Tensor):  # older checkpoints: the objects themselves
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        return sorted(generators or {})
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_b64_bytes(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_b64_bytes(state["cuda"]))
    saved = state.get("generators") or {}
    for name, g in (generators or {}).items():
        if name in saved:
            g.set_state(_b64_bytes(saved[name]))
    return sorted(set(generators or {}) - set(saved))


def seed_generators(generators: Mapping[str, torch.Generator] | None, seed: int, rank: int, step: int) -> None:
    """Seed each named generator from (seed, rank, step, its name): one stream per rank, none
    shared with the global RNGs (dropout) or another generator."""
    for name, g in (generators or {}).items():
        key = np.random.SeedSequence([seed, rank, step, zlib.crc32(name.encode())]).generate_state(1)[0]
        g.manual_seed(int(key))


def read_rng_state(tag_dir: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s saved RNG states, or None when the checkpoint has none (a universal copy).
    A pickled file of an older checkpoint is refused unless trusted (``--trust-checkpoint``)."""
    new, old = rng_file(tag_dir, rank), legacy_rng_file(tag_dir, rank)
    if new.is_file():
        return json.loads(new.read_text())
    if old.is_file():
        from bertdist.export.safe_load import load_file

        return load_file(old)
    return None


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, str]:
    """(checkpoint dir, tag) from either a checkpoint dir (follows ``latest``) or one tag dir."""
    p = Path(path)
    if (p / LATEST).is_file():
        tag = (p / LATEST).read_text().strip()
        return p, tag
    if (p / COMPLETE).is_file():
        return p.parent, p.name
    raise ConfigError(f"{p}: neither a checkpoint directory with a '{LATEST}' file nor a complete checkpoint "
                      f"(a tag directory with '{COMPLETE}')")


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` points at, or None when there is no checkpoint yet."""
    p = Path(ckpt_dir) / LATEST
    if not p.is_file():
        return None
    tag = p.read_text().strip()
    if not (p.parent / tag / COMPLETE).is_file():
        raise ConfigError(f"{p} points at {tag!r}, which is not a complete checkpoint in {p.parent}")
    return tag


def saved_tags(ckpt_dir: Path, complete_only: bool = True) -> list[str]:
    """The checkpoint tags in ``ckpt_dir``, oldest first: complete ones, or any ``step_*`` directory."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.glob("step_*") if p.is_dir() and (not complete_only or (p / COMPLETE).is_file()))


def read_checkpoint_state(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    tdir = ckpt_dir / tag
    if not (tdir / COMPLETE).is_file():
        raise ConfigError(f"{tdir}: checkpoint is incomplete or missing ('{COMPLETE}' marker absent)")
    return json.loads((tdir / STATE_FILE).read_text())


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, keep_last_n: int, rank: int, world_size: int):
        self.dir = Path(directory)
        self.keep_last_n = keep_last_n
        self.rank, self.world = rank, world_size
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.dir / STAGING, ignore_errors=True)  # leftovers of a save that crashed
        _barrier()

    def save(self, engine, state: TrainerState, config,
             generators: Mapping[str, torch.Generator] | None = None) -> str:
        """All ranks call this. Returns the tag once ``latest`` points at it. ``generators``: the
        objective's named RNGs, saved with this rank's RNG states."""
        tag = checkpoint_tag(state.step)
        trainer_state = state.to_dict()
        staging_root = self.dir / STAGING
        if self.rank == 0:
            shutil.rmtree(staging_root / tag, ignore_errors=True)  # leftovers of a crashed save
            staging_root.mkdir(parents=True, exist_ok=True)
        _barrier()
        engine.save_checkpoint(str(staging_root), tag=tag, client_state={"bertdist": trainer_state},
                               save_latest=False)
        sdir = staging_root / tag
        rng_file(sdir, self.rank).write_text(json.dumps(rng_state(generators)))
        _barrier()
        if self.rank == 0:
            save_config(config, sdir / CONFIG_FILE)
            (sdir / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
            for f in sdir.iterdir():  # everything on disk before the directory is published
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            _write_atomic(sdir / COMPLETE, f"{tag}\n")
            final = self.dir / tag
            if final.exists():  # a re-save of the same step: keep the old one until the new is in place
                old = self.dir / STAGING / f"{tag}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(sdir, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(sdir, final)
            _fsync_dir(self.dir)
            _write_atomic(self.dir / LATEST, f"{tag}\n")
            self._retain(tag)
        _barrier()
        return tag

    def _retain(self, current: str) -> None:
        if self.keep_last_n <= 0:
            return
        tags = saved_tags(self.dir)
        for old in tags[:-self.keep_last_n]:
            if old != current:
                shutil.rmtree(self.dir / old, ignore_errors=True)
                shutil.rmtree(self.dir / UNIVERSAL / old, ignore_errors=True)


def check_safe_to_convert(tag_dir: Path) -> None:
    """Read each DeepSpeed file of ``tag_dir`` the safe way (bertdist.export.safe_load) before
    DeepSpeed's converter, a separate process that unpickles them fully, reads them; a file that
    needs full pickle is refused there unless trusted."""
    from bertdist.export.safe_load import load_deepspeed_file

    for f in sorted(Path(tag_dir).glob("*_states.pt")):
        load_deepspeed_file(f)


def ensure_universal(ckpt_dir: Path, tag: str, rank: int) -> Path:
    """Convert ``<ckpt_dir>/<tag>`` to a DeepSpeed universal checkpoint (rank 0; others wait).

    Universal checkpoints hold each parameter's fp32 weights and optimizer moments whole, so a
    ZeRO checkpoint saved on N ranks loads on M. Returns the directory holding the converted tag.
    """
    out_root = ckpt_dir / UNIVERSAL
    out = out_root / tag
    if rank == 0 and not (out / COMPLETE).is_file():
        check_safe_to_convert(ckpt_dir / tag)
        shutil.rmtree(out, ignore_errors=True)
        out_root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt_dir / tag),
               "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1",
               "--num_merge_workers", "1"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"converting {ckpt_dir / tag} to a universal checkpoint failed:\n{res.stdout[-3000:]}\n"
                               f"{res.stderr[-3000:]}")
        for name in (STATE_FILE, CONFIG_FILE):
            shutil.copy2(ckpt_dir / tag / name, out / name)
        _write_atomic(out / COMPLETE, f"{tag}\n")
    _barrier()
    return out_root
