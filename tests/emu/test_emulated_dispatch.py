"""kernels: emulated in the seam, the model config and `bertdist info`."""
from __future__ import annotations

import pytest

from bertdist.config.schema import ConfigError, from_dict
from bertdist.model.config import BertConfig
from bertdist.ops import emulated, resolve_kernels
from bertdist.ops.dispatch import emulated_status
from tests.emu._util import emu


def test_resolves_to_the_emulated_ops_on_cpu():
    emu()
    ks = resolve_kernels("emulated", "cpu")
    assert set(ks.sources.values()) == {"emulated"}
    assert ks.attention is emulated.attention and ks.varlen_attention is emulated.varlen_attention
    assert all(s.usable and "SIMT emulator" in s.reason for s in emulated_status("cpu"))


def test_refused_on_cuda_with_the_reason():
    emu()
    with pytest.raises(RuntimeError, match=r"kernels=emulated requested on cuda but: layer_norm: the emulated CUDA "
                                           r"kernels take CPU tensors, not 'cuda' ones"):
        resolve_kernels("emulated", "cuda")
    with pytest.raises(ValueError, match=r"kernels must be one of reference\|fused\|auto\|emulated, got 'gpu'"):
        resolve_kernels("gpu", "cpu")


def test_config_accepts_emulated():
    assert from_dict(BertConfig, {"preset": "tiny", "kernels": "emulated"}).kernels == "emulated"
    with pytest.raises(ConfigError, match=r"'gpu' is not one of \['reference', 'fused', 'auto', 'emulated'\]"):
        from_dict(BertConfig, {"preset": "tiny", "kernels": "gpu"})


def test_info_says_whether_built():
    C = emu()
    from bertdist.cli.info import collect

    line = collect()["emulated_kernels"]
    assert line.startswith("built (") and "emulated CUDA device" in line, line
    assert C.build_info()["emulated"] and not C.with_cuda()
