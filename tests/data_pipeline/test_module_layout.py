"""data_pipeline's module layout: no import cycles between its files, and every file opens with a
docstring whose first line says its role. Read from the source with ``ast`` (nothing is imported),
so imports inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "data_pipeline"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body (``from pkg import mod``
    counts as importing ``pkg.mod`` when that is a module, else ``pkg``)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif not is_package(base) or a.name in package_names(base):
                    out.add(base)
                # else a compiled submodule of the package (data_pipeline._native_instances)
    return {m for m in out if m in known and m != me}


def is_package(name: str) -> bool:
    return ROOT.parent.joinpath(*name.split("."), "__init__.py").is_file()


def package_names(package: str) -> set[str]:
    """The names a package's ``__init__.py`` defines at its top level."""
    init = ROOT.parent.joinpath(*package.split("."), "__init__.py")
    names = set()
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imported_modules(p, set(mods)) for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search with a path stack)."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 10 and graph["data_pipeline.instance_algorithm"] >= {"data_pipeline.seeds",
                                                                             "data_pipeline.negatives"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in data_pipeline: " + " -> ".join(cycle)


def test_the_cycle_check_sees_imports_inside_functions():
    """The check itself: an import inside a function is an edge (the Beam transform loads the native
    bridge lazily), and an edge that closes a circle is found."""
    graph = import_graph()
    assert "data_pipeline.instance_native" in graph["data_pipeline.beam.instance_transform"]
    graph["data_pipeline.seeds"] = graph["data_pipeline.seeds"] | {"data_pipeline.negatives"}
    assert find_cycle(graph) == ["data_pipeline.negatives", "data_pipeline.seeds", "data_pipeline.negatives"]


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_opens_with_a_docstring_of_its_role(name):
    doc = ast.get_docstring(ast.parse(modules()[name].read_text(encoding="utf-8")))
    assert doc and doc.splitlines()[0].strip(), f"{modules()[name]} has no docstring saying its role"
