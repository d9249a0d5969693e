"""The node script's steps: an offline install with an import check, runs capped by the deadline,
and a report even when the bench leaves none."""
import json
import sys
import zipfile

import pytest

from bertdist.gpu_kit import node


def _wheel(folder, name, body="VALUE = 42\n"):
    """A minimal pure-Python wheel (what pip needs: the module, METADATA, WHEEL, RECORD)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", body)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def _node(tmp_path, wheels, seconds=120.0):
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    entries = []
    for name, body in wheels:
        w = _wheel(kit / "wheels", name, body)
        entries.append({"file": f"wheels/{w.name}", "name": name, "version": "1.0"})
    (kit / "kit.json").write_text(json.dumps({"wheels": entries}))
    out = tmp_path / "out"
    out.mkdir()
    return node.Node(kit, out, tmp_path / "site", tmp_path / "work", 2, "9.0", node.Clock(seconds))


def test_the_wheels_install_offline_into_the_site_and_import(tmp_path):
    n = _node(tmp_path, [("kitmod_ok", "VALUE = 42\n")])
    n.install()
    assert [(r["step"], r["status"]) for r in n.rows] == [("install", "ok"), ("import check", "ok")]
    assert (tmp_path / "site" / "kitmod_ok" / "__init__.py").is_file()
    saved = json.loads((tmp_path / "out" / "setup.json").read_text())["rows"]
    assert saved == n.rows and "all import: kitmod_ok" in saved[1]["detail"]


def test_a_wheel_that_does_not_import_is_a_failed_row_naming_it(tmp_path):
    n = _node(tmp_path, [("kitmod_ok", ""), ("kitmod_bad", "import not_there_at_all\n")])
    n.install()
    check = n.rows[-1]
    assert check["step"] == "import check" and check["status"] == "failed"
    assert "kitmod_bad: ModuleNotFoundError" in check["detail"] and "kitmod_ok" not in check["detail"]


def test_a_run_past_its_timeout_fails_and_none_starts_after_the_deadline(tmp_path):
    n = _node(tmp_path, [])
    row = n.run("slow step", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"], 1.0)
    assert row["status"] == "failed" and row["detail"].startswith("timed out after 1 s") and row["seconds"] < 10
    assert n.run("late step", [sys.executable, "-c", "pass"], 0.0)["status"] == "skipped"
    n.clock = node.Clock(-1.0)
    n.build(cuda=True)
    assert {r["step"]: r["status"] for r in n.rows[2:]} == {"build bertdist extension": "skipped",
                                                            "build DeepSpeed fused LAMB": "skipped"}
    assert n.bench([]) == 1 and n.rows[-1]["step"] == "bench" and n.rows[-1]["status"] == "skipped"


def test_a_bench_without_a_report_leaves_one_with_the_setup_rows(tmp_path):
    n = _node(tmp_path, [])
    n.record("install", "failed", 3.0, "exit 1: no matching distribution")
    n.log.write("Traceback (most recent call last):\nImportError: boom\n")
    n.fallback_report(1, 4.0)
    text = (tmp_path / "out" / "acceptance_bench-failed.md").read_text()
    assert "| install | failed | 3.0 | exit 1: no matching distribution |" in text and "ImportError: boom" in text


def test_the_bench_options_pass_through(tmp_path):
    args, extra = node.parse_args(["--kit", "K", "--out", "O", "--quick", "--skip", "recipes", "--steps", "1"])
    assert args.quick and not args.skip_build and extra == ["--skip", "recipes", "--steps", "1"]
    with pytest.raises(SystemExit):
        node.parse_args(["--out", "O"])  # --kit is required
