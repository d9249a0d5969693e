"""A representative few of the mutation tests in `make test`: injected CUDA bugs of three classes
(a missing __syncthreads in a tile loop, a missing __syncwarp, a shuffle in warp-divergent code)
must each make `make emu-test` fail. The whole set (tests/emu/mutate.py) is `make emu-mutate`."""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from bertdist.ops import _build_config as bc
from tests.emu import mutate


def test_every_mutant_text_is_in_the_sources():
    # A kernel edit that moves a mutant's text must update the mutant, not silently drop it.
    mutate.check_texts(mutate.MUTANTS)
    assert set(mutate.REPRESENTATIVE) <= {m.name for m in mutate.MUTANTS}


DRIVER_FAIL = ("emulated CUDA device (bdemu, csrc/emu): 2 multiprocessors\n"
               "82 passed, 1 failed in 15.0 s (1 context switches, 1 barriers, 1 warp collectives)\n"
               "FAILED kernels/attention/float32/b2_h2_s37_d64: dq error 3.1e-01 > 1e-05\n")


@pytest.mark.parametrize("run, result, detail", [
    (mutate.MakeRun(2, DRIVER_FAIL, "make: *** [Makefile:74: emu-check] Error 1"), "killed",
     "FAILED kernels/attention/float32/b2_h2_s37_d64"),
    (mutate.MakeRun(2, "83 passed, 0 failed in 15.0 s\n....F.\nFAILED tests/emu/test_emulated_model.py::test_x - "
                       "AssertionError\n1 failed, 35 passed", "make: *** Error 1"), "killed",
     "FAILED tests/emu/test_emulated_model.py::test_x"),
    (mutate.MakeRun(2, "", "emu build: building check_kernels failed:\ncuda_attention.cu:120: error: expected ';'\n"
                           "make: *** [Makefile:73: emu-check] Error 1"), "build failure", "emu build: building"),
    (mutate.MakeRun(-1, "emulated CUDA device", "timed out after 600 s", timed_out=True), "timeout", "timed out"),
    (mutate.MakeRun(2, "emulated CUDA device (bdemu, csrc/emu)\n", "make: *** [Makefile:74: emu-check] Segmentation "
                                                                     "fault (core dumped)"), "error",
     "without a failing check"),
    (mutate.MakeRun(0, "83 passed, 0 failed\n36 passed", ""), "survived", "make emu-test passed"),
])
def test_only_a_failing_check_is_a_kill(run, result, detail):
    got, by = mutate.classify(run)
    assert got == result and detail in by


def test_build_failures_and_timeouts_are_reported_not_scored(tmp_path, monkeypatch):
    plain, known = mutate.MUTANTS[0], next(m for m in mutate.MUTANTS if m.survives)
    outcomes = [mutate.Outcome(plain, "build failure", "emu build: error", 3.0),
                mutate.Outcome(dataclasses.replace(plain, name="t"), "timeout", "timed out after 600 s", 600.0),
                mutate.Outcome(dataclasses.replace(plain, name="k"), "killed", "FAILED kernels/x", 9.0),
                mutate.Outcome(known, "survived", "make emu-test passed", 50.0)]
    bad = mutate.verdict(outcomes)
    assert bad == [f"{plain.name}: build failure, not caught by a check (emu build: error); fix the mutant or the run",
                   "t: timeout, not caught by a check (timed out after 600 s); fix the mutant or the run"]
    monkeypatch.setattr(mutate, "REPO", tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    text = mutate.record(outcomes, 662.0, "python tests/emu/mutate.py").read_text()
    assert "**1 of 4 mutants killed** by a failing check" in text
    assert "1 build failure(s), 1 timeout(s) and 0 other error(s), none of them counted as kills" in text
    assert f"| `{plain.name}` |" in text and "| build failure |" in text and "| timeout |" in text


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
