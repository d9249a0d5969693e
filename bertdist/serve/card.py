"""The exported ONNX directory's layout and its JSON card (``onnx_card.json``).

The card says what a served model is: its task and label names, its opset, which files hold
which variant, what was fused and quantised, and the parity figures measured at export.
"""
from __future__ import annotations

import json
from pathlib import Path

CARD = "onnx_card.json"
OPSET = 17
# Variant -> file. The int8 file's name says int8.
FILES = {"fp32": "model.onnx", "optimized": "model.optimized.onnx", "int8": "model.int8.onnx"}
# The variant a server loads by default: the fastest one the export wrote and checked.
PREFERENCE = ("int8", "optimized", "fp32")
# transformers' class prefix of each model_type the export handles.
PREFIXES = {"bert": "Bert", "electra": "Electra", "modernbert": "ModernBert"}
# The task of each architecture. Pretraining models serve as encoders: BERT's, ELECTRA's
# discriminator (ForPreTraining) and generator (ForMaskedLM), ModernBERT's masked LM.
TASK_ARCHITECTURES = {
    f"{prefix}{suffix}": task
    for prefix in PREFIXES.values()
    for suffix, task in (("Model", "encoder"), ("ForPreTraining", "encoder"), ("ForMaskedLM", "encoder"),
                         ("ForSequenceClassification", "classification"), ("ForTokenClassification", "token"),
                         ("ForQuestionAnswering", "span"), ("ForMultipleChoice", "choice"))
    if not (prefix == "ModernBert" and suffix == "ForPreTraining")  # transformers has no such class
}
MODEL_TYPES = tuple(PREFIXES)


class ExportError(Exception):
    pass


def read_card(model_dir: str | Path) -> dict:
    p = Path(model_dir) / CARD
    if not p.is_file():
        raise ExportError(f"{model_dir}: no {CARD}: not a directory written by `bertdist export --format onnx`")
    card = json.loads(p.read_text())
    for key in ("task", "files", "max_length"):
        if key not in card:
            raise ExportError(f"{p}: the card has no {key!r}")
    return card


def write_card(model_dir: Path, card: dict) -> Path:
    p = Path(model_dir) / CARD
    p.write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
    return p


def pick_variant(card: dict, variant: str = "auto") -> str:
    files = card["files"]
    if variant == "auto":
        return next(v for v in PREFERENCE if v in files)
    if variant not in files:
        raise ExportError(f"variant {variant!r} was not exported (this directory has {sorted(files)})")
    return variant
