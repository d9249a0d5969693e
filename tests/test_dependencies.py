"""pyproject.toml declares every third-party module the package imports at run time."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

PACKAGES = ("bertdist", "data_pipeline", "cluster")
# Imported only to report or use them when present, each behind a guard (not a dependency).
OPTIONAL = {"triton"}


def _declared(repo: Path) -> set[str]:
    deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].strip().lower().replace("_", "-") for d in deps}


def _imports(repo: Path) -> dict[str, str]:
    """Top-level module -> first file importing it, over every module of the installed packages."""
    found: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((repo / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    found.setdefault(n.split(".")[0], str(path.relative_to(repo)))
    return found


def test_every_runtime_import_is_declared(repo_root):
    declared = _declared(repo_root)
    dists = importlib.metadata.packages_distributions()
    missing = []
    for mod, where in sorted(_imports(repo_root).items()):
        if mod in sys.stdlib_module_names or mod in PACKAGES or mod in OPTIONAL or mod == "__future__":
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(mod, [])}
        if not names:
            missing.append(f"{mod} (imported by {where}) is not installed at all")
        elif not names & declared:
            missing.append(f"{mod} (imported by {where}) comes from {sorted(names)}, not in pyproject's dependencies")
    assert not missing, "\n".join(missing)
