"""Fine-tuning our BERT: task readers (glue, squad, ner, swag), metrics, task heads,
the training loop (train.py) and a one-call entry for demos (``quick_finetune``).

Names are imported lazily (PEP 562) so that `bertdist --help` and the task list do not pay for torch."""
import importlib

_EXPORTS = {
    "quick_finetune": "bertdist.finetune.api",
    "FinetuneConfig": "bertdist.finetune.config",
    "DataError": "bertdist.finetune.errors",
    "VocabMismatch": "bertdist.finetune.train",
    "run_finetune": "bertdist.finetune.train",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bertdist.finetune' has no attribute {name!r}")
