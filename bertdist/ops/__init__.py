"""Layer norm and attention, behind one seam (see dispatch.py); kernels: auto is selection.py."""
from bertdist.ops.dispatch import (
    OP_NAMES,
    REFERENCE,
    TORCH_NATIVE,
    KernelMode,
    KernelSet,
    OpStatus,
    auto_kernels,
    kernel_set_from_plan,
    kernel_status,
    kernels_for_run,
    reference_set,
    resolve_kernels,
)
from bertdist.ops.reference import (
    reference_attention,
    reference_attention_math,
    reference_bias_dropout_add_layer_norm,
    reference_layer_norm,
    reference_layer_norm_math,
    reference_varlen_attention,
)

__all__ = [
    "OP_NAMES",
    "REFERENCE",
    "TORCH_NATIVE",
    "KernelMode",
    "KernelSet",
    "OpStatus",
    "auto_kernels",
    "kernel_set_from_plan",
    "kernel_status",
    "kernels_for_run",
    "reference_set",
    "resolve_kernels",
    "reference_attention",
    "reference_attention_math",
    "reference_bias_dropout_add_layer_norm",
    "reference_layer_norm",
    "reference_layer_norm_math",
    "reference_varlen_attention",
]
