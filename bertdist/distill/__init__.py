"""Distillation of a fine-tuned teacher into a smaller student: losses, student construction,
pseudo-labelling of unlabelled text (Parquet shards + manifest), the task-distillation loop (the
fine-tuning loop with distillation losses) and the teacher/student report.

Names are imported lazily (PEP 562) so that `bertdist --help` does not pay for torch."""
import importlib

_EXPORTS = {
    "DistillConfig": "bertdist.distill.config",
    "run_distill": "bertdist.distill.train",
    "run_labelling": "bertdist.distill.pseudolabel",
    "LabelSetMismatch": "bertdist.distill.pseudolabel",
    "StudentSpecError": "bertdist.distill.student",
    "TeacherError": "bertdist.distill.teacher",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bertdist.distill' has no attribute {name!r}")
