"""The build policy of data_pipeline's native modules: where a C++ compiler exists, a failed
build is an error (of ``pip install`` and of the tests), never a silent fall back to the Python
reference; without a compiler the Python reference runs and ``bertdist info`` says so.

Standard library only: setup.py loads this file by path, before anything is installed.
"""
from __future__ import annotations

import importlib
import os
import shlex
import shutil
import sysconfig

# the importable names of the modules built from csrc/data_pipeline/
NATIVE_MODULES = ("data_pipeline._native_dedup", "data_pipeline._native_instances", "data_pipeline._native_wordpiece")

# "auto" (the default): required where a C++ compiler is found; "required"; "optional"
POLICY_ENV = "BERTDIST_DATA_NATIVE"
POLICIES = ("auto", "required", "optional")


def cxx_compiler() -> str | None:
    """Path of the C++ compiler that setuptools would call (``$CXX``, else Python's build-time
    CXX, else ``c++``), or None when it is not on the PATH."""
    cmd = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    words = shlex.split(cmd)
    return shutil.which(words[0]) if words else None


def native_required() -> tuple[bool, str]:
    """(must the native modules build?, why), from ``$BERTDIST_DATA_NATIVE`` and the compiler."""
    policy = os.environ.get(POLICY_ENV, "").strip().lower() or "auto"
    if policy not in POLICIES:
        raise ValueError(f"{POLICY_ENV}={policy!r} is not one of {list(POLICIES)}")
    if policy == "optional":
        return False, f"{POLICY_ENV}=optional"
    if policy == "required":
        return True, f"{POLICY_ENV}=required"
    cxx = cxx_compiler()
    if cxx:
        return True, f"a C++ compiler exists ({cxx})"
    return False, "no C++ compiler on the PATH ($CXX, Python's CXX or c++)"


def import_native(module: str):
    """(the module, "") or (None, why it cannot be used): not built (no compiler at install
    time) or built for another Python. Its Python reference runs then."""
    try:
        return importlib.import_module(module), ""
    except ImportError as e:
        return None, (f"the extension {module} is not built ({e}); "
                      "`pip install --no-build-isolation -e .` builds it (see setup.py)")
