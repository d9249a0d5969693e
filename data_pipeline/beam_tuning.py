"""Beam defaults we change for this pipeline, each with the measurement that justifies it.

Applied when :mod:`data_pipeline.beam` is imported: in the driver before the pipeline
runs, and in every SDK worker when it unpickles the first of our DoFns.
"""
from __future__ import annotations

import logging

log = logging.getLogger("data_pipeline")

# Beam's StateSampler (per-step msec counters) runs a thread that sleeps between samples, ramping
# from 2 ms up to DEFAULT_SAMPLING_PERIOD_MS (200 ms), and every bundle's end joins that thread:
# "May have to wait up to sampling_period_ms" (statesampler_fast.pyx). A bundle longer than about
# a second so idles up to 200 ms at its end. With our 7 stages a one-core 1x build idled 0.31 s of
# 3.6 s (cProfile: threading.join under StateSampler.stop). 20 ms caps that at 20 ms per bundle;
# the sampler thread then wakes 50 times a second, which costs microseconds.
STATE_SAMPLER_PERIOD_MS = 20


def shorten_state_sampler_period(period_ms: int = STATE_SAMPLER_PERIOD_MS) -> bool:
    """Make ``period_ms`` the StateSampler's default period. Returns whether it did: False when
    this Beam version has no such default (the tuning is then skipped, nothing breaks)."""
    try:
        from apache_beam.runners.worker import statesampler

        init = statesampler.StateSampler.__init__
        default = statesampler.DEFAULT_SAMPLING_PERIOD_MS
    except (ImportError, AttributeError) as e:
        log.debug("Beam StateSampler not tuned: %s", e)
        return False
    if init.__defaults__ not in ((default,), (period_ms,)):
        log.debug("Beam StateSampler not tuned: unexpected defaults %r", init.__defaults__)
        return False
    init.__defaults__ = (period_ms,)
    return True
