"""data_pipeline.beam_tuning: the Beam defaults we change are in effect, and a Beam without them is left alone."""
from __future__ import annotations

import inspect

from apache_beam.runners.worker import statesampler

from data_pipeline import beam_tuning


def test_state_sampler_period_is_shortened_once_the_beam_stages_are_imported():
    import data_pipeline.beam  # noqa: F401  (applies the tuning, as in every worker)

    assert statesampler.DEFAULT_SAMPLING_PERIOD_MS == 200  # Beam's own default: the reason for the tuning
    period = inspect.signature(statesampler.StateSampler.__init__).parameters["sampling_period_ms"].default
    assert period == beam_tuning.STATE_SAMPLER_PERIOD_MS == 2
    assert statesampler.StateSampler("test", statesampler.CounterFactory()).sampling_period_ms == 2
    assert beam_tuning.shorten_state_sampler_period()  # applying it again is harmless


def test_an_unexpected_beam_is_not_patched(monkeypatch):
    init = statesampler.StateSampler.__init__
    monkeypatch.setattr(init, "__defaults__", (123,))  # a Beam whose default we do not know
    assert not beam_tuning.shorten_state_sampler_period()
    assert init.__defaults__ == (123,)


class _Stateful(__import__("apache_beam").DoFn):
    from apache_beam.coders import VarIntCoder
    from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

    COUNT = ReadModifyWriteStateSpec("count", VarIntCoder())

    def process(self, kv, count=__import__("apache_beam").DoFn.StateParam(COUNT)):
        yield kv


class _Plain(__import__("apache_beam").DoFn):
    def process(self, x):
        yield x


def test_dofn_specs_are_cached_per_class_and_function_with_beams_answers():
    import apache_beam as beam
    from apache_beam.transforms import userstate

    import data_pipeline.beam  # noqa: F401  (applies the tuning)

    assert getattr(userstate.get_dofn_specs, "_cached_per_class", False)
    original = userstate.get_dofn_specs.__wrapped__
    fn_a, fn_b = (lambda x: [x]), (lambda x: [x, x])
    fn_state = lambda kv, count=beam.DoFn.StateParam(_Stateful.COUNT): [kv]  # noqa: E731
    dofns = [_Stateful(), _Stateful(), _Plain(), beam.FlatMap(fn_a).fn, beam.FlatMap(fn_a).fn,
             beam.FlatMap(fn_b).fn, beam.Map(len).fn, beam.FlatMap(fn_state).fn, beam.FlatMap(fn_a).fn]
    for d in dofns:
        assert userstate.get_dofn_specs(d) == original(d)
    assert userstate.is_stateful_dofn(_Stateful()) and not userstate.is_stateful_dofn(_Plain())
    # one entry per class; plain functions share their wrapper class's entry, and only a
    # function with a DoFn-parameter default (or a builtin: Beam's own answer) is keyed by itself
    assert _Stateful in beam_tuning._SPECS_BY_CLASS and _Plain in beam_tuning._SPECS_BY_CLASS
    assert type(beam.FlatMap(fn_a).fn) in beam_tuning._SPECS_BY_CLASS
    assert beam_tuning._specs_key(beam.FlatMap(fn_a).fn) == beam_tuning._specs_key(beam.FlatMap(fn_b).fn)
    assert fn_state in beam_tuning._SPECS_BY_FUNCTION and fn_a not in beam_tuning._SPECS_BY_FUNCTION
    # MapTuple records its function's argument spec on the wrapper: answered per class as well
    mapped = beam.MapTuple(lambda k, v, y=1: k).fn
    assert mapped._fullargspec and beam_tuning._specs_key(mapped) == (type(mapped), None)
    assert userstate.get_dofn_specs(mapped) == original(mapped)
    with_param = beam.MapTuple(lambda k, v, t=beam.DoFn.TimestampParam: k).fn
    assert beam_tuning._specs_key(with_param) is None
    assert userstate.get_dofn_specs(with_param) == original(with_param)
    # callers get their own sets: mutating one does not change the next answer
    userstate.get_dofn_specs(_Stateful())[0].clear()
    assert len(userstate.get_dofn_specs(_Stateful())[0]) == 1


def test_a_dofn_with_a_method_bound_on_the_instance_is_not_cached():
    import types

    d = _Plain()
    d.process = types.MethodType(lambda self, x: [x], d)
    assert beam_tuning._specs_key(d) is None


def test_a_beam_without_the_tuned_function_is_left_alone():
    assert not beam_tuning._wrap_once("apache_beam.transforms.userstate", "no_such_function", lambda f: f, "_m")
    assert not beam_tuning._wrap_once("apache_beam.no_such_module", "f", lambda f: f, "_m")
    assert not beam_tuning._wrap_once("apache_beam.options.pipeline_options", "PipelineOptions.no_such", lambda f: f, "_m")


def test_option_views_are_shared_and_see_each_others_changes():
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

    import data_pipeline.beam  # noqa: F401  (applies the tuning)

    options = PipelineOptions(["--runner=DirectRunner", "--direct_num_workers=3"])
    assert options.view_as(DirectOptions) is options.view_as(DirectOptions)
    assert options.view_as(DirectOptions).direct_num_workers == 3
    options.view_as(StandardOptions).runner = "PortableRunner"  # a change through one view...
    assert options.view_as(StandardOptions).runner == "PortableRunner"  # ...is seen by every later one
    assert PipelineOptions(["--direct_num_workers=5"]).view_as(DirectOptions).direct_num_workers == 5
