"""The Beam data pipeline: raw text to sharded, validated MLM/NSP training records.

Entry points: :func:`data_pipeline.pipeline.run` (a BuildConfig), :func:`build_records`
(small corpora from Python), and ``bertdist data build`` / ``bertdist data vocab``.
"""


def build_records(*args, **kwargs):
    from data_pipeline.pipeline import build_records as _build

    return _build(*args, **kwargs)


def run(*args, **kwargs):
    from data_pipeline.pipeline import run as _run

    return _run(*args, **kwargs)
