"""Reading checkpoint files without running code from them.

``torch.load`` unpickles, and a pickle can call any function it names: a crafted checkpoint runs
code the moment it is read. Every checkpoint file is therefore read with ``weights_only=True``
(tensors, containers, numbers, strings) plus, for DeepSpeed's files, the few DeepSpeed classes
they hold (``deepspeed_globals``). A file that needs anything else is refused
(``UnsafeCheckpointError``) unless the user opted in with ``--trust-checkpoint``
(``trust_checkpoints``); then it is read with full pickle and a warning naming the file.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
import re
import warnings
from typing import Any, Iterator

import torch

from bertdist.config import ConfigError
from bertdist.export.hf import ExportError

TRUST_FLAG = "--trust-checkpoint"  # the commands' opt-in (bertdist/cli/export.py add_trust_flag)

_TRUST = contextvars.ContextVar("bertdist_trust_checkpoint", default=False)


class UnsafeCheckpointError(ExportError, ConfigError):
    """A checkpoint file only full unpickling can read; the message names the file and the opt-in.

    An ExportError for the commands that read weights, a ConfigError for ``pretrain``'s resume."""


class DamagedCheckpointError(ExportError, ConfigError):
    """A checkpoint file torch cannot read (truncated, damaged); the message names it."""


def _damaged(path, error: Exception) -> DamagedCheckpointError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return DamagedCheckpointError(f"{path}: cannot read this checkpoint file ({type(error).__name__}: {first}); it "
                                  "is truncated or damaged, or not a torch file: compare it with the original")


@contextlib.contextmanager
def trust_checkpoints(trust: bool = True) -> Iterator[None]:
    """Within the block, files that need full pickle are read with it (with a warning), not refused."""
    token = _TRUST.set(bool(trust))
    try:
        yield
    finally:
        _TRUST.reset(token)


def deepspeed_globals() -> list[type]:
    """The classes DeepSpeed 0.19's checkpoints pickle besides tensors, containers and numbers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        ZeroStageEnum,  # ZeRO optimizer states (and universal checkpoints) record their stage as this enum
        LossScaler,  # ZeRO optimizer states hold their loss scaler object: the static one (fp32, bf16) ...
        DynamicLossScaler,  # ... or the dynamic one (fp16)
        fragment_address,  # ZeRO 1/2 optimizer states: where each parameter sits in the flat partition
    ]


def _what_it_needs(error: Exception) -> str:
    """The first global torch refused, from its message."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return f"it names {found.group(1)}, which" if found else "it holds Python objects that"


def load_file(path: str | os.PathLike, map_location: Any = "cpu", *, allow: list[type] = (), **kwargs) -> Any:
    """``torch.load`` with ``weights_only=True`` and the classes in ``allow``; a file that needs full
    pickle raises UnsafeCheckpointError, or is read with it under ``trust_checkpoints``."""
    kwargs.pop("weights_only", None)  # DeepSpeed's callers ask for full pickle
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except (RuntimeError, EOFError, OSError) as e:  # a cut zip archive surfaces as any of them
        if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
            raise  # an open stream, or a missing file: the caller's own error
        raise _damaged(path, e) from None
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise _damaged(path, e) from None  # a damaged file, not a refusal
        if not _TRUST.get():
            raise UnsafeCheckpointError(
                f"{path}: refused to load: {_what_it_needs(e)} only full unpickling can restore, and unpickling runs "
                f"any code the file contains. If the checkpoint comes from a source you trust (e.g. an older bertdist "
                f"run), pass {TRUST_FLAG} to load it that way") from None
    warnings.warn(f"{path}: loading with full pickle ({TRUST_FLAG}): any code in this file runs", stacklevel=2)
    return torch.load(path, map_location=map_location, weights_only=False, **kwargs)  # the trusted path


def load_deepspeed_file(path: str | os.PathLike, map_location: Any = "cpu", **kwargs) -> Any:
    """One file of a DeepSpeed checkpoint (model or optimizer states)."""
    return load_file(path, map_location, allow=deepspeed_globals(), **kwargs)


class _SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine with our ``load``; saving and the rest go to the real one."""

    def __init__(self, inner):
        self._inner = inner

    def load(self, path, map_location=None):
        return load_deepspeed_file(path, map_location)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _TorchWithSafeLoad:
    """The ``torch`` module as a DeepSpeed module sees it, with ``load`` replaced by ours."""

    load = staticmethod(load_deepspeed_file)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def safe_torch_load_in(*modules) -> Iterator[None]:
    """Within the block, ``torch.load`` in ``modules`` (DeepSpeed modules that call it directly for full
    pickle, e.g. ``zero_to_fp32``, offering no hook) is ours. Only those modules' own
    name ``torch`` changes, and only for the block."""
    saved = [(m, m.torch) for m in modules]
    try:
        for m in modules:
            m.torch = _TorchWithSafeLoad()
        yield
    finally:
        for m, t in saved:
            m.torch = t


@contextlib.contextmanager
def safe_deepspeed_loads(engine) -> Iterator[None]:
    """Within the block, what ``engine.load_checkpoint`` reads goes through ``load_deepspeed_file``.

    DeepSpeed reads model and optimizer states through ``engine.checkpoint_engine.load``, its
    pluggable checkpoint I/O, but builds that engine from its config with no way to name our own
    (and its TorchCheckpointEngine loads with full pickle); so the engine's one is wrapped
    for the call. Universal checkpoints are read by module functions that call ``torch.load``
    directly; those modules get ours for the call too."""
    from deepspeed.checkpoint import universal_checkpoint
    from deepspeed.runtime.zero import stage3

    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _SafeCheckpointEngine(inner)
    try:
        with safe_torch_load_in(universal_checkpoint, stage3):
            yield
    finally:
        engine.checkpoint_engine = inner
