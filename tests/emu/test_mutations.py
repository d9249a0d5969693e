"""A representative few of the mutation tests in `make test`: injected CUDA bugs of three classes
(a missing __syncthreads in a tile loop, a missing __syncwarp, a shuffle in warp-divergent code)
must each make `make emu-test` fail. The whole set (tests/emu/mutate.py) is `make emu-mutate`."""
from __future__ import annotations

import shutil

import pytest

from bertdist.ops import _build_config as bc
from tests.emu import mutate


def test_every_mutant_text_is_in_the_sources():
    # A kernel edit that moves a mutant's text must update the mutant, not silently drop it.
    mutate.check_texts(mutate.MUTANTS)
    assert set(mutate.REPRESENTATIVE) <= {m.name for m in mutate.MUTANTS}


@pytest.mark.slow
def test_representative_mutants_are_killed():
    ok, why = bc.emu_build_reason()
    if not ok:
        pytest.skip(f"the emulated CUDA kernels cannot be built here: {why}")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # No baseline run: test_kernel_checks checks the unmutated sources in the same session.
    outcomes, _ = mutate.run([m for m in mutate.MUTANTS if m.name in mutate.REPRESENTATIVE], jobs=1, baseline=False)
    assert len(outcomes) == len(mutate.REPRESENTATIVE)
    assert not mutate.verdict(outcomes), mutate.verdict(outcomes)
