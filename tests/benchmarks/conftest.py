"""Benchmark scripts are files, not modules of the package: tests load them by path."""
import importlib.util
import sys

import pytest


@pytest.fixture(scope="session")
def load_benchmark(repo_root):
    """``load_benchmark("acceptance")``: benchmarks/acceptance.py as a module, registered in
    sys.modules (dataclasses look their module up there)."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}_under_test",
                                                      repo_root / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
