"""Fine-tuning our BERT: task readers (glue, squad, ner, swag), metrics, task heads,
the training loop (train.py) and a one-call entry for demos (``quick_finetune``)."""
from bertdist.finetune.api import quick_finetune
from bertdist.finetune.config import FinetuneConfig
from bertdist.finetune.glue import DataError
from bertdist.finetune.train import VocabMismatch, run_finetune

__all__ = ["DataError", "FinetuneConfig", "VocabMismatch", "quick_finetune", "run_finetune"]
