"""benchmarks/op_dispatch.py: a checkout timed against itself gives a full table and the JSON of every round."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two child interpreters, each times a BERT-base-sized layer norm


def test_two_checkouts_are_timed_round_by_round_into_one_table(tmp_path):
    out = tmp_path / "rounds.json"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "op_dispatch.py"), "--repo", f"a={REPO}",
                        "--repo", f"b={REPO}", "--rounds", "1", "--calls", "64", "--reps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and "us/call" not in ln]
    assert len(rows) == 6, r.stdout  # 3 cases x 2 shapes
    for row in rows:
        a, b = (float(c.replace(",", "")) for c in row.strip("|").split("|")[2:4])
        assert a > 0 and b > 0, row
    rounds = json.loads(out.read_text())["rounds"]
    assert set(rounds) == {"a", "b"} and all(len(v) == 1 and len(v[0]) == 6 for v in rounds.values())


def test_one_checkout_is_refused():
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "op_dispatch.py"), "--repo", f"a={REPO}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least two --repo" in r.stderr
