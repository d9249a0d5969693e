"""Beam defaults we change for this pipeline, each with the measurement that justifies it.

Applied when :mod:`data_pipeline.beam` is imported: in the driver before the pipeline
runs, and in every SDK worker when it unpickles the first of our DoFns.
"""
from __future__ import annotations

import logging
import types
import weakref

log = logging.getLogger("data_pipeline")

# Beam's StateSampler (per-step msec counters) runs a thread that sleeps between samples, ramping
# from 1 ms up to DEFAULT_SAMPLING_PERIOD_MS (200 ms), and every bundle's end joins that thread:
# "May have to wait up to sampling_period_ms" (statesampler_fast.pyx). A bundle longer than about
# a second so idles up to 200 ms at its end. With our 7 stages a one-core 1x build idled 0.31 s of
# 3.6 s (cProfile: threading.join under StateSampler.stop). At 20 ms the build (then 24 stages)
# still idled: 2 ms made it 0.07 s faster in wall time at the same CPU time (2.43 -> 2.36 s,
# medians of 5 interleaved runs). The sampler thread then wakes 500 times a second, each a few
# microseconds.
STATE_SAMPLER_PERIOD_MS = 2


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


# Beam asks "is this DoFn stateful?" (userstate.get_dofn_specs) several times per DoFn: at
# construction, twice in to_runner_api, in the runner's visitors and in every bundle processor.
# Each call builds an inspect.Signature for every method of the DoFn (~30 per class). A one-core
# 1x build made 928 such calls and 25,000 signatures, 2.5 s of its 12.1 s under cProfile (with
# the cache: 263 calls, 10,000 signatures). The answer is fixed by the DoFn's class and, for
# Beam's Map/FlatMap/Filter wrappers, the process parameter defaults (the wrapper's recorded
# argument spec, else the wrapped function's): only a default that is a DoFn parameter
# (``DoFn.StateParam(...)``, ``DoFn.ElementParam``...) can add a spec. So it is worked out once
# per class for every wrapper without such a default (the usual lambda: the bundle processors
# unpickle a fresh one per stage, each a miss when keyed by the function; with the recorded
# argument spec too, 112 wrappers and 3,700 signature builds per build), and once per function
# otherwise; such a function is held weakly, so SDK workers that unpickle fresh functions
# bundle after bundle do not grow the cache.
_SPECS_BY_CLASS: dict[type, tuple] = {}
_SPECS_BY_FUNCTION: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _specs_key(dofn):
    """What fixes ``dofn``'s state and timer specs: ``(class, None)`` or ``(class, function)``;
    None when something on the instance could change them (then Beam's own answer is used)."""
    from apache_beam.transforms.core import DoFn

    cls = type(dofn)
    state = getattr(dofn, "__dict__", None)
    if state is None or any(isinstance(v, types.MethodType) for v in state.values()):
        return None
    if cls._process_argspec_fn is DoFn._process_argspec_fn:
        return cls, None
    fullargspec = state.get("_fullargspec")
    if fullargspec:  # MapTuple's and FlatMapTuple's wrappers: Beam reads process's (args, defaults) from it
        try:
            _, defaults = fullargspec
        except (TypeError, ValueError):
            return None
        return None if _any_dofn_param(defaults or ()) else (cls, None)
    fn = dofn._process_argspec_fn()
    if isinstance(fn, types.FunctionType) and not _has_dofn_param_default(fn):
        return cls, None
    try:
        weakref.ref(fn)
    except TypeError:  # builtins cannot be weakly referenced
        return None
    return cls, fn


def _any_dofn_param(defaults) -> bool:
    """Is one of these parameter defaults a DoFn parameter (what Beam reads specs from)?"""
    from apache_beam.transforms.core import _DoFnParam

    return any(isinstance(d, _DoFnParam) for d in defaults)


def _has_dofn_param_default(fn: types.FunctionType) -> bool:
    """Does a parameter of ``fn`` default to a DoFn parameter?"""
    return _any_dofn_param((*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()))


def _wrap_once(module: str, name: str, make, marker: str) -> bool:
    """Replace ``name`` (``function`` or ``Class.method``) of Beam's ``module`` with
    ``make(original)``, marked with ``marker``; a second call finds the mark and changes nothing.
    Returns whether it is in place: False when this Beam version has no such thing (the tuning
    is then skipped, nothing breaks)."""
    import importlib

    *path, attr = name.split(".")
    try:
        owner = importlib.import_module(module)
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, attr)
    except (ImportError, AttributeError) as e:
        log.debug("Beam %s.%s not tuned: %s", module, name, e)
        return False
    if getattr(original, marker, False):
        return True
    wrapped = make(original)
    setattr(wrapped, marker, True)
    wrapped.__wrapped__ = original
    wrapped.__doc__ = original.__doc__
    setattr(owner, attr, wrapped)
    return True


def _cached_dofn_specs(original):
    def get_dofn_specs(dofn):
        key = _specs_key(dofn)
        if key is None:
            return original(dofn)
        cls, fn = key
        table = _SPECS_BY_CLASS if fn is None else _SPECS_BY_FUNCTION.setdefault(fn, {})
        specs = table.get(cls)
        if specs is None:
            specs = table[cls] = original(dofn)
        state, timers = specs
        return set(state), set(timers)  # callers may mutate their copy

    return get_dofn_specs


def cache_dofn_specs() -> bool:
    """Memoise ``userstate.get_dofn_specs`` (see above); see :func:`_wrap_once` for the result."""
    return _wrap_once("apache_beam.transforms.userstate", "get_dofn_specs", _cached_dofn_specs, "_cached_per_class")


# Beam calls ``PipelineOptions.view_as`` in every transform application, every type-consistency
# check and every options validation, and each call builds an argparse parser holding every
# option class and parses the flags again. A one-core 1x build made 582 calls, 0.20 s of its
# 3.3 s. A view is only a window on the options' shared value dict (``_all_options``), fixed by
# the flags, so one view per (options object, class) serves every call; a view is rebuilt when
# the options' flags or value dict were replaced.
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cached_view_as(original):
    def view_as(self, cls):
        try:
            views = _VIEWS.setdefault(self, {})
        except TypeError:  # an options object that cannot be weakly referenced or hashed
            return original(self, cls)
        view = views.get(cls)
        if view is None or view._flags is not self._flags or view._all_options is not self._all_options:
            view = views[cls] = original(self, cls)
        return view

    return view_as


def cache_option_views() -> bool:
    """Memoise ``PipelineOptions.view_as`` (see above); see :func:`_wrap_once` for the result."""
    return _wrap_once("apache_beam.options.pipeline_options", "PipelineOptions.view_as", _cached_view_as,
                      "_cached_per_options")
