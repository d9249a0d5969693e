"""The CUDA kernels of ``csrc/cuda_*.cu``, run on CPU tensors by the SIMT emulator (``csrc/emu``).

``bertdist._C_emu`` is ``bertdist._C``'s bindings and CUDA kernel sources compiled by the host
C++ compiler for the emulator: the same entry points, argument checks, launchers
(``dispatch_layout``, tile choices) and kernels a GPU runs, executed thread by thread on the
CPU. The ops here are ``fused``'s ops registered a second time, as ``torch.ops.bertdist_emu.*``
over that module: the layer-norm family by the module itself from C++ (its emulated CUDA kernels
under the CPU dispatch key), the others by ``fused.define_ops`` and, for the flat optimizer ops in
``OPTIM``, ``fused_optim.define_optim_ops``; the functions have the signatures of their twins in
``reference.py``. ``kernels: emulated`` gives them to the model.

They exist to test the CUDA code where no GPU is: they are orders of magnitude slower than
any other kernel set. What the emulator checks and what it cannot: ``csrc/emu/emu.h`` and the
docs/kernels-and-gpus.md ("The CUDA kernels without a GPU").

The extension is ``bertdist._C_emu`` (built by ``pip install -e .`` where a C++ compiler and the
CUDA headers exist), or the build that ``BERTDIST_EMU_EXT`` names by path: ``make emu-test`` and
the mutation tests point it at a build from other sources.
"""
from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from types import ModuleType

from bertdist.ops import _build_config as bc
from bertdist.ops import fused, fused_optim

OPS = fused.OPS
EXT_ENV = "BERTDIST_EMU_EXT"
_lock = threading.Lock()
_loaded: tuple[ModuleType | None, str] | None = None


def _import_from(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bertdist._C_emu", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load() -> tuple[ModuleType | None, str]:
    """(module, where it came from) or (None, why there is none). Cached per process."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        import torch  # noqa: F401  (the extension links against libtorch; load it first)

        path = os.environ.get(EXT_ENV)
        try:
            if path:
                _loaded = (_import_from(Path(path)), f"{EXT_ENV}={path}")
            else:
                from bertdist import _C_emu

                _loaded = (_C_emu, f"prebuilt bertdist._C_emu ({Path(_C_emu.__file__).name})")
        except ImportError as e:
            buildable, why = bc.emu_build_reason()
            hint = ("`pip install -e .` or `make emu-test` builds it here" if buildable
                    else f"it cannot be built here: {why}")
            where = f"{EXT_ENV}={path}" if path else "bertdist._C_emu"
            _loaded = (None, f"{where} not loadable ({e}); {hint}")
        return _loaded


def _C_emu() -> ModuleType:
    ext, why = load()
    if ext is None:
        raise RuntimeError(f"emulated CUDA kernels unavailable: {why}")
    return ext


def availability(op: str, device_type: str) -> tuple[bool, str]:
    """(usable, reason) for running ``op`` through the emulated CUDA kernels on ``device_type``."""
    if op not in OPS + fused_optim.OPTIM_OPS:
        return False, f"no emulated op named {op!r} (have {', '.join(OPS + fused_optim.OPTIM_OPS)})"
    ext, why = load()
    if ext is None:
        return False, why
    if device_type != "cpu":
        return False, (f"the emulated CUDA kernels take CPU tensors, not {device_type!r} ones "
                       "(on a GPU, kernels=fused runs the real ones)")
    return True, f"CUDA kernels run by the SIMT emulator on the CPU, {why}"


def describe() -> str:
    """One line for ``bertdist info``: the emulated device, or why the extension is missing."""
    ext, why = load()
    if ext is None:
        return f"not built: {why}"
    return f"built ({why}): {ext.build_info()['note']}"


_OPS = fused.define_ops("bertdist_emu", _C_emu)
layer_norm = _OPS.layer_norm
bias_dropout_add_layer_norm = _OPS.bias_dropout_add_layer_norm
attention = _OPS.attention
varlen_attention = _OPS.varlen_attention
OPTIM = fused_optim.define_optim_ops("bertdist_emu", _C_emu)
