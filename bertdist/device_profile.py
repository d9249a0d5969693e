"""The device a run's decisions are made for, as data: ``DeviceProfile``.

Kernel candidates, their support checks, the fused-optimizer choice and ``pretrain --plan``
take a profile instead of reading ``torch.cuda`` in place. The real path is ``detect()``,
which reads torch and the CUDA toolkit once; ``PROFILES`` / ``by_name`` give fixed profiles
of the GPUs the recipes target, so the CUDA branch of those decisions runs (and is tested)
on a machine without a GPU.

This module imports torch only inside ``detect()``.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import subprocess

DEVICE_TYPES = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One device type as the decisions see it.

    ``capability``: the CUDA compute capability (major, minor), None on CPU. ``memory_gib``:
    memory of one device (GPU memory; host memory on CPU, 0 when unknown). ``toolkit``: the
    CUDA toolkit's version (``nvcc --version``) that would JIT-build extensions, None without
    one. ``torch_cuda``: ``torch.version.cuda`` (None for a CPU build of torch). ``visible_count``:
    devices of this type one process can see. ``peak_tflops``: dense peak per precision
    ("bf16", "fp16", "fp32"), for MFU and estimates; empty when unknown.
    """

    type: str
    name: str
    capability: tuple[int, int] | None
    memory_gib: float
    toolkit: str | None
    torch_cuda: str | None
    torch_version: str
    visible_count: int
    bf16_supported: bool
    peak_tflops: dict[str, float] = dataclasses.field(default_factory=dict, hash=False, compare=True)

    def __post_init__(self) -> None:
        if self.type not in DEVICE_TYPES:
            raise ValueError(f"DeviceProfile.type must be one of {DEVICE_TYPES}, got {self.type!r}")
        if self.type == "cuda" and self.capability is None:
            raise ValueError(f"DeviceProfile {self.name!r}: a CUDA profile needs a compute capability")
        if self.visible_count < 0 or self.memory_gib < 0:
            raise ValueError(f"DeviceProfile {self.name!r}: visible_count {self.visible_count} and "
                             f"memory_gib {self.memory_gib} must be >= 0")

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def arch(self) -> str | None:
        """``sm_90`` for capability (9, 0); None on CPU."""
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else None

    def with_(self, **changes) -> "DeviceProfile":
        """A copy with some fields changed (e.g. ``toolkit="12.4"`` to model a mismatched node)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        return d


# What the shipped wheels are built against: torch 2.14.1 with CUDA 13.0, toolkit 13.0.
_TORCH = "2.14.1"
_CUDA = "13.0"

PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile(
        type="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0), memory_gib=79.1, toolkit=_CUDA,
        torch_cuda=_CUDA, torch_version=_TORCH, visible_count=8, bf16_supported=True,
        peak_tflops={"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}),
    "a100": DeviceProfile(
        type="cuda", name="NVIDIA A100-SXM4-80GB", capability=(8, 0), memory_gib=79.2, toolkit=_CUDA,
        torch_cuda=_CUDA, torch_version=_TORCH, visible_count=8, bf16_supported=True,
        peak_tflops={"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    "cpu": DeviceProfile(
        type="cpu", name="cpu", capability=None, memory_gib=0.0, toolkit=None, torch_cuda=None,
        torch_version=_TORCH, visible_count=1, bf16_supported=True, peak_tflops={}),
}


def by_name(name: str) -> DeviceProfile:
    """The fixed profile called ``name`` (case-insensitive), or a ValueError listing the names."""
    try:
        return PROFILES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; profiles are {', '.join(sorted(PROFILES))}") from None


def toolkit_version() -> str | None:
    """The CUDA toolkit's version ("13.0") from ``nvcc --version``, or None without one."""
    from bertdist.ops import _build_config as bc

    home, _ = bc.find_cuda_home()
    if home is None:
        return None
    try:
        out = subprocess.run([f"{home}/bin/nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _host_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


@functools.lru_cache(maxsize=1)
def detect() -> DeviceProfile:
    """The profile of this machine's device 0 (CUDA when torch sees a GPU, else CPU), read once."""
    import torch

    toolkit = toolkit_version()
    torch_cuda = torch.version.cuda or None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = torch.cuda.get_device_properties(0)
        name = props.name
        from bertdist.train.metrics import gpu_peak

        peaks = {p: gpu_peak(name, p) / 1e12 for p in ("bf16", "fp16", "fp32") if gpu_peak(name, p)}
        return DeviceProfile(
            type="cuda", name=name, capability=(props.major, props.minor),
            memory_gib=round(props.total_memory / 2**30, 1), toolkit=toolkit, torch_cuda=torch_cuda,
            torch_version=torch.__version__, visible_count=torch.cuda.device_count(),
            bf16_supported=bool(torch.cuda.is_bf16_supported()), peak_tflops=peaks)
    return DeviceProfile(
        type="cpu", name="cpu", capability=None, memory_gib=_host_memory_gib(), toolkit=toolkit,
        torch_cuda=torch_cuda, torch_version=torch.__version__, visible_count=1, bf16_supported=True,
        peak_tflops={})


def for_device_type(device_type: str) -> DeviceProfile:
    """This machine's profile for ``device_type``: ``detect()`` when it is of that type; a CUDA
    profile with no visible device on a machine without a GPU; the host as a CPU profile."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"unknown device type {device_type!r}; types are {', '.join(DEVICE_TYPES)}")
    here = detect()
    if here.type == device_type:
        return here
    if device_type == "cuda":
        return here.with_(type="cuda", name="no CUDA device", capability=(0, 0), memory_gib=0.0, visible_count=0,
                          bf16_supported=False, peak_tflops={})
    return here.with_(type="cpu", name="cpu", capability=None, memory_gib=_host_memory_gib(), visible_count=1,
                      bf16_supported=True, peak_tflops={})


__all__ = ["DeviceProfile", "PROFILES", "by_name", "detect", "for_device_type", "toolkit_version"]
