"""docs/benchmarks.md's figures are benchmarks/figures.py's output, read from the results files."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "benchmarks.md"
REGENERATE = "python benchmarks/figures.py --write docs/benchmarks.md"


def figures():
    spec = importlib.util.spec_from_file_location("benchmark_figures", REPO / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_holds_the_current_figures():
    f = figures()
    page = PAGE.read_text(encoding="utf-8")
    assert f.BEGIN in page and f.END in page
    assert f.splice(page, f.render_section(), f.BEGIN, f.END) == page, f"docs/benchmarks.md is stale: run `{REGENERATE}` and commit it"


def test_every_linked_results_file_exists_and_every_table_row_links_one():
    page = PAGE.read_text(encoding="utf-8")
    section = page.split(figures().BEGIN, 1)[1]
    links = re.findall(r"\]\(\.\./benchmarks/results/([^)]+)\)", section)
    assert links
    for name in links:
        assert (REPO / "benchmarks" / "results" / name).is_file(), name
    rows = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| ---")]
    data_rows = [r for r in rows if "raw results" not in r]
    assert data_rows and all("../benchmarks/results/" in r for r in data_rows)


def test_a_figure_missing_from_its_file_is_an_error(monkeypatch, tmp_path):
    f = figures()
    monkeypatch.setattr(f, "RESULTS", tmp_path)
    (tmp_path / "model_cpu_2026-11-22.md").write_text("# no raw lines here\n")
    with pytest.raises(f.MissingFigure, match="no JSON lines"):
        f.model_table()


def test_the_medians_are_computed_from_the_raw_runs(monkeypatch, tmp_path):
    import json

    f = figures()
    monkeypatch.setattr(f, "RESULTS", tmp_path)
    ratios = {"x_reference_per_core": [10.0, 12.0, 11.0], "x_reference_instances_per_core": [7.0, 9.0, 8.0],
              "x_reference_per_cpu_s": [9.5, 9.0, 10.5], "x_reference_per_core_after_startup": [14.0, 13.0, 15.0]}
    repeats = [{"scale": 1, "repeat": i, "ours": [{"workers": 1, "dedup": "on", **{k: v[i] for k, v in ratios.items()}}]}
               for i in range(3)]
    (tmp_path / "data_pipeline_cpu_2026-11-25.md").write_text("\n".join(map(json.dumps, repeats)) + "\n")
    row = f.data_build_side_by_side_table()[2]
    assert row.startswith("| × 1 | 1 | on | 11.0 (10.0–12.0) | 8.0 (7.0–9.0) | 9.5 (9.0–10.5) | 14.0 (13.0–15.0) | 3 |"), row
    lines = [f'main {{"scale": {s}, "workers": 2, "wall_s": 4.0, "peak_rss_worker_mb": [300, 2]}}' for s in (1, 5, 10, 20)]
    (tmp_path / "data_pipeline_cpu_2026-11-24.md").write_text("\n".join(lines) + "\n")
    assert "peak RSS per worker 300 MB" in "\n".join(f.data_build_table())


def test_a_markdown_only_results_file_is_read_by_its_table_header(monkeypatch, tmp_path):
    f = figures()
    monkeypatch.setattr(f, "RESULTS", tmp_path)
    (tmp_path / "model_compile_cpu_2026-11-25.md").write_text(
        "# compile\n\n| run | eager step (s) | compiled step (s) | compiled / eager time |\n|---:|---:|---:|---:|\n"
        "| 1 | 2.000 | 1.000 | 0.50 |\n| 2 | 1.000 | 3.000 | 3.00 |\n| 3 | 4.000 | 4.000 | 1.00 |\n"
        "| median | 2.000 | 3.000 | 1.00 |\n")
    table = "\n".join(f.model_compile_table())
    assert "| median of the ratios | | | 1.00 |" in table  # computed from the runs, not copied from the file's row
    assert "| 2 | 1.000 | 3.000 | 3.00 |" in table
    (tmp_path / "model_compile_cpu_2026-11-25.md").write_text("# compile\n\n| run | eager |\n|---|---|\n| 1 | 2 |\n")
    with pytest.raises(f.MissingFigure, match="no table with the columns"):
        f.model_compile_table()
