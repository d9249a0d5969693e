"""Incremental builds of the emulated CUDA kernels (csrc/emu) outside ``pip install``.

``pip install -e .`` builds ``bertdist._C_emu`` with the package (setup.py). This module builds
the same things from any copy of ``csrc/`` into any folder, rebuilding only what changed
(ninja), for ``make emu-test``, ``make emu-sanitize`` and the mutation tests:

- ``driver``: ``check_kernels``, the standalone check program (no Python, no torch
  libraries; torch's headers only for the CPU twins' c10::Half), optionally under
  AddressSanitizer + UndefinedBehaviorSanitizer;
- ``ext``: the ``_C_emu`` extension module, loaded from its path through ``BERTDIST_EMU_EXT``.

    python -m bertdist.ops._emu_build driver [--csrc csrc] [--out build/emu] [--sanitize]
    python -m bertdist.ops._emu_build ext [--csrc csrc] [--out build/emu]

Each prints the path it built.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from bertdist.ops import _build_config as bc

DEFAULT_OUT = bc.REPO / "build" / "emu"
DRIVER = "check_kernels"
SANITIZED_DRIVER = "check_kernels_sanitized"
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def _jobs() -> str:
    return os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)


def _torch_include() -> str:
    """torch's header folder (the CPU twins use c10::Half), found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed: the CPU twins need its c10 headers")
    return str(Path(spec.submodule_search_locations[0]) / "include")


def _ninja_file(csrc: Path, out: Path, sanitize: bool) -> tuple[str, Path]:
    cxx = os.environ.get("CXX", "c++")
    flags = ["-std=c++20", *bc.emu_cxx_flags(), "-Wall"]
    if sanitize:  # -O1 -g: readable sanitizer reports at a bearable speed
        flags = [f for f in flags if not f.startswith("-O")] + ["-O1", "-g", *SANITIZE_FLAGS]
    includes = [*bc.emu_include_dirs(csrc), _torch_include()]
    flags += [f"-I{d}" for d in includes]
    ldflags = ["-fopenmp", *(SANITIZE_FLAGS[:1] if sanitize else [])]
    name = SANITIZED_DRIVER if sanitize else DRIVER
    objdir = "obj_sanitized" if sanitize else "obj"
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {cxx}",
        f"cflags = {shlex.join(flags)}",
        f"ldflags = {shlex.join(ldflags)}",
        "rule cc",
        "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = CXX $in",
        "rule link",
        "  command = $cxx $in -o $out $ldflags",
        "  description = LINK $out",
    ]
    objs = []
    for src in bc.EMU_DRIVER_SOURCES:
        obj = f"{objdir}/{src.replace('/', '_').rsplit('.', 1)[0]}.o"
        lines.append(f"build {obj}: cc {csrc.resolve() / src}")
        objs.append(obj)
    lines.append(f"build {name}: link {' '.join(objs)}")
    lines.append(f"default {name}")
    return "\n".join(lines) + "\n", out / name


def build_driver(csrc: Path = bc.CSRC, out: Path = DEFAULT_OUT, sanitize: bool = False) -> Path:
    """Builds (or brings up to date) the check driver; returns its path."""
    ok, why = bc.emu_build_reason()
    if not ok:
        raise RuntimeError(f"cannot build the emulated kernels here: {why}")
    out.mkdir(parents=True, exist_ok=True)
    text, binary = _ninja_file(Path(csrc), out, sanitize)
    ninja_file = out / ("build_sanitized.ninja" if sanitize else "build.ninja")
    if not ninja_file.exists() or ninja_file.read_text() != text:
        ninja_file.write_text(text)
    ninja = shutil.which("ninja")
    if ninja is None:
        raise RuntimeError("ninja not found on PATH (it is a dependency of this package: pip install ninja)")
    r = subprocess.run([ninja, "-C", str(out), "-f", ninja_file.name, "-j", _jobs()], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building {binary} failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}")
    return binary


def build_extension(csrc: Path = bc.CSRC, out: Path = DEFAULT_OUT) -> Path:
    """Builds (or brings up to date) the _C_emu extension in ``out/ext``; returns the module's path."""
    ok, why = bc.emu_build_reason()
    if not ok:
        raise RuntimeError(f"cannot build the emulated kernels here: {why}")
    # cpp_extension warns on import that it found no CUDA runtime: this build needs none.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import cpp_extension as ce

    build_dir = out / "ext"
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", _jobs())
    ce.load(
        name="_C_emu",
        sources=[str(Path(csrc).resolve() / s) for s in bc.EMU_EXT_SOURCES],
        extra_cflags=bc.emu_cxx_flags(),
        extra_include_paths=bc.emu_include_dirs(Path(csrc).resolve()),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        with_cuda=False,
        verbose=False,
    )
    return build_dir / "_C_emu.so"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bertdist.ops._emu_build", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["driver", "ext"])
    ap.add_argument("--csrc", type=Path, default=bc.CSRC, help="the csrc/ folder to build from")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the build folder")
    ap.add_argument("--sanitize", action="store_true", help="driver: AddressSanitizer + UndefinedBehaviorSanitizer")
    a = ap.parse_args(argv)
    try:
        path = build_driver(a.csrc, a.out, a.sanitize) if a.what == "driver" else build_extension(a.csrc, a.out)
    except RuntimeError as e:
        print(f"emu build: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
