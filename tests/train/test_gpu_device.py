"""GPU-only decisions of the trainer, checked on CPU: one rank per visible GPU, the MFU peak table."""
from __future__ import annotations

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.train.distributed import cuda_device_for
from bertdist.train.metrics import gpu_peak


def test_a_rank_beyond_the_visible_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cuda_device_for(0) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 1 but this node has 1 visible CUDA device\(s\) "
                                          r"\(CUDA_VISIBLE_DEVICES=0\).*--nproc_per_node 1"):
        cuda_device_for(1)


@pytest.mark.parametrize("name,precision,tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA B200", "bf16", 2250.0),
    ("NVIDIA B200", "fp32", 80.0),
    ("NVIDIA GB200", "bf16", 2500.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA A10", "bf16", 125.0),
])
def test_peak_flops_by_device_name(name, precision, tflops):
    assert gpu_peak(name, precision) == pytest.approx(tflops * 1e12)


def test_unknown_or_unsupported_peaks_are_none_not_a_wrong_number():
    assert gpu_peak("NVIDIA A10G", "bf16") is None  # not an A10
    assert gpu_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert gpu_peak("Some Future GPU", "bf16") is None
