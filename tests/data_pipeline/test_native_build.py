"""data_pipeline's native modules must not vanish silently: where a C++ compiler exists, a module
that did not build (or does not import) fails here, instead of its tests skipping."""
from __future__ import annotations

import importlib

import pytest

from data_pipeline import native_build


@pytest.mark.parametrize("module", native_build.NATIVE_MODULES)
def test_native_module_imports_where_a_compiler_exists(module):
    required, why = native_build.native_required()
    if not required:
        pytest.skip(f"the Python reference may run here: {why}")
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} does not import ({e}), and it must: {why}. Rebuild it with "
                    "`pip install --no-build-isolation --no-deps -e .` and read the '[bertdist setup]' lines; "
                    "BERTDIST_DATA_NATIVE=optional accepts the Python reference instead")


def test_policy_follows_the_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv(native_build.POLICY_ENV, raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native_build.cxx_compiler() is None
    required, why = native_build.native_required()
    assert not required and "no C++ compiler" in why

    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", f"{fake} -std=c++17")
    assert native_build.cxx_compiler() == str(fake)
    required, why = native_build.native_required()
    assert required and str(fake) in why


def test_policy_env_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(native_build.POLICY_ENV, "required")
    assert native_build.native_required()[0]
    monkeypatch.setenv(native_build.POLICY_ENV, "optional")
    monkeypatch.setenv("CXX", "c++")
    assert not native_build.native_required()[0]
    monkeypatch.setenv(native_build.POLICY_ENV, "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        native_build.native_required()
