"""Build script: the Python packages come from pyproject.toml; this adds the C++/CUDA extension
``bertdist._C`` (csrc/), built ahead of time by ``pip install -e .``.

- CUDA kernels when a CUDA toolkit and a CUDA build of torch are present (arch list from
  BERTDIST_CUDA_ARCHS, default "8.0;9.0+PTX"), the CPU-only extension otherwise.
- A failing CUDA build falls back to the CPU-only extension, and a failing CPU build leaves
  the package without ``_C``: it still imports and runs on the reference ops (or builds the
  extension just in time), and ``bertdist info`` says why. BERTDIST_CUDA=1 turns a CUDA build
  failure into an error instead; BERTDIST_CUDA=0 skips CUDA.
- MAX_JOBS (torch's knob) caps parallel compiles; it defaults to the core count here.
"""
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_bertdist_build_config", ROOT / "bertdist" / "ops" / "_build_config.py")
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

GEN_DIR = ROOT / "build" / "bertdist_generated"


def _log(msg: str) -> None:
    print(f"[bertdist setup] {msg}", file=sys.stderr, flush=True)


def _extensions():
    """(extension, fallback) or (None, None) when torch is missing."""
    try_cuda, why = bc.cuda_build_reason()
    if try_cuda:
        # torch.utils.cpp_extension reads CUDA_HOME at import time.
        os.environ["CUDA_HOME"] = bc.find_cuda_home()[0]
    try:
        from torch.utils import cpp_extension as ce
    except ImportError as e:
        _log(f"torch not importable ({e}); building no extension")
        return None, None, None
    common = dict(include_dirs=[str(bc.CSRC), str(GEN_DIR)])
    cpu_sources = [f"csrc/{s}" for s in bc.CPU_SOURCES]

    def cpu_ext(note: str):
        bc.write_build_info(GEN_DIR, False, "", note)
        return ce.CppExtension(
            bc.EXT_NAME, cpu_sources, extra_compile_args={"cxx": bc.cxx_flags()}, extra_link_args=["-fopenmp"], **common
        )

    if not try_cuda:
        _log(f"CPU-only extension: {why}")
        return cpu_ext(f"CUDA kernels not built: {why}"), None, ce
    archs, label = bc.arch_flags()
    _log(f"CUDA extension for {label}: {why}")
    bc.write_build_info(GEN_DIR, True, label, f"built with CUDA for {label}")
    cuda = ce.CUDAExtension(
        bc.EXT_NAME,
        cpu_sources + [f"csrc/{s}" for s in bc.CUDA_SOURCES],
        define_macros=[("BERTDIST_WITH_CUDA", "1")],
        extra_compile_args={"cxx": bc.cxx_flags() + ["-DBERTDIST_WITH_CUDA"], "nvcc": bc.nvcc_flags(archs)},
        extra_link_args=["-fopenmp"],
        include_dirs=common["include_dirs"] + bc.extra_include_dirs(),
    )
    return cuda, cpu_ext, ce


EXT, CPU_FALLBACK, CE = _extensions()

cmdclass = {}
if EXT is not None:

    class BuildExt(CE.BuildExtension):
        """torch's BuildExtension (ninja), degrading CUDA -> CPU-only -> no extension."""

        def build_extensions(self):
            try:
                super().build_extensions()
                return
            except Exception as e:  # compiler/linker errors surface as various exception types
                err = f"{type(e).__name__}: {e}"
                _log(f"extension build failed: {err}\n{traceback.format_exc()}")
            if CPU_FALLBACK is not None:
                if os.environ.get(bc.CUDA_ENV) == "1":
                    raise RuntimeError(f"CUDA build failed and {bc.CUDA_ENV}=1: {err}")
                _log("retrying without the CUDA kernels")
                self.extensions = [CPU_FALLBACK(f"CUDA build failed ({err[:300]}); CPU-only extension")]
                try:
                    super().build_extensions()
                    return
                except Exception as e2:
                    _log(f"CPU-only build failed too: {type(e2).__name__}: {e2}")
            _log("bertdist._C NOT built: the package falls back to JIT or the reference ops")
            self.extensions = []  # nothing to copy into the source tree; the install goes on

    cmdclass["build_ext"] = BuildExt.with_options(use_ninja=True)

setup(ext_modules=[EXT] if EXT is not None else [], cmdclass=cmdclass)
