"""The config layer and the CLI's parser import neither torch nor Beam.

`bertdist data build` on a Beam worker, `bertdist cluster render` on a login node and every
config check stay light: torch alone adds about 3 s and 500 MB to a process (measured on
`data build`: 767 MB driver RSS when bertdist.cli.bench imported bertdist.ops, 252 MB without).
Each check runs in a fresh interpreter, so an import made by another test cannot hide one."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "apache_beam", "deepspeed", "pyarrow")
BOOKS = str(Path(__file__).resolve().parents[2] / "data_pipeline" / "samples" / "books")

LIGHT_IMPORTS = {
    "config schema": "import bertdist.config",
    "model contract": "import bertdist.model.config",
    "ModernBERT config": "import bertdist.model.modernbert_config",
    "training config": "import bertdist.train.config",
    "data build config": "import data_pipeline.config",
    "cluster training config": "import cluster.training",
    "CLI parser": "from bertdist.cli.main import build_parser; build_parser()",
    # the kit is built where torch may be absent, and the node script records a failing torch as a row
    "GPU kit": "import bertdist.gpu_kit.build, bertdist.gpu_kit.node, bertdist.gpu_kit.image",
    # vocab training reads local files without Beam's filesystems
    "vocab corpus": ("from data_pipeline.config import InputConfig; from data_pipeline.vocab_corpus import iter_sentences; "
                     f"assert len(list(iter_sentences([InputConfig(kind='books', path={BOOKS!r})]))) > 1000"),
}


def heavy_modules_after(statement: str) -> list[str]:
    code = (f"import sys\n{statement}\n"
            f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("statement", LIGHT_IMPORTS.values(), ids=LIGHT_IMPORTS.keys())
def test_imports_no_framework(statement):
    assert heavy_modules_after(statement) == []


def test_the_check_sees_a_heavy_import():
    assert heavy_modules_after("import bertdist.ops") == ["torch"]
