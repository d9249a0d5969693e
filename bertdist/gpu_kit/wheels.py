"""Wheels for the target image: downloaded for its Python and platform, or built from an sdist
where only one is published (deepspeed), and each checked to install there.

pip matches ``--platform`` tags exactly, so every manylinux tag up to the image's glibc is
offered. A package with no usable wheel and a platform-specific sdist cannot be built for
another Python here: that is an error naming it, never a wheel for the wrong interpreter.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from packaging.tags import Tag
from packaging.utils import parse_wheel_filename

from bertdist.gpu_kit.image import ImageManifest, canonical
from bertdist.gpu_kit.requirements import Needed


class WheelError(RuntimeError):
    """A wheel that cannot be had for the target image; the message names it and why."""


def platform_tags(image: ImageManifest) -> list[str]:
    """Every manylinux tag the image's glibc admits, newest first (pip's --platform list)."""
    major, top = image.glibc
    tags = [f"manylinux_{major}_{m}_{image.arch}" for m in range(top, 4, -1)]
    if image.glibc >= (2, 17):
        tags.append(f"manylinux2014_{image.arch}")
    tags += [f"manylinux2010_{image.arch}", f"manylinux1_{image.arch}"] if image.glibc >= (2, 12) else []
    return tags


def tag_fits(tag: Tag, image: ImageManifest) -> bool:
    """Whether a wheel tag installs on the image's CPython and platform."""
    py_minor = int(image.python.split(".")[1])
    interp, abi, plat = tag.interpreter, tag.abi, tag.platform
    if interp.startswith("py"):
        ok_interp = interp in ("py3", f"py3{py_minor}", "py2.py3")
    elif interp.startswith("cp3"):
        minor = int(interp[3:])
        ok_interp = minor == py_minor or (abi == "abi3" and minor <= py_minor)
    else:
        ok_interp = False
    ok_abi = abi in ("none", "abi3", image.python_tag)
    if plat == "any":
        ok_plat = True
    else:
        ok_plat = plat in platform_tags(image)
    return ok_interp and ok_abi and ok_plat


def wheel_fits(path: Path, image: ImageManifest) -> bool:
    _, _, _, tags = parse_wheel_filename(path.name)
    return any(tag_fits(t, image) for t in tags)


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})


def _tail(proc: subprocess.CompletedProcess, n: int = 6) -> str:
    return " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-n:])


def download(need: Needed, image: ImageManifest, dest: Path) -> Path:
    """A binary wheel of ``need`` for the image, else one built from its sdist; checked to fit."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           "--python-version", image.python, "--implementation", "cp", "--abi", image.python_tag, "--abi", "abi3",
           "--abi", "none"]
    for tag in platform_tags(image):
        cmd += ["--platform", tag]
    got = _run(cmd + [f"{need.name}=={need.version}"])
    how = "downloaded"
    if got.returncode != 0:
        # Only an sdist (deepspeed): build it here without isolation (its setup imports the torch
        # installed here) and no ops compiled in: the node JIT-builds the ones it uses.
        built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                      "--no-binary", need.name, "-w", str(dest), f"{need.name}=={need.version}"],
                     env={"DS_BUILD_OPS": "0"})
        if built.returncode != 0:
            raise WheelError(f"{need.name}=={need.version} ({need.why}): no wheel for {image.python_tag} "
                             f"{image.platform} ({_tail(got, 2)}) and building one from its sdist failed: {_tail(built)}")
        how = "built from its sdist"
    new = [p for p in dest.glob("*.whl")
           if (canonical(parse_wheel_filename(p.name)[0]), str(parse_wheel_filename(p.name)[1])) == (need.name, need.version)]
    if len(new) != 1:
        raise WheelError(f"{need.name}=={need.version}: expected one wheel in {dest}, found {sorted(p.name for p in new)}")
    wheel = new[0]
    if not wheel_fits(wheel, image):
        wheel.unlink()
        raise WheelError(f"{need.name}=={need.version}: the wheel {how} ({wheel.name}) does not install on "
                         f"{image.python_tag} {image.platform}; a platform wheel for that Python is needed")
    return wheel
