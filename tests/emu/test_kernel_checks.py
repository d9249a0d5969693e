"""The emulator's C++ checks (csrc/emu/checks.h), run inside bertdist._C_emu: its own semantics
(selftest) and every CUDA kernel against the C++ CPU twins in the same dtype and in float64,
fp32/bf16/fp16, dropout masks bit for bit (kernels). `make emu-test` runs the same checks in the
standalone driver instead."""
from __future__ import annotations

import pytest

from tests.emu._util import emu


@pytest.mark.parametrize("suite", ["selftest", "kernels"])
def test_checks_pass(suite):
    r = emu().run_checks(suite, keep_going=True)
    assert r["failed"] == 0, "\n".join(r["failures"])
    assert r["passed"] >= (15 if suite == "selftest" else 60), r["log"]


def test_unknown_suite_is_an_error():
    with pytest.raises(RuntimeError, match="suite must be all, selftest or kernels, got gpu"):
        emu().run_checks("gpu")
