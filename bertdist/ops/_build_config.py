"""How the bertdist._C extension is compiled: sources, flags, CUDA toolkit and arch list.

Shared by setup.py (ahead-of-time build) and ``_extension.py`` (JIT fallback). It imports
nothing heavy at module level so that setup.py can load it by file path without importing
the package.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
CPU_SOURCES = ("bindings.cpp", "cpu_layer_norm.cpp", "cpu_attention.cpp", "cpu_flat_optim.cpp")
# Kept free of torch headers so nvcc compiles them quickly.
CUDA_SOURCES = ("cuda_layer_norm.cu", "cuda_attention.cu", "cuda_flat_optim.cu")
EXT_NAME = "bertdist._C"

# BERTDIST_CUDA_ARCHS uses TORCH_CUDA_ARCH_LIST's syntax: "8.0;9.0+PTX" (the default) means
# SASS for sm_80 and sm_90 plus PTX for compute_90, which later GPUs JIT-compile. An "a" suffix
# (9.0a, 10.0a) targets one GPU's architecture-specific features (wgmma, tcgen05), "f" (10.0f,
# CUDA 12.9+) the family. Unset, TORCH_CUDA_ARCH_LIST is used when set, else the default.
ARCH_ENV = "BERTDIST_CUDA_ARCHS"
TORCH_ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
DEFAULT_ARCHS = "8.0;9.0+PTX"
_ARCH_ITEM = re.compile(r"(\d+)\.(\d)([af]?)(\+PTX)?")
# TORCH_CUDA_ARCH_LIST's names for the architectures the kernels take (sm_80+), as torch expands them.
_NAMED_ARCHS = {"Ampere": "8.0;8.6+PTX", "Ampere+Tegra": "8.7", "Ada": "8.9+PTX", "Hopper": "9.0+PTX",
                "Blackwell": "10.0;10.3;12.0;12.1+PTX", "Blackwell+Tegra": "11.0"}
# BERTDIST_CUDA=0 forces a CPU-only build; 1 makes a failing CUDA build an error.
CUDA_ENV = "BERTDIST_CUDA"


def find_cuda_home() -> tuple[str | None, str]:
    """The CUDA toolkit folder, or None and why not.

    CUDA_HOME / CUDA_PATH win. Otherwise follow ``nvcc`` on PATH: a symlink is resolved, and
    a wrapper script that execs the real nvcc (as on the build machine) is read for its path.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if (Path(home) / "bin" / "nvcc").exists():
                return home, f"{var}={home}"
            return None, f"{var}={home} has no bin/nvcc"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, "nvcc not found on PATH and CUDA_HOME unset"
    real = Path(os.path.realpath(nvcc))
    try:
        head = real.read_bytes()[:4096]
    except OSError as e:
        return None, f"cannot read {real}: {e}"
    if head.startswith(b"#!"):
        m = re.search(rb"(/[^\s\"']+)/bin/nvcc\b", head)
        if not m:
            return None, f"{nvcc} is a script that names no .../bin/nvcc"
        home = m.group(1).decode()
    else:
        home = str(real.parent.parent)
    if not (Path(home) / "include" / "cuda_runtime.h").exists():
        return None, f"{home} (from {nvcc}) has no include/cuda_runtime.h"
    return home, f"from {nvcc}"


def arch_spec() -> tuple[str, str]:
    """(arch list, where it came from): BERTDIST_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else the default."""
    for var in (ARCH_ENV, TORCH_ARCH_ENV):
        value = (os.environ.get(var) or "").strip()
        if value:
            return value, var
    return DEFAULT_ARCHS, "default"


def arch_flags(spec: str | None = None) -> tuple[list[str], str]:
    """nvcc -gencode flags and a short label for an arch list (default: ``arch_spec()``)."""
    source = "argument"
    if spec is None:
        spec, source = arch_spec()
    flags, labels = [], []
    items = [i for i in re.split(r"[;\s,]+", spec.strip()) if i]
    for item in [x for i in items for x in _NAMED_ARCHS.get(i, i).split(";")]:
        m = _ARCH_ITEM.fullmatch(item)
        if not m:
            where = f"{source}={spec!r}" if source in (ARCH_ENV, TORCH_ARCH_ENV) else repr(spec)
            raise ValueError(f"{where}: bad arch {item!r} (expected major.minor with an optional a or f suffix "
                             f"and +PTX, e.g. 8.0;9.0a;10.0f;9.0+PTX, or one of {', '.join(_NAMED_ARCHS)})")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        labels.append(f"sm_{num}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
            labels.append(f"compute_{num}")
    if not flags:
        raise ValueError(f"{source}: no architecture in {spec!r}")
    return flags, ",".join(labels)


def extra_include_dirs() -> list[str]:
    """Headers torch's CUDA includes expect but the toolkit may lack (cusparse.h comes from pip)."""
    dirs = []
    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for sub in sorted(Path(loc).glob("cu*/include")):
            dirs.append(str(sub))
    return dirs


def cxx_flags() -> list[str]:
    # No -std: torch adds the standard its headers need (C++20 for torch 2.14).
    return ["-O3", "-fopenmp"]


def nvcc_flags(archs: list[str]) -> list[str]:
    # No --use_fast_math: the fp32 parity tests hold the kernels to ~1e-5 of the reference.
    return ["-O3", "-lineinfo", "--expt-relaxed-constexpr", *archs]


def write_build_info(folder: Path, with_cuda: bool, archs: str, note: str) -> Path:
    """A generated header the bindings compile in, so the module can say how it was built."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bertdist_build_info.h"

    def c_str(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'

    text = (
        "// Generated by bertdist/ops/_build_config.py; do not edit.\n#pragma once\n"
        f"#define BERTDIST_CUDA_ARCHS {c_str(archs if with_cuda else '')}\n"
        f"#define BERTDIST_BUILD_NOTE {c_str(note)}\n"
    )
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def cuda_build_reason() -> tuple[bool, str]:
    """Whether to try the CUDA kernels here, and why (not)."""
    if os.environ.get(CUDA_ENV) == "0":
        return False, f"{CUDA_ENV}=0"
    try:
        import torch
    except ImportError as e:
        return False, f"torch not importable: {e}"
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is a CPU build"
    home, why = find_cuda_home()
    if home is None:
        return False, f"no CUDA toolkit: {why}"
    return True, f"CUDA toolkit {home} ({why}), torch CUDA {torch.version.cuda}"


# ---------------------------------------------------------------- the emulated CUDA kernels

# bertdist._C_emu: the same bindings and CUDA kernel sources, compiled by the host C++
# compiler for the SIMT emulator (csrc/emu), so the kernels' own code runs on CPU tensors.
EMU_EXT_NAME = "bertdist._C_emu"
# BERTDIST_EMU=0 skips the emulated extension.
EMU_ENV = "BERTDIST_EMU"
# Everything but the Python bindings; also the standalone check driver's sources (with driver.cpp).
EMU_CORE_SOURCES = (
    "emu/emu.cpp",
    "emu/fiber.cpp",
    "emu/layer_norm.cpp",
    "emu/attention.cpp",
    "emu/flat_optim.cpp",
    "emu/selftest.cpp",
    "emu/checks.cpp",
    "emu/optim_checks.cpp",
    "cpu_layer_norm.cpp",
    "cpu_attention.cpp",
    "cpu_flat_optim.cpp",
)
EMU_EXT_SOURCES = ("bindings.cpp",) + EMU_CORE_SOURCES
EMU_DRIVER_SOURCES = EMU_CORE_SOURCES + ("emu/driver.cpp",)
# The three headers the kernels need from the toolkit in host mode (they pull in the rest).
CUDA_HOST_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "cuda_runtime_api.h")


def find_cuda_headers() -> tuple[str | None, str]:
    """A folder with the CUDA headers the kernels include in host mode, or None and why not.

    Tried in order: the toolkit (CUDA_HOME, CUDA_PATH, nvcc on PATH), /usr/local/cuda, and the
    headers the CUDA wheels of torch install (nvidia/cu*/include, nvidia/cuda_runtime/include).
    Only headers are needed: no nvcc, no driver, no GPU.
    """
    candidates: list[tuple[str, str]] = []
    home, why = find_cuda_home()
    if home:
        candidates.append((str(Path(home) / "include"), f"CUDA toolkit ({why})"))
    candidates.append(("/usr/local/cuda/include", "/usr/local/cuda"))
    spec = importlib.util.find_spec("nvidia")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        for sub in sorted(Path(loc).glob("cu*/include")) + sorted(Path(loc).glob("cuda_runtime/include")):
            candidates.append((str(sub), f"the {sub.parent.name} wheel"))
    for folder, source in candidates:
        if all((Path(folder) / h).exists() for h in CUDA_HOST_HEADERS):
            return folder, source
    tried = ", ".join(f for f, _ in candidates) or "nothing"
    return None, f"no folder with {', '.join(CUDA_HOST_HEADERS)} (tried {tried}; set CUDA_HOME)"


def emu_build_reason() -> tuple[bool, str]:
    """Whether the emulated extension can be built here, and why (not)."""
    if os.environ.get(EMU_ENV) == "0":
        return False, f"{EMU_ENV}=0"
    if not sys.platform.startswith("linux"):
        return False, f"the emulator's fibers and guard pages need Linux (this is {sys.platform})"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler ({cxx} not on PATH)"
    headers, why = find_cuda_headers()
    if headers is None:
        return False, f"CUDA headers not found: {why}"
    return True, f"CUDA headers from {why} ({headers})"


def emu_cxx_flags() -> list[str]:
    # -O2, not -O3: -O3's loop unswitching can copy a __syncwarp into lane-dependent paths, which
    # the emulator (keying collectives by call site) would report as divergence. It comes last,
    # after the -O3 setuptools passes. -fno-strict-aliasing: the kernels reinterpret element
    # pointers as vectors, as CUDA code does. #pragma unroll and maybe-uninitialized warnings are
    # nvcc-isms in host mode.
    return ["-O2", "-fopenmp", "-DBERTDIST_EMU", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
            "-Wno-maybe-uninitialized"]


def emu_include_dirs(csrc: Path = CSRC) -> list[str]:
    headers, why = find_cuda_headers()
    if headers is None:
        raise RuntimeError(f"cannot build the emulated kernels: CUDA headers not found: {why}")
    return [str(csrc), headers]
