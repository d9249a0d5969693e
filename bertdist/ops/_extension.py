"""Locates the compiled extension ``bertdist._C``: prebuilt by ``pip install -e .``, else built
just in time with ``torch.utils.cpp_extension.load`` (ninja), else none, with the reason.

The JIT build includes the CUDA kernels only where setup.py would (CUDA toolkit found and a
CUDA build of torch). BERTDIST_JIT=0 disables it (then the package runs on the reference ops).
It builds into ``build/jit`` in the repository, or ``~/.cache/bertdist/jit`` when that is not
writable; later loads reuse the build.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from types import ModuleType

from bertdist.ops import _build_config as bc

JIT_ENV = "BERTDIST_JIT"
JIT_DIR_ENV = "BERTDIST_JIT_DIR"  # overrides where the JIT build goes
_lock = threading.Lock()
_loaded: tuple[ModuleType | None, str] | None = None


def _jit_dir() -> Path:
    choices = [bc.REPO / "build" / "jit", Path.home() / ".cache" / "bertdist" / "jit"]
    if os.environ.get(JIT_DIR_ENV):
        choices = [Path(os.environ[JIT_DIR_ENV])]
    for d in choices:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError(f"no writable folder for the JIT build (tried {', '.join(map(str, choices))})")


def _jit_build() -> tuple[ModuleType, str]:
    if not bc.CSRC.is_dir():
        raise FileNotFoundError(f"C++ sources not found at {bc.CSRC} (installed without csrc/)")
    try_cuda, why = bc.cuda_build_reason()
    from torch.utils import cpp_extension as ce

    build_dir = _jit_dir()
    sources = [str(bc.CSRC / s) for s in bc.CPU_SOURCES]
    includes = [str(bc.CSRC), str(build_dir)]
    cflags = bc.cxx_flags()
    kwargs = {}
    if try_cuda:
        home = bc.find_cuda_home()[0]
        os.environ["CUDA_HOME"] = home
        ce.CUDA_HOME = home  # read at import time by cpp_extension
        archs, label = bc.arch_flags()
        sources += [str(bc.CSRC / s) for s in bc.CUDA_SOURCES]
        includes += bc.extra_include_dirs()
        cflags = cflags + ["-DBERTDIST_WITH_CUDA"]
        kwargs["extra_cuda_cflags"] = bc.nvcc_flags(archs) + ["-DBERTDIST_WITH_CUDA"]
        note = f"JIT-built with CUDA for {label}"
        bc.write_build_info(build_dir, True, label, note)
    else:
        note = f"JIT-built without CUDA kernels: {why}"
        bc.write_build_info(build_dir, False, "", note)
    mod = ce.load(
        name="bertdist_C_jit" + ("_cuda" if try_cuda else "_cpu"),
        sources=sources,
        extra_include_paths=includes,
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        with_cuda=try_cuda,
        verbose=False,
        **kwargs,
    )
    return mod, f"{note} in {build_dir}"


def load() -> tuple[ModuleType | None, str]:
    """(module, how it was found) or (None, why there is none). Cached per process."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        import torch  # noqa: F401  (_C links against libtorch; load it first)

        try:
            from bertdist import _C

            _loaded = (_C, f"prebuilt bertdist._C ({Path(_C.__file__).name})")
            return _loaded
        except ImportError as e:
            prebuilt_err = f"no prebuilt bertdist._C ({e})"
        if os.environ.get(JIT_ENV, "1") == "0":
            _loaded = (None, f"{prebuilt_err}; JIT build disabled by {JIT_ENV}=0")
            return _loaded
        try:
            _loaded = _jit_build()
        except Exception as e:  # compiler missing, compile error, unwritable folders
            msg = str(e).strip().splitlines()
            _loaded = (None, f"{prebuilt_err}; JIT build failed: {type(e).__name__}: {msg[-1] if msg else ''}")
        return _loaded
