"""``model.compile``: whether the trainer runs the model under ``torch.compile``.

``true`` and ``false`` are obeyed. ``auto`` is a measured choice per device type, like
``kernels: auto`` on CPU: the decision below comes from the committed benchmark it names, not
from a measurement at start-up (compiling costs far more than one step, so timing both at
start would cost a run more than it could save). A device type without a measurement runs
eager.

The model is compiled in place (``nn.Module.compile``): parameter names, checkpoints, resume
and the Hugging Face export see the same module as without it. The forward and loss of a
training batch compile as one graph (``fullgraph=True``, tests/model/test_compile.py); the
trainer still allows graph breaks, so that activation checkpointing applied from outside, or a
kernel that torch cannot trace, costs speed, not the run.
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


def apply_compile(module, decision: CompileDecision) -> None:
    """Compile ``module`` in place when the decision says so."""
    if decision.enabled:
        module.compile()
