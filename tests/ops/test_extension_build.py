"""The extension's build, loading, availability reporting and fallbacks."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bertdist.ops import _build_config as bc
from bertdist.ops import fused, kernel_status, resolve_kernels
from tests.ops._util import ext

REPO = Path(__file__).resolve().parents[2]

# Runs a snippet in a fresh interpreter where `import bertdist._C` fails, as in an install
# whose build produced nothing.
HIDE_PREBUILT = textwrap.dedent(
    """
    import sys
    class _HidePrebuilt:
        def find_spec(self, name, path=None, target=None):
            if name == "bertdist._C":
                raise ImportError("hidden by the test")
    sys.meta_path.insert(0, _HidePrebuilt())
    """
)


def _run_hidden(code: str, env: dict, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE_PREBUILT + textwrap.dedent(code)],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
    )


def test_cpu_availability_and_dispatch():
    ext()
    ok, why = fused.availability("attention", "cpu")
    assert ok and "C++ CPU kernels" in why
    assert fused.availability("no_such_op", "cpu") == (False, "no fused op named 'no_such_op' (have "
                                                       "layer_norm, bias_dropout_add_layer_norm, attention, "
                                                       "varlen_attention)")
    ks = resolve_kernels("fused", "cpu")
    assert set(ks.sources.values()) == {"fused"}
    assert ks.attention is fused.attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_cuda_not_usable_without_device_says_why():
    mod = ext()
    ok, why = fused.availability("attention", "cuda")
    assert not ok
    if mod.with_cuda():
        assert "no CUDA device is visible" in why
    else:
        assert "has no CUDA kernels" in why
    with pytest.raises(RuntimeError, match="kernels=fused requested on cuda but: layer_norm: "):
        resolve_kernels("fused", "cuda")
    assert set(resolve_kernels("auto", "cuda").sources.values()) == {"reference"}


def test_info_reports_kernel_status():
    ext()
    from bertdist.cli.info import collect

    rows = {r["op"]: r for r in collect()["kernels"]["cpu"]}
    assert rows["attention"]["fused_usable"] and "C++ CPU kernels" in rows["attention"]["reason"]
    assert [s.op for s in kernel_status("cpu")] == list(rows)


def test_package_runs_on_reference_ops_without_extension():
    r = _run_hidden(
        """
        import torch
        from bertdist.ops import kernel_status, resolve_kernels
        from bertdist.model.bert import BertForPreTraining
        from bertdist.model.config import BertConfig
        st = kernel_status("cpu")
        assert all(not s.usable for s in st), st
        print(st[0].reason)
        assert set(resolve_kernels("auto", "cpu").sources.values()) == {"reference"}
        try:
            resolve_kernels("fused", "cpu")
            raise SystemExit("fused should have been refused")
        except RuntimeError as e:
            print("refused:", e)
        m = BertForPreTraining(BertConfig.from_preset("tiny"), device_type="cpu")
        out = m(torch.randint(5, 100, (2, 8)))
        print("ok", tuple(out.prediction_logits.shape))
        """,
        {"BERTDIST_JIT": "0"},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "no prebuilt bertdist._C (hidden by the test); JIT build disabled by BERTDIST_JIT=0" in r.stdout
    assert "refused: kernels=fused requested on cpu but" in r.stdout
    assert "ok (2, 8, " in r.stdout


@pytest.mark.slow
def test_jit_fallback_builds_and_runs(tmp_path):
    """No prebuilt module: torch.utils.cpp_extension.load builds the CPU extension (~1-2 min)."""
    r = _run_hidden(
        """
        import torch
        from bertdist.ops import fused
        ok, why = fused.availability("layer_norm", "cpu")
        print(ok, why)
        x, w, b = torch.randn(3, 128), torch.randn(128), torch.randn(128)
        y = fused.layer_norm(x, w, b, 1e-5)
        print("err", (y - torch.nn.functional.layer_norm(x, (128,), w, b, 1e-5)).abs().max().item())
        """,
        {"BERTDIST_JIT": "1", "BERTDIST_JIT_DIR": str(tmp_path), "BERTDIST_CUDA": "0", "MAX_JOBS": "2"},
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "True C++ CPU kernels" in r.stdout and "JIT-built without CUDA kernels: BERTDIST_CUDA=0" in r.stdout
    err = float(r.stdout.split("err")[1])
    assert err < 1e-5


def test_arch_flags_and_cuda_home_discovery(tmp_path, monkeypatch):
    flags, label = bc.arch_flags("8.0;9.0+PTX")
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    assert label == "sm_80,sm_90,compute_90"
    with pytest.raises(ValueError, match="bad arch 'sm90'"):
        bc.arch_flags("sm90")
    # A wrapper script naming the real toolkit, as on the build machine.
    home = tmp_path / "cuda-x"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "bin" / "nvcc").write_text("")
    wrapper = tmp_path / "wrap" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {home}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper.parent))
    assert bc.find_cuda_home()[0] == str(home)


def test_arch_suffixes_and_torch_cuda_arch_list(monkeypatch):
    flags, label = bc.arch_flags("9.0a;10.0a+PTX;10.0f")
    assert flags == [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100a,code=sm_100a",
        "-gencode=arch=compute_100a,code=compute_100a",
        "-gencode=arch=compute_100f,code=sm_100f",
    ]
    assert label == "sm_90a,sm_100a,compute_100a,sm_100f"
    assert bc.arch_flags("8.0 Hopper")[1] == "sm_80,sm_90,compute_90"  # spaces and torch's names
    for bad in ("9.0b", "9", "sm_90", "9.0+ptx", "Kepler"):
        with pytest.raises(ValueError, match=re.escape(f"bad arch '{bad}'")):
            bc.arch_flags(bad)
    # Unset, BERTDIST_CUDA_ARCHS falls back to TORCH_CUDA_ARCH_LIST, then to the default.
    monkeypatch.delenv(bc.ARCH_ENV, raising=False)
    monkeypatch.delenv(bc.TORCH_ARCH_ENV, raising=False)
    assert bc.arch_spec() == (bc.DEFAULT_ARCHS, "default")
    monkeypatch.setenv(bc.TORCH_ARCH_ENV, "9.0a")
    assert bc.arch_spec() == ("9.0a", "TORCH_CUDA_ARCH_LIST") and bc.arch_flags()[1] == "sm_90a"
    monkeypatch.setenv(bc.ARCH_ENV, "8.0")
    assert bc.arch_spec() == ("8.0", "BERTDIST_CUDA_ARCHS") and bc.arch_flags()[1] == "sm_80"
    monkeypatch.setenv(bc.ARCH_ENV, "8.0;x")
    with pytest.raises(ValueError, match=r"BERTDIST_CUDA_ARCHS='8.0;x': bad arch 'x'"):
        bc.arch_flags()


def _cuda_toolchain() -> str | None:
    """Why the CUDA compile check cannot run here, or None when it can."""
    if not torch.version.cuda:
        return "torch is a CPU build"
    home, why = bc.find_cuda_home()
    return None if home else why


@pytest.mark.slow  # nvcc: about 2.5 minutes
@pytest.mark.cuda_build
def test_cuda_sources_compile_and_link(tmp_path):
    """Compile-and-link check of csrc/*.cu with nvcc and the CUDA torch.

    When the ahead-of-time build (pip install -e ., which `make` runs before the tests)
    already produced a CUDA module, compiling again would only repeat it (minutes on 2
    cores), so the test checks that module instead: CUDA entry points present, the arch
    list it was built for, and an embedded fatbinary. Otherwise (the AOT build skipped or
    lost CUDA) it JIT-builds the CUDA extension into a temporary folder.
    """
    reason = _cuda_toolchain()
    if reason:
        pytest.skip(f"no CUDA toolchain: {reason}")
    mod = ext()
    if mod.with_cuda():
        info = mod.build_info()
        _, label = bc.arch_flags()
        assert info["cuda_archs"] == label, info
        so = Path(mod.__file__).read_bytes()
        assert b".nv_fatbin" in so, "no CUDA fatbinary section in the built module"
        for name in ("attn_fwd_kernel", "attn_dq_kernel", "attn_dkdv_kernel", "ln_fwd_kernel", "ln_bwd_kernel",
                     "flat_sumsq_kernel", "flat_lamb_moments_kernel", "flat_lamb_apply_kernel", "flat_adamw_kernel"):
            assert name.encode() in so, f"kernel {name} missing from {mod.__file__}"
        return
    r = _run_hidden(
        """
        from bertdist.ops import _extension
        mod, why = _extension.load()
        assert mod is not None, why
        print(mod.with_cuda(), why)
        """,
        {"BERTDIST_JIT": "1", "BERTDIST_JIT_DIR": str(tmp_path), "MAX_JOBS": os.environ.get("MAX_JOBS", "2")},
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("True JIT-built with CUDA"), r.stdout
