"""The target image of a GPU kit: its Python, platform tag and installed packages (a YAML manifest).

A site's GPU nodes run a fixed image with no package index; the kit supplies, as wheels, only
what bertdist needs that the image lacks. ``configs/images/`` holds the manifests; a user writes
one for their site from ``python -m pip list --format=freeze`` on a node. Config layer: imports
neither torch nor Beam.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from bertdist.config import ConfigError, from_dict, load_yaml


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``PyYAML`` -> ``pyyaml``, ``typing_extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass
class ImageManifest:
    name: str  # names the image in the kit and the report
    python: str  # major.minor the node runs, e.g. "3.12"
    platform: str  # the newest platform tag the node accepts, e.g. manylinux_2_28_x86_64
    packages: dict[str, Any]  # distribution -> version, or None where only the name is known
    python_full: str | None = None  # major.minor.patch, for requirement markers (default major.minor.0)
    cuda: str | None = None  # the image's CUDA toolkit (nvcc) major.minor
    torch_cuda_archs: str = "9.0"  # what the node's GPUs are built for (TORCH_CUDA_ARCH_LIST syntax)
    cores: int = 16  # build jobs on the node
    missing: list[str] = dataclasses.field(default_factory=list)  # documentation only

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python):
            raise ConfigError(f"image {self.name!r}: python {self.python!r} is not major.minor like 3.12")
        if not re.fullmatch(r"(manylinux_\d+_\d+|manylinux2014|manylinux1)_(x86_64|aarch64)", self.platform):
            raise ConfigError(f"image {self.name!r}: platform {self.platform!r} is not a manylinux tag like "
                              "manylinux_2_28_x86_64")
        self.packages = {canonical(k): (None if v is None else str(v)) for k, v in (self.packages or {}).items()}
        clash = sorted(set(self.packages) & {canonical(m) for m in self.missing})
        if clash:
            raise ConfigError(f"image {self.name!r}: {clash} listed both as packages and as missing")

    @property
    def python_tag(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def arch(self) -> str:
        return re.search(r"(x86_64|aarch64)$", self.platform).group(1)

    @property
    def glibc(self) -> tuple[int, int]:
        """The newest glibc the node's platform tag admits (manylinux2014 = 2.17, manylinux1 = 2.5)."""
        if self.platform.startswith("manylinux2014"):
            return (2, 17)
        if self.platform.startswith("manylinux1"):
            return (2, 5)
        major, minor = self.platform.split("_")[1:3]
        return int(major), int(minor)

    def has(self, dist: str) -> bool:
        return canonical(dist) in self.packages


def load_image(path: str | Path) -> ImageManifest:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: image manifest not found (shipped ones: configs/images/*.yaml)")
    try:
        return from_dict(ImageManifest, load_yaml(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
