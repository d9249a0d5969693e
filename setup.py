"""Build script: the Python packages come from pyproject.toml; this adds the C++/CUDA extension
``bertdist._C`` (csrc/), built ahead of time by ``pip install -e .``.

- CUDA kernels when a CUDA toolkit and a CUDA build of torch are present (arch list from
  BERTDIST_CUDA_ARCHS, default "8.0;9.0+PTX"), the CPU-only extension otherwise.
- A failing CUDA build falls back to the CPU-only extension, and a failing CPU build leaves
  the package without ``_C``: it still imports and runs on the reference ops (or builds the
  extension just in time), and ``bertdist info`` says why. BERTDIST_CUDA=1 turns a CUDA build
  failure into an error instead; BERTDIST_CUDA=0 skips CUDA.
- MAX_JOBS (torch's knob) caps parallel compiles; it defaults to the core count here.

Three more, independent extensions, ``data_pipeline._native_dedup``, ``_native_instances`` and
``_native_wordpiece`` (csrc/data_pipeline/), are plain pybind11 modules without torch (Beam
workers must not import torch). They are built first, by setuptools' own build_extension.
Where a C++ compiler exists, a failed build of any of them is an error of the whole
install (data_pipeline/native_build.py: BERTDIST_DATA_NATIVE=optional turns it into a fall back
to the module's Python reference); without a compiler they are skipped and the Python reference
runs. None of them ever stops ``bertdist._C``, nor the reverse.

BERTDIST_EXTENSIONS=data builds only the data modules, in build/data-only/: the wheel that a
Beam job stages for its SDK workers (``pip wheel --no-deps --no-build-isolation .``), which
never import torch.

``bertdist._C_emu`` (the CUDA kernels compiled by the host compiler for the SIMT emulator in
csrc/emu, so that they run in CI without a GPU) is built last, in its own try and its own
build folder, where a C++ compiler and the CUDA headers exist (no nvcc needed); otherwise, or
when it fails, it is skipped with the reason and nothing else is affected. BERTDIST_EMU=0
skips it.
"""
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as PlainBuildExt

ROOT = Path(__file__).resolve().parent


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bc = _load_by_path("_bertdist_build_config", ROOT / "bertdist" / "ops" / "_build_config.py")
native_build = _load_by_path("_bertdist_native_build", ROOT / "data_pipeline" / "native_build.py")
DATA_NATIVE_REQUIRED, DATA_NATIVE_WHY = native_build.native_required()
# "all" (the default) or "data": only the torch-free data modules (the Beam workers' wheel)
EXTENSIONS = os.environ.get("BERTDIST_EXTENSIONS", "all")
if EXTENSIONS not in ("all", "data"):
    raise SystemExit(f"BERTDIST_EXTENSIONS={EXTENSIONS!r} is not one of ['all', 'data']")

GEN_DIR = ROOT / "build" / "bertdist_generated"


def _log(msg: str) -> None:
    print(f"[bertdist setup] {msg}", file=sys.stderr, flush=True)


def _extensions():
    """(extension, CPU-only fallback factory or None, torch.utils.cpp_extension), or (None, None, None)
    when torch is missing."""
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


# torch-free pybind11 modules: dedup signing, the instance builder and the WordPiece document encoder
DATA_EXT_SOURCES = {
    "data_pipeline._native_dedup": "csrc/data_pipeline/dedup.cpp",
    "data_pipeline._native_instances": "csrc/data_pipeline/instances.cpp",
    "data_pipeline._native_wordpiece": "csrc/data_pipeline/wordpiece.cpp",
}


def _data_extensions():
    """The torch-free pybind11 extensions, or [] when pybind11 is missing."""
    try:
        import pybind11
    except ImportError as e:
        if DATA_NATIVE_REQUIRED:
            raise RuntimeError(f"pybind11 not importable ({e}), and {', '.join(DATA_EXT_SOURCES)} must be built: "
                               f"{DATA_NATIVE_WHY} (BERTDIST_DATA_NATIVE=optional falls back to the Python reference)")
        _log(f"pybind11 not importable ({e}); {', '.join(DATA_EXT_SOURCES)} not built "
             "(the data pipeline uses its Python reference)")
        return []
    if native_build.cxx_compiler() is None and not DATA_NATIVE_REQUIRED:
        _log(f"{', '.join(DATA_EXT_SOURCES)} not built: {DATA_NATIVE_WHY} (the data pipeline uses its Python reference)")
        return []
    _log(f"{', '.join(DATA_EXT_SOURCES)}: {'a failed build is an error' if DATA_NATIVE_REQUIRED else 'optional'} "
         f"({DATA_NATIVE_WHY})")
    # -O3 but no -march=native: the modules must run on any x86-64 machine they are copied to.
    return [
        Extension(name, [source], include_dirs=[pybind11.get_include()], language="c++",
                  depends=sorted(str(h) for h in Path("csrc/data_pipeline").glob("*.h")),  # rebuild on a header edit
                  extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden"])
        for name, source in DATA_EXT_SOURCES.items()
    ]


def _build_data_extension(cmd, ext) -> bool:
    """Build ``ext`` with setuptools' plain build_extension (no torch flags); False on a failure
    that the policy allows (no compiler, or BERTDIST_DATA_NATIVE=optional), else raise."""
    try:
        PlainBuildExt.build_extension(cmd, ext)
        return True
    except Exception as e:  # compiler/linker errors surface as various exception types
        _log(f"{ext.name} build failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        if DATA_NATIVE_REQUIRED:
            raise RuntimeError(f"{ext.name} failed to build and must: {DATA_NATIVE_WHY} "
                               "(BERTDIST_DATA_NATIVE=optional falls back to the Python reference)") from e
        _log(f"{ext.name} NOT built ({DATA_NATIVE_WHY}): the data pipeline falls back to its Python reference for it")
        return False


DATA_EXTS = _data_extensions()
EXT, CPU_FALLBACK, CE = _extensions() if EXTENSIONS == "all" else (None, None, None)


def _emu_extension(ce):
    """The emulated-kernel extension, or None (with the reason logged) when it cannot be built here."""
    ok, why = bc.emu_build_reason()
    if not ok:
        _log(f"{bc.EMU_EXT_NAME} NOT built: {why} (kernels=emulated and its tests will say so)")
        return None
    _log(f"{bc.EMU_EXT_NAME}: {why}")
    return ce.CppExtension(
        bc.EMU_EXT_NAME,
        [f"csrc/{s}" for s in bc.EMU_EXT_SOURCES],
        extra_compile_args={"cxx": bc.emu_cxx_flags()},
        extra_link_args=["-fopenmp"],
        include_dirs=bc.emu_include_dirs(),
    )


EMU_EXT = _emu_extension(CE) if CE is not None else None


def _split_data_extension(cmd):
    """Build the data extensions first, each on its own; leave only the torch extension(s) in
    ``cmd``. Returns the data extensions that built (to be put back, so an in-place build copies them)."""
    data = [e for e in cmd.extensions if e.name in DATA_EXT_SOURCES]
    cmd.extensions = [e for e in cmd.extensions if e.name not in DATA_EXT_SOURCES]
    return [e for e in data if _build_data_extension(cmd, e)]


if EXT is not None:

    class BuildExt(CE.BuildExtension):
        """torch's BuildExtension (ninja), degrading CUDA -> CPU-only -> no extension; the data
        extension is built before it (torch's build patches the compiler it would otherwise share)."""

        def build_extensions(self):
            data_built = _split_data_extension(self)
            emu = [e for e in self.extensions if e.name == bc.EMU_EXT_NAME]
            self.extensions = [e for e in self.extensions if e.name != bc.EMU_EXT_NAME]
            self._build_torch_extension()
            emu_built = self._build_emu_extension(emu)
            self.extensions = data_built + self.extensions + emu_built

        def _build_emu_extension(self, emu):
            """Builds bertdist._C_emu on its own (its objects in their own folder: it compiles
            bindings.cpp with other flags); a failure costs only that module."""
            if not emu:
                return []
            built, temp = self.extensions, self.build_temp
            self.extensions, self.build_temp = emu, os.path.join(temp, "emu")
            try:
                super().build_extensions()
                return emu
            except Exception as e:  # compiler/linker errors surface as various exception types
                _log(f"{bc.EMU_EXT_NAME} build failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                _log(f"{bc.EMU_EXT_NAME} NOT built: kernels=emulated is unavailable, the rest is unaffected")
                return []
            finally:
                self.extensions, self.build_temp = built, temp

        def _build_torch_extension(self):
            if not self.extensions:
                return
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

    build_ext_cmd = BuildExt.with_options(use_ninja=True)
else:

    class BuildExt(PlainBuildExt):
        """No torch, or BERTDIST_EXTENSIONS=data: only the data extensions."""

        def build_extensions(self):
            self.extensions = _split_data_extension(self)

    build_ext_cmd = BuildExt

ext_modules = DATA_EXTS + ([EXT] if EXT is not None else []) + ([EMU_EXT] if EMU_EXT is not None else [])
# a data-only build has its own build folder: build/lib of a full build holds bertdist._C, which
# would otherwise go into the wheel
options = {"build": {"build_base": str(ROOT / "build" / "data-only")}} if EXTENSIONS == "data" else {}
setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext_cmd} if ext_modules else {}, options=options)
