"""The README's cheap commands, run verbatim (the rest run in `make demo` and the area tests)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Commands that need no data, training or scheduler: run them exactly as the README prints them.
VERBATIM = ("bertdist info", "bertdist model summary", "bertdist submit pretrain")


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", "", block)  # shell line continuations
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(VERBATIM):
                commands.append(line)
    return commands


def test_readme_lists_the_verbatim_commands():
    commands = readme_commands()
    for prefix in VERBATIM:
        assert any(c.startswith(prefix) for c in commands), f"README shows no `{prefix}` example"


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    # A working directory shaped like the README's: configs/ plus a vocab and records under runs/.
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "runs" / "records").mkdir(parents=True)
    (tmp_path / "runs" / "records" / "manifest.json").write_text("{}")
    shutil.copy(REPO / "data_pipeline" / "samples" / "books" / "shakespeare-macbeth.txt", tmp_path / "runs" / "vocab.txt")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{command}\n{r.stderr[-2000:]}"
    assert r.stdout.strip()
