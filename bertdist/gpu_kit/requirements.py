"""What a GPU kit ships: the distributions bertdist's GPU training and bench paths import, with
their requirements, that the target image lacks; at the versions of requirements.lock.

The dependency graph is read from the build environment's installed metadata (the ``.venv``
that ``make`` installs from the lock), with environment markers evaluated for the *target*
Python and platform. The walk stops at a package the image has: its own requirements are the
image's business, and the kit never replaces one of the image's packages.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement

from bertdist.gpu_kit.image import ImageManifest, canonical

# The distributions that `bertdist pretrain` on CUDA and `bertdist bench` import (the data
# pipeline's Beam, blingfire and mwparserfromhell are not among them: the kit carries records).
GPU_PATH_ROOTS = ("torch", "deepspeed", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow", "pyyaml",
                  "tensorboard", "tqdm", "matplotlib", "pytest", "ninja", "pybind11", "psutil", "packaging")


@dataclasses.dataclass(frozen=True)
class Needed:
    name: str  # canonical distribution name
    version: str
    why: str  # the chain that pulls it in, e.g. "deepspeed -> pydantic"
    version_from: str  # "requirements.lock" or "installed (not in requirements.lock)"


def read_lock(path: str | Path) -> dict[str, str]:
    """name -> pinned version of a ``name==version`` lock file."""
    pins = {}
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line:
            raise ValueError(f"{path}:{n}: {raw!r} is not name==version")
        name, version = line.split("==", 1)
        pins[canonical(name.split("[")[0].strip())] = version.strip()
    return pins


def target_environment(image: ImageManifest) -> dict[str, str]:
    """PEP 508 marker values of the target node."""
    full = image.python_full or f"{image.python}.0"
    return {"python_version": image.python, "python_full_version": full, "implementation_name": "cpython",
            "implementation_version": full, "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": image.arch, "extra": ""}


def installed_requires(dist: str) -> list[str]:
    try:
        return importlib.metadata.distribution(dist).requires or []
    except importlib.metadata.PackageNotFoundError:
        raise LookupError(f"{dist} is not installed in this environment ({sys.executable}), so its "
                          "requirements cannot be read: build the kit from the project's .venv (make gpu-kit)") from None


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve(image: ImageManifest, lock: dict[str, str], roots=GPU_PATH_ROOTS,
            requires: Callable[[str], list[str]] = installed_requires,
            version_of: Callable[[str], str | None] = installed_version, present: set | None = None) -> list[Needed]:
    """The distributions to ship, sorted by name. Raises when one has no version to pin.
    ``present`` (optional) receives the image's packages that the walk reached."""
    env = target_environment(image)
    needed: dict[str, Needed] = {}
    queue = [(canonical(r), canonical(r)) for r in roots]
    seen = set()
    while queue:
        name, chain = queue.pop(0)
        if name in seen:
            continue
        if image.has(name):
            if present is not None:
                present.add(name)
            continue
        seen.add(name)
        version, source = lock.get(name), "requirements.lock"
        if version is None:
            version, source = version_of(name), "installed (not in requirements.lock)"
        if version is None:
            raise LookupError(f"{name} (needed: {chain}) is neither in requirements.lock nor installed here")
        needed[name] = Needed(name, version, chain, source)
        for text in requires(name):
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # extras and other platforms' requirements
            dep = canonical(req.name)
            queue.append((dep, f"{chain} -> {dep}"))
    return sorted(needed.values(), key=lambda n: n.name)
