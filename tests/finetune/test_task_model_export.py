"""A fine-tuned model leaves for Hugging Face: `save_model` writes BertFor<Task> directories that
transformers loads with no missing or unexpected keys and that reproduce our dev logits."""
from __future__ import annotations

import json

import pytest
import torch

from bertdist.finetune import FinetuneConfig, run_finetune
from tests.finetune import fixtures

pytestmark = pytest.mark.shared


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, shared_data):
    return fixtures.tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"),
                                       shared_data / "vocab" / "bert-base-uncased-vocab.txt")


def _finetune(tmp_path, ckpt, task, data, **kw):
    cfg = FinetuneConfig(task=task, checkpoint=str(ckpt), data=str(data), output_dir=str(tmp_path / task),
                         max_seq_length=64, batch_size=8, max_steps=2, progress=False, kernels="reference",
                         save_model=True, predict_test=False, tensorboard=False, **kw)
    s = run_finetune(cfg)
    return s, tmp_path / task / "model"


def test_sequence_classification_model_loads_in_transformers(tmp_path, tiny_ckpt, shared_data):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    s, model_dir = _finetune(tmp_path, tiny_ckpt, "rte", shared_data / "glue" / "RTE", max_train_examples=16,
                             max_eval_examples=8)
    hf, info = AutoModelForSequenceClassification.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.id2label == {0: "entailment", 1: "not_entailment"}
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = json.loads((tmp_path / "rte" / "predictions" / "dev.json").read_text())
    from bertdist.finetune.glue import GLUE_TASKS, read_glue

    ex = read_glue(GLUE_TASKS["rte"], shared_data / "glue" / "RTE" / "dev.tsv", limit=8)
    enc = tok([e.text_a for e in ex], [e.text_b for e in ex], truncation=True, max_length=64, padding=True,
              return_tensors="pt")
    with torch.no_grad():
        logits = hf.eval()(**enc).logits
    ours = torch.tensor([r["logits"] for r in rows])
    assert (logits - ours).abs().max() <= 1e-4


def test_token_and_choice_models_load_in_transformers(tmp_path, tiny_ckpt, shared_data):
    from transformers import AutoModelForMultipleChoice, AutoModelForTokenClassification

    _, ner_dir = _finetune(tmp_path, tiny_ckpt, "ner", shared_data / "conll2003" / "iob2_kamalkraj",
                           max_train_examples=100, max_eval_examples=5)
    hf, info = AutoModelForTokenClassification.from_pretrained(str(ner_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert set(hf.config.id2label.values()) == {"O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG",
                                                "B-MISC", "I-MISC"}
    _, swag_dir = _finetune(tmp_path, tiny_ckpt, "swag", fixtures.write_swag(tmp_path / "swag"))
    _, info = AutoModelForMultipleChoice.from_pretrained(str(swag_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
