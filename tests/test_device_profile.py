import dataclasses

import pytest

from bertdist import device_profile as dp


def test_shipped_profiles_are_consistent():
    assert {"h100", "a100", "cpu"} <= set(dp.PROFILES)
    h100, a100, cpu = dp.by_name("h100"), dp.by_name("a100"), dp.by_name("cpu")
    assert (h100.type, h100.capability, h100.arch) == ("cuda", (9, 0), "sm_90")
    assert (a100.type, a100.capability, a100.arch) == ("cuda", (8, 0), "sm_80")
    assert (cpu.type, cpu.capability, cpu.arch, cpu.torch_cuda) == ("cpu", None, None, None)
    for p in (h100, a100):
        assert p.is_cuda and p.bf16_supported and p.visible_count >= 1 and p.memory_gib > 70
        assert p.toolkit == p.torch_cuda  # the wheels' toolkit and torch's CUDA agree
        assert p.peak_tflops["bf16"] > p.peak_tflops["fp32"] > 0
    assert h100.peak_tflops["bf16"] > a100.peak_tflops["bf16"]


def test_by_name_is_case_insensitive_and_lists_the_names_on_error():
    assert dp.by_name(" H100 ") is dp.PROFILES["h100"]
    with pytest.raises(ValueError) as e:
        dp.by_name("h800")
    for name in ("a100", "cpu", "h100", "'h800'"):
        assert name in str(e.value)


def test_profiles_are_frozen_hashable_and_serialisable():
    h100 = dp.by_name("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        h100.name = "x"
    assert hash(h100) == hash(dp.by_name("h100"))
    mismatched = h100.with_(toolkit="12.4")
    assert mismatched.toolkit == "12.4" and h100.toolkit == "13.0" and mismatched != h100
    d = h100.to_dict()
    assert d["capability"] == [9, 0] and d["type"] == "cuda" and d["peak_tflops"]["fp32"] == 66.9


@pytest.mark.parametrize("bad, match", [
    (dict(type="rocm"), "type must be one of"),
    (dict(capability=None), "needs a compute capability"),
    (dict(visible_count=-1), "visible_count -1"),
])
def test_invalid_profiles_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        dp.by_name("h100").with_(**bad)


def test_detect_reads_this_machine_once():
    import torch

    p = dp.detect()
    assert p is dp.detect()
    assert p.torch_version == torch.__version__
    assert p.torch_cuda == (torch.version.cuda or None)
    if torch.cuda.is_available():
        assert p.type == "cuda" and p.capability == torch.cuda.get_device_capability(0)
    else:
        assert p.type == "cpu" and p.capability is None and p.visible_count == 1


def test_for_device_type_gives_a_cuda_profile_without_devices_on_a_cpu_machine():
    import torch

    cuda = dp.for_device_type("cuda")
    assert cuda.type == "cuda" and cuda.capability is not None
    if not torch.cuda.is_available():
        assert cuda.visible_count == 0 and cuda.name == "no CUDA device"
    assert dp.for_device_type("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown device type 'tpu'; types are cuda, cpu"):
        dp.for_device_type("tpu")
