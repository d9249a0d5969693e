"""A data build never commits an empty or unverifiable dataset: the plan (corpus totals), the
instance stage's unit reports and the shards must agree, and a runner that reports no metrics
gets null counts, never 0."""
from __future__ import annotations

import json

import apache_beam as beam
import pytest

from data_pipeline.beam import instance_transform, shards as beam_shards
from data_pipeline.commit import EmptyBuildError

DOCS = 8


def _input(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("".join(f"Sentence {i} of document {d} is here and it goes on.\n" + ("\n" if i == 11 else "")
                            for d in range(DOCS) for i in range(12)))
    return path


def _build(tmp_path, vocab, name="out", **kw):
    from data_pipeline import build_records

    return build_records([f"text:{_input(tmp_path)}"], tmp_path / name, vocab, max_seq_length=32, num_shards=2, **kw)


def test_a_build_whose_documents_are_all_skipped_fails_and_names_the_runner(tmp_path, small_vocab, capsys):
    """A filter that lets no document through (min_sentences above every document's): no commit,
    and `bertdist data build` exits 1 with a message that names the runner and the skips."""
    from bertdist.cli.main import main

    out = tmp_path / "cli"
    rc = main(["data", "build", "--input", f"text:{_input(tmp_path)}", "--vocab", str(small_vocab), "--output",
               str(out), "--set", "min_sentences=50", "--runner=DirectRunner", "--direct_running_mode=in_memory",
               "--direct_num_workers=1"])
    err = capsys.readouterr().err
    assert rc == 1 and not (out / "manifest.json").exists()
    assert "bertdist data build: no document reached the instance stage: every input was skipped" in err
    assert "(runner DirectRunner; inputs" in err
    assert f"skipped_too_few_sentences={DOCS}" in err and "Dask runner is known to drop output branches" in err


def test_rows_lost_after_the_instance_stage_are_caught(tmp_path, small_vocab, monkeypatch):
    """A runner that drops the shard-writing branch (as Beam's Dask runner dropped an output
    branch): the instance stage reported its rows, the shards have none, nothing is committed."""
    monkeypatch.setattr(beam_shards._AssembleShardDoFn, "process", lambda self, kv: iter(()))
    with pytest.raises(EmptyBuildError, match=rf"train: the plan counted {DOCS} documents, the instance stage built "
                                              rf"{DOCS} of them into [1-9]\d* instances .* and 0 rows reached the "
                                              r"shards: the runner lost work \(runner DirectRunner"):
        _build(tmp_path, small_vocab, heldout_fraction=0.0)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_build_without_its_plan_is_unverifiable(tmp_path, small_vocab, monkeypatch):
    report = instance_transform._report_plan  # the plan is not written, everything else is
    monkeypatch.setattr(instance_transform, "_report_plan", lambda plan, report_dir: report(plan, None))
    with pytest.raises(EmptyBuildError, match=r"built \d+ work units but wrote no build plan, so its output cannot be "
                                              "verified"):
        _build(tmp_path, small_vocab)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_counts_a_runner_cannot_report_are_unknown(tmp_path, small_vocab, monkeypatch):
    """A runner without metrics (Beam's Dask runner raises "collecting metrics will come later!"):
    the data's own counts are recorded, the metrics-only ones are null and printed as unknown."""
    from bertdist.cli.data import build_report

    real_run = beam.Pipeline.run

    class NoMetrics:
        def __init__(self, result):
            self.wait_until_finish = result.wait_until_finish

        def metrics(self):
            raise NotImplementedError("collecting metrics will come later!")

    monkeypatch.setattr(beam.Pipeline, "run", lambda self, *a, **k: NoMetrics(real_run(self, *a, **k)))
    man = json.loads(_build(tmp_path, small_vocab, heldout_fraction=0.0).read_text())
    assert man["counts"]["input_words"] is None and man["skips"] is None and man["metrics"] is None
    assert man["counts"]["documents"] == DOCS and man["counts"]["instances"] == man["splits"]["train"]["rows"] > 0
    assert man["negatives"]["train"]["random_next"] == man["counts"]["random_next"] > 0
    report = build_report(man)
    assert "input words unknown" in report[0] and report[-1].startswith("  Beam metrics: unknown (runner DirectRunner")
