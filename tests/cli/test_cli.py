"""The `bertdist` console script: info and model summary, run as a user would."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bertdist.cli.main import COMMANDS, SUBCOMMANDS, build_parser
from bertdist.ops import kernel_status, resolve_kernels


def _bertdist(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("bertdist") or str(Path(sys.executable).parent / "bertdist")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_info_reports_versions_and_true_kernel_status():
    r = _bertdist("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    import torch

    assert info["versions"]["torch"] == torch.__version__
    # What info prints must be what the dispatcher decides in this very environment.
    for device_type in ("cpu", "cuda"):
        rows = {row["op"]: row for row in info["kernels"][device_type]}
        active = resolve_kernels("auto", device_type).sources
        for s in kernel_status(device_type):
            assert rows[s.op]["fused_usable"] == s.usable
            assert rows[s.op]["active_under_auto"] == active[s.op]
            assert rows[s.op]["reason"], f"{device_type}/{s.op}: the status must say why"
    if not torch.cuda.is_available():
        assert all(not r["fused_usable"] for r in info["kernels"]["cuda"])
    from data_pipeline import dedup, instance_native, wordpiece

    for key, built in (("instance_builder", instance_native.available()), ("wordpiece_encoder", wordpiece.native_available()),
                       ("dedup_signing", dedup.native_available())):
        assert info["data_pipeline"][key].startswith("native" if built else "Python reference"), info["data_pipeline"]
    from data_pipeline import native_build

    required, why = native_build.native_required()
    assert info["data_pipeline"]["native_build"] == f"{'a failed build is an error' if required else 'optional'}: {why}"


def test_model_summary_base_prints_published_count():
    r = _bertdist("model", "summary", "--preset", "base", "--seq-len", "128")
    assert r.returncode == 0, r.stderr
    assert "109,482,240" in r.stdout
    assert "train (3x)" in r.stdout


def test_model_summary_rejects_unknown_override():
    r = _bertdist("model", "summary", "--preset", "tiny", "--set", "hidden=3")
    assert r.returncode == 2
    assert "unknown key 'hidden'" in r.stderr


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_listed_subcommand_has_help(name):
    for cmd in COMMANDS[name]:
        for parser in (build_parser(), build_parser([cmd, "--help"])):  # the whole parser, and the command's own
            with pytest.raises(SystemExit) as e:
                parser.parse_args([cmd, "--help"])
            assert e.value.code == 0


def test_each_module_registers_exactly_its_listed_commands():
    import argparse
    import importlib

    for name, commands in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        assert tuple(sub.choices) == commands, name
    whole = build_parser()
    assert list(whole._subparsers._group_actions[0].choices) == [c for cs in COMMANDS.values() for c in cs]


def test_a_named_command_imports_only_its_module():
    code = ("import sys; from bertdist.cli.main import build_parser; build_parser(['data', 'build', '--help']); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('bertdist.cli.', 'bertdist.finetune', 'cluster')))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "bertdist.cli.data" in loaded
    assert not [m for m in loaded if m.startswith(("bertdist.cli.finetune", "bertdist.finetune", "cluster.", "bertdist.cli.info"))]


def test_data_build_exits_fast_as_a_program_and_returns_in_process(tmp_path, small_vocab):
    """`data build` skips the interpreter's teardown when run as a program (its output still
    arrives whole and the manifest is committed), and returns normally when main() is called."""
    from bertdist.cli import main as cli

    text = tmp_path / "in.txt"
    text.write_text("".join(f"Sentence {i} of document {d} is here.\n" + ("\n" if i == 9 else "")
                            for d in range(6) for i in range(10)))
    args = ["data", "build", "--input", f"text:{text}", "--vocab", str(small_vocab), "--output", str(tmp_path / "a"),
            "--set", "max_seq_length=32", "--set", "num_shards=2", "--runner=DirectRunner",
            "--direct_running_mode=in_memory", "--direct_num_workers=1"]
    r = subprocess.run([sys.executable, "-m", "bertdist.cli.main", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["num_shards"] == 2
    # the whole report arrived: its last line is the last Beam metric
    assert "data build:" in r.stdout and r.stdout.rstrip().splitlines()[-1].split()[0] == max(manifest["metrics"])
    assert not cli._PROGRAM
    args[args.index(str(tmp_path / "a"))] = str(tmp_path / "b")
    assert cli.main(args) == 0  # in-process: returns, and the interpreter goes on
    assert (tmp_path / "b" / "manifest.json").exists()


def test_info_shows_cached_kernel_decisions_per_device(tmp_path, monkeypatch, capsys):
    import torch

    from bertdist.cli import info
    from bertdist.ops import kernel_plan, selection
    from bertdist.ops.decision_cache import DecisionCache

    monkeypatch.setenv("BERTDIST_CACHE_DIR", str(tmp_path))
    w = kernel_plan.Workload(batch=2, seq=8, hidden=16, heads=2, ops=("layer_norm",))
    selection.decide(w, torch.device("cpu"), cache=DecisionCache(), timer=lambda c, case, call, d: [2.0 if c.name == "torch" else 1.0])
    monkeypatch.setattr(kernel_plan, "device_name", lambda device: "NVIDIA H100 80GB HBM3")  # a second device
    selection.decide(w, torch.device("cpu"), cache=DecisionCache(), timer=lambda c, case, call, d: [1.0])
    dec = info.collect()["kernel_decisions"]
    assert dec["cache"] == str(tmp_path / "kernel_decisions.json")
    by_device = {e["environment"]["device"]: e["decisions"] for e in dec["environments"]}
    assert len(by_device) == 2 and [r["choice"] for r in by_device["NVIDIA H100 80GB HBM3"]] == ["torch"]
    (cpu_rows,) = [rows for name, rows in by_device.items() if name.startswith("cpu")]
    assert cpu_rows[0]["choice"] == "fused" and cpu_rows[0]["choice_ms"] == 1.0 and cpu_rows[0]["torch_ms"] == 2.0
    info.print_decisions(dec)
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3 | torch" in out and "-> fused" in out and "vs torch 2.000 ms" in out


def test_data_vocab_checks_and_copies_an_existing_tokenizer_json(tmp_path, small_bpe_tokenizer, capsys):
    """`bertdist data vocab --existing tokenizer.json` reads it as a build would and copies it with
    the tokenizer_config.json beside it; a tokenizer without a mask token is refused (exit 2)."""
    from bertdist.cli.main import main

    src = tmp_path / "ckpt"
    src.mkdir()
    shutil.copyfile(small_bpe_tokenizer, src / "tokenizer.json")
    (src / "tokenizer_config.json").write_text(json.dumps({"mask_token": "[MASK]"}))
    assert main(["data", "vocab", "--existing", str(src / "tokenizer.json"), "--output",
                 str(tmp_path / "out" / "tokenizer.json")]) == 0
    out = capsys.readouterr().out
    assert "BPE, 2,005 ids" in out and "'mask': 2004" in out and "yes ('Ġ' word starts)" in out
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == small_bpe_tokenizer.read_bytes()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    spec = json.loads(small_bpe_tokenizer.read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "[MASK]"]
    (tmp_path / "nomask.json").write_text(json.dumps(spec))
    assert main(["data", "vocab", "--existing", str(tmp_path / "nomask.json"), "--output", str(tmp_path / "x.json")]) == 2
    assert "no mask token found" in capsys.readouterr().err
