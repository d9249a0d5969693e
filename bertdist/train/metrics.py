"""Run logging on rank 0: JSON-lines metrics, TensorBoard scalars, a progress bar; device peaks for MFU."""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Dense peak FLOP/s per device (vendor datasheets, no 2:4 sparsity): tensor-core peak for
# bf16/fp16, plain FP32 (no TF32) for fp32. Matched against torch.cuda.get_device_name() in
# order, whole words, so that the PCIe and NVL parts are not taken for SXM ones ("H100 PCIe"
# before "H100"), nor an A10G for an A10.
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"\bGB200\b", {"bf16": 2500e12, "fp16": 2500e12, "fp32": 90e12}),  # per GPU, 1,200 W
    (r"\bB200\b", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12}),  # HGX B200, 1,000 W
    (r"\bB100\b", {"bf16": 1750e12, "fp16": 1750e12, "fp32": 60e12}),
    (r"\bH200\b.*\bNVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12}),
    (r"\bH100\b.*\bNVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12}),
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.5e12, "fp16": 756.5e12, "fp32": 51.2e12}),
    (r"\b(GH200|H200|H100|H800)\b", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),  # SXM
    (r"\b(A100|A800)\b", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    (r"\bL40S\b", {"bf16": 362.05e12, "fp16": 362.05e12, "fp32": 91.6e12}),
    (r"\bL40\b", {"bf16": 181e12, "fp16": 181e12, "fp32": 90.5e12}),
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    (r"\bA10\b", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    (r"\bA30\b", {"bf16": 165e12, "fp16": 165e12, "fp32": 10.3e12}),
    (r"\bV100\b", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
]


def gpu_peak(name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the GPU named ``name`` at ``precision``, or None if unknown."""
    for pattern, peaks in GPU_PEAKS:
        if re.search(pattern, name):
            return peaks.get(precision) or None
    return None


def _cpu_peak() -> tuple[float, str]:
    """cores x clock x FLOPs/cycle (FMA: 32 fp32 FLOPs/cycle with AVX2, 64 with AVX-512)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mhz, flags = 2000.0, ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"cpu MHz\s*:\s*([\d.]+)", text)
        mhz = float(m.group(1)) if m else mhz
        f = re.search(r"flags\s*:\s*(.*)", text)
        flags = f.group(1) if f else ""
    except OSError:
        pass
    per_cycle = 64 if "avx512f" in flags.split() else 32
    peak = cores * mhz * 1e6 * per_cycle
    return peak, f"CPU: {cores} cores x {mhz / 1000:.2f} GHz x {per_cycle} FLOP/cycle"


def device_peak_flops(device: torch.device, precision: str, override_tflops: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s, how it was determined) for MFU."""
    if override_tflops:
        return override_tflops * 1e12, f"configured peak {override_tflops} TFLOP/s"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, precision)
        if peak:
            return peak, f"{name}: {peak / 1e12:.1f} TFLOP/s dense {precision} (datasheet)"
        return float("nan"), f"{name}: unknown peak for {precision} (set logging.device_peak_tflops)"
    return _cpu_peak()


class RunLogger:
    """Rank 0 writes; other ranks hold a disabled logger so call sites need no rank checks."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, progress: str, total_steps: int,
                 initial_step: int = 0):
        self.enabled = enabled
        self.tb = None
        self.bar = None
        self.jsonl = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if progress == "tqdm":
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="pretrain", unit="step",
                            dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
        elif progress == "rich":
            from rich.progress import Progress

            self._rich = Progress()
            self._rich.start()
            self._rich_task = self._rich.add_task("pretrain", total=total_steps, completed=initial_step)
            self.bar = self._rich

    def record(self, kind: str, step: int, values: dict[str, Any], tensorboard: bool = True) -> None:
        if not self.enabled:
            return
        row = {"kind": kind, "step": step, "time": time.time(), **values}
        self.jsonl.write(json.dumps(row, allow_nan=True) + "\n")
        if tensorboard and self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        if not self.enabled or self.bar is None:
            return
        text = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}
        if hasattr(self.bar, "set_postfix"):
            self.bar.n = step
            self.bar.set_postfix(text, refresh=False)
            self.bar.refresh()
        else:
            self.bar.update(self._rich_task, completed=step, description=f"pretrain {text}")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and hasattr(self.bar, "write"):
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            if hasattr(self.bar, "close"):
                self.bar.close()
            else:
                self.bar.stop()
        if self.tb is not None:
            self.tb.close()
        self.jsonl.close()
