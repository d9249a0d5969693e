"""``model.compile``: whether the trainer runs the model under ``torch.compile``.

``true`` and ``false`` are obeyed. ``auto`` is a measured choice per device type, like
``kernels: auto`` on CPU: the decision below comes from the committed benchmark it names, not
from a measurement at start-up (compiling costs far more than one step, so timing both at
start would cost a run more than it could save). A device type without a measurement runs
eager.

Compilation is regional (``compile_regions``): each encoder layer, the embeddings and the MLM
head are compiled in place (``nn.Module.compile``), one by one. The layers run the same code on
the same shapes, so Dynamo traces one layer graph and every other layer reuses it: the compile
time is that of one layer, not of the unrolled model, and no layer or later step recompiles
(tests/train/test_compile.py counts). The number of masked positions changes every batch, so the
sparse MLM head is compiled with dynamic shapes from the start. Parameter names, checkpoints,
resume and the Hugging Face export see the same module as without it. Graph breaks are allowed,
so activation checkpointing applied from outside, or a kernel torch cannot trace, costs speed,
not the run.

``model.cuda_graphs`` (bertdist/train/cuda_graphs.py) decides whether the regions with static
shapes are compiled in CUDA graph mode; the dynamic MLM head never is.

``compile_cache``: torch's compile cache artifacts (``torch.compiler.save_cache_artifacts``), a
file loaded before the first step when it exists and written after the first step, so a second
run on the same image (torch, GPU, shapes) starts warm. It holds compiled code and is trusted as
such: point it only at a file a run of yours wrote.
"""
from __future__ import annotations

import dataclasses

# device type -> (compile under auto, the measurement behind it)
AUTO_DECISIONS: dict[str, tuple[bool, str]] = {
    "cpu": (False, "eager: compiled training steps were not faster on CPU (median 1.56x the eager step time "
                   "over 3 runs), and the compile costs every run its start-up "
                   "(benchmarks/results/model_compile_cpu_2026-11-25.md)"),
}


@dataclasses.dataclass(frozen=True)
class CompileDecision:
    enabled: bool
    reason: str


def decide_compile(setting: "str | bool", device_type: str) -> CompileDecision:
    """What ``model.compile: setting`` means on ``device_type``."""
    if setting is True or setting is False:
        return CompileDecision(setting, f"model.compile={str(setting).lower()}")
    if setting != "auto":
        raise ValueError(f"model.compile must be true, false or auto, got {setting!r}")
    if device_type in AUTO_DECISIONS:
        enabled, why = AUTO_DECISIONS[device_type]
        return CompileDecision(enabled, f"model.compile=auto: {why}")
    return CompileDecision(False, f"model.compile=auto: eager: torch.compile not yet measured on {device_type} "
                                  "(bertdist bench measures it)")


# Class names of the modules compiled as regions besides the layers of every nn.ModuleList: the
# embeddings (BERT's, ELECTRA's) and the MLM heads (dynamic: their row count is the masked count).
_REGIONS = ("BertEmbeddings",)
_DYNAMIC_REGIONS = ("BertLMPredictionHead", "ElectraGeneratorPredictions")


def compile_regions(module) -> list[tuple[object, bool]]:
    """(submodule, dynamic) for each region of ``module`` that ``apply_compile`` compiles: every
    layer of an nn.ModuleList, the embeddings and the MLM heads; empty for a module without them."""
    import torch.nn as nn

    out = []
    for m in module.modules():
        name = type(m).__name__
        if isinstance(m, nn.ModuleList):
            out.extend((layer, False) for layer in m)
        elif name in _REGIONS or name in _DYNAMIC_REGIONS:
            out.append((m, name in _DYNAMIC_REGIONS))
    return out


def apply_compile(module, decision: CompileDecision, backend: str = "inductor", graphs: bool = False) -> list:
    """Compile ``module``'s regions in place when the decision says so (the whole module when it
    has none); returns the compiled submodules. ``backend``: torch.compile's (tests use a cheaper one).
    ``graphs``: the regions with static shapes are captured in CUDA graphs (bertdist/train/cuda_graphs.py);
    the dynamic ones never are, since a graph is recorded per shape."""
    if not decision.enabled:
        return []
    static = {}
    if graphs:
        from bertdist.train.cuda_graphs import graph_options

        static = {"options": graph_options()}
    regions = compile_regions(module)
    if not regions:
        module.compile(backend=backend, **static)
        return [module]
    for region, dynamic in regions:
        if dynamic:
            region.compile(backend=backend, dynamic=True)
        else:
            region.compile(backend=backend, dynamic=None, **static)
    return [region for region, _ in regions]


def load_compile_cache(path: "str | None") -> "dict | None":
    """Loads torch's compile cache artifacts from ``path`` before anything compiles; what was
    loaded (bytes, entries), or None when there is no such file."""
    import os

    import torch

    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    info = torch.compiler.load_cache_artifacts(data)
    return {"bytes": len(data), "entries": _entry_count(info)}


def save_compile_cache(path: "str | None") -> "dict | None":
    """Writes the artifacts of what this process compiled to ``path`` (0600, replaced atomically);
    what was written, or None when nothing was compiled."""
    import os

    import torch

    if not path:
        return None
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return None
    data, info = got
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return {"bytes": len(data), "entries": _entry_count(info)}


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (Dynamo's own accounting: tracing, AOT
    autograd and Inductor, cache hits included); 0 when nothing compiled."""
    from torch._dynamo.utils import calculate_time_spent

    spent = calculate_time_spent()
    return float(spent.get("total_wall_time", spent.get("entire_frame_compile", 0.0)))


def _entry_count(info) -> dict[str, int]:
    """Entries per artifact kind in torch's CacheInfo (``artifacts``: kind -> keys)."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {kind: len(keys) for kind, keys in artifacts.items()}
