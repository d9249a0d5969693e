"""Helpers of the emulated-kernel tests."""
from __future__ import annotations

import pytest

from bertdist.ops import _build_config as bc
from bertdist.ops import emulated


def emu():
    """The emulated-kernel extension. Fails where it should have been built (a C++ compiler and
    the CUDA headers are here) and skips, with the reason, where it cannot be."""
    mod, why = emulated.load()
    if mod is None:
        buildable, reason = bc.emu_build_reason()
        if buildable:
            pytest.fail(f"bertdist._C_emu is missing although it can be built here ({reason}): {why}")
        pytest.skip(f"the emulated CUDA kernels cannot be built here: {reason}")
    return mod


def launched(before: dict, after: dict) -> set[str]:
    """Kernel names the emulator launched between two emulator_counts() snapshots."""
    return {k for k, v in after["kernels"].items() if v[0] > before["kernels"].get(k, (0, 0, 0))[0]}
