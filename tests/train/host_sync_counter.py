"""Counts, around a piece of training code, the aten operators it dispatches and the places where
it would make the host wait for the device on a GPU.

A host sync on CUDA is any read of a device value: ``.item()``, ``float()``, ``int()`` and
``bool()`` of a tensor (all dispatch ``aten::_local_scalar_dense``), ``.tolist()``, ``.cpu()``
and ``.numpy()``, and an explicit synchronize (torch's, DeepSpeed accelerator's). On the CPU these
cost nothing, so they are counted by what is called, not by what they cost. Tensors that live on
the host by design on every device (the optimizer's step counters) are excluded by identity.
"""
from __future__ import annotations

import collections
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_PATCHED = ("tolist", "cpu", "numpy")


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter(host_tensors) as c: ...`` then ``c.syncs`` (list of (what, where))
    and ``c.ops`` (aten operator -> calls)."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.host_ptrs = {t.data_ptr() for t in host_tensors}
        self.syncs: list[tuple[str, str]] = []
        self.ops: collections.Counter = collections.Counter()
        self._stack = contextlib.ExitStack()

    @property
    def aten_ops(self) -> int:
        return sum(self.ops.values())

    def _record(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "host_sync_counter" not in f.filename]
        where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(frames)
                      if "/torch/" not in f.filename), "?")
        self.syncs.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        if func is _SCALAR_READ and args[0].data_ptr() not in self.host_ptrs:
            self._record("item")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        counter = self
        for name in _PATCHED:
            original = getattr(torch.Tensor, name)

            def patched(t, *a, _original=original, _name=name, **k):
                counter._record(_name)
                return _original(t, *a, **k)

            self._stack.enter_context(_swap(torch.Tensor, name, patched))
        self._stack.enter_context(_swap(torch.cuda, "synchronize", lambda *a, **k: counter._record("synchronize")))
        try:
            from deepspeed.accelerator import get_accelerator

            acc = get_accelerator()
            real = acc.synchronize
            self._stack.enter_context(_swap(acc, "synchronize",
                                            lambda *a, **k: (counter._record("accelerator.synchronize"), real(*a, **k))))
        except ImportError:
            pass
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()


@contextlib.contextmanager
def _swap(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
