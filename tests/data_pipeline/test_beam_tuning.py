"""data_pipeline.beam_tuning: the Beam defaults we change are in effect, and a Beam without them is left alone."""
from __future__ import annotations

import inspect

from apache_beam.runners.worker import statesampler

from data_pipeline import beam_tuning


def test_state_sampler_period_is_shortened_once_the_beam_stages_are_imported():
    import data_pipeline.beam  # noqa: F401  (applies the tuning, as in every worker)

    assert statesampler.DEFAULT_SAMPLING_PERIOD_MS == 200  # Beam's own default: the reason for the tuning
    period = inspect.signature(statesampler.StateSampler.__init__).parameters["sampling_period_ms"].default
    assert period == beam_tuning.STATE_SAMPLER_PERIOD_MS == 20
    assert statesampler.StateSampler("test", statesampler.CounterFactory()).sampling_period_ms == 20
    assert beam_tuning.shorten_state_sampler_period()  # applying it again is harmless


def test_an_unexpected_beam_is_not_patched(monkeypatch):
    init = statesampler.StateSampler.__init__
    monkeypatch.setattr(init, "__defaults__", (123,))  # a Beam whose default we do not know
    assert not beam_tuning.shorten_state_sampler_period()
    assert init.__defaults__ == (123,)
