"""Encoder families: what everything after pretraining needs to know about a backbone, in one place.

Fine-tuning, bi- and cross-encoders, distillation and the ONNX export take a ``PretrainedWeights``
(bertdist/export/sources.py) and ask its family, ``family_of(w.config)``, for:

* the task model of a head kind (``task_model``), whose module names are transformers'
  ``<Prefix>For<Task>``, and that class's name (``hf_architecture``);
* the bare encoder with BERT's call shape for embeddings (``embedding_encoder``), its tensors out
  of a pretraining state dict (``encoder_state``) and its transformers class (``<Prefix>Model``);
* the ``config.json`` of an exported model (``hf_config``), and how the fine-tuning knobs that
  exist in one family only (``kernels``, a hidden dropout) map onto its config.

The tokenizer goes with the weights, not the family: a WordPiece ``vocab.txt`` or the
``tokenizer.json`` a checkpoint came with (``data_tokenizer`` in bertdist/export/tokenizer.py).

Families: BERT (``BertConfig``), ELECTRA (``ElectraConfig``: the discriminator), ModernBERT
(``ModernBertConfig``). A new backbone is one more ``EncoderFamily`` in ``FAMILIES``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn as nn

from bertdist.model import BertConfig, ElectraConfig
from bertdist.model.modernbert_config import ModernBertConfig

# Head kind -> the transformers class suffix of its task model.
TASK_SUFFIX = {"classification": "ForSequenceClassification", "regression": "ForSequenceClassification",
               "token": "ForTokenClassification", "span": "ForQuestionAnswering", "choice": "ForMultipleChoice",
               "encoder": "Model"}


class EncoderFamily:
    name: str
    hf_prefix: str  # transformers' class prefix: Bert, Electra, ModernBert
    config_type: type
    model_type: str  # config.json's model_type
    layer_prefix: str  # the encoder layers' keys in a pretraining state dict ("<prefix><i>.")
    padded_vocab = False  # whether the embeddings may have more rows than the tokenizer has tokens

    def owns(self, cfg: Any) -> bool:
        return type(cfg) is self.config_type

    def hf_architecture(self, kind: str) -> str:
        return self.hf_prefix + TASK_SUFFIX[kind]

    def task_class(self) -> type:
        raise NotImplementedError

    def task_model(self, cfg, kind: str, num_labels: int = 2, device_type: str | None = None, **head) -> nn.Module:
        return self.task_class()(cfg, kind, num_labels, device_type=device_type, **head)

    def head_keys(self, kind: str) -> tuple[str, ...]:
        return self.task_class().head_keys(kind)

    def embedding_encoder(self, cfg, device_type: str | None = None) -> nn.Module:
        raise ValueError(f"bi-encoders on {self.name} are not supported (BERT and ModernBERT are)")

    def encoder_state(self, pretraining_state_dict: Mapping[str, torch.Tensor], encoder: nn.Module
                      ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_config(self, cfg, architectures: list[str]) -> dict:
        from bertdist.export.hf import hf_config_dict

        return hf_config_dict(cfg, architectures)

    def head_options(self, finetune_cfg) -> dict:
        """The task heads' options from a ``FinetuneConfig`` (keyword arguments of ``task_model``)."""
        return {}

    def head_options_of(self, hf_config: Mapping) -> dict:
        """The task heads' options a task model's config.json records."""
        return {}

    def write_pretraining_dir(self, out, w) -> Any:
        """``w`` (a ``PretrainedWeights``) as the HF directory of its pretraining model."""
        from bertdist.export.hf import write_hf_dir

        return write_hf_dir(out, w.config, w.state_dict, w.vocab_file, w.do_lower_case)

    def task_config(self, model: nn.Module) -> dict:
        """What a task model adds to config.json beyond the backbone's (ModernBERT: its pooling)."""
        return {}

    def with_kernels(self, cfg, kernels: str | None):
        return cfg if kernels is None else dataclasses.replace(cfg, kernels=kernels)

    def with_dropout(self, cfg, p: float | None):
        """``cfg`` with fine-tuning's hidden dropout ``p`` (None: the checkpoint's)."""
        return cfg if p is None else dataclasses.replace(cfg, hidden_dropout_prob=p)

    def kernel_sources(self, model: nn.Module) -> dict:
        return dict(model.backbone.kernels.sources)

    def decide_attention(self, model: nn.Module, device, *, batch: int, seq: int, precision: str) -> str | None:
        """A model whose config leaves its attention to a measurement (ModernBERT's
        ``attention_backend: auto``): decide for training at these shapes and set it; None: nothing to decide."""
        return None

    # TinyBERT's intermediate losses (bertdist/distill/capture.py) hook BERT-layout encoder layers.
    captures_layers = True

    def student_preset(self, name: str, teacher_cfg):
        """A randomly initialised student of preset ``name`` that reads the teacher's token ids."""
        return BertConfig.from_preset(name, vocab_size=teacher_cfg.vocab_size,
                                      max_position_embeddings=teacher_cfg.max_position_embeddings,
                                      type_vocab_size=teacher_cfg.type_vocab_size, kernels=teacher_cfg.kernels)


class BertFamily(EncoderFamily):
    name, hf_prefix, config_type, model_type = "bert", "Bert", BertConfig, "bert"
    layer_prefix = "bert.encoder.layer."

    def task_class(self) -> type:
        from bertdist.finetune.heads import BertForTask

        return BertForTask

    def embedding_encoder(self, cfg, device_type=None) -> nn.Module:
        from bertdist.model import BertModel

        return BertModel(cfg, add_pooling_layer=True, device_type=device_type)

    def encoder_state(self, pretraining_state_dict, encoder):
        return {k[len("bert."):]: v for k, v in pretraining_state_dict.items() if k.startswith("bert.")}


class ElectraFamily(EncoderFamily):
    name, hf_prefix, config_type, model_type = "electra", "Electra", ElectraConfig, "electra"
    layer_prefix = "discriminator.electra.encoder.layer."

    def task_class(self) -> type:
        from bertdist.finetune.heads import ElectraForTask

        return ElectraForTask


class ModernBertFamily(EncoderFamily):
    name, hf_prefix, config_type, model_type = "modernbert", "ModernBert", ModernBertConfig, "modernbert"
    layer_prefix = "model.layers."
    padded_vocab = True  # ModernBERT pads its embedding table to a multiple of 64 rows

    def task_class(self) -> type:
        from bertdist.finetune.modernbert_heads import ModernBertForTask

        return ModernBertForTask

    def embedding_encoder(self, cfg, device_type=None) -> nn.Module:
        from bertdist.finetune.modernbert_heads import ModernBertBackbone

        return ModernBertBackbone(cfg)

    def encoder_state(self, pretraining_state_dict, encoder):
        from bertdist.finetune.modernbert_heads import backbone_state

        return backbone_state(pretraining_state_dict, encoder.state_dict())

    def hf_config(self, cfg, architectures: list[str]) -> dict:
        from bertdist.export.modernbert_hf import hf_config_dict

        return {**hf_config_dict(cfg), "architectures": list(architectures)}

    def head_options(self, finetune_cfg) -> dict:
        return {"pooling": finetune_cfg.classifier_pooling}

    def head_options_of(self, hf_config):
        return {"pooling": hf_config.get("classifier_pooling") or "cls",
                "classifier_dropout": float(hf_config.get("classifier_dropout") or 0.0)}

    def write_pretraining_dir(self, out, w):
        from bertdist.export.modernbert_hf import write_modernbert_hf_dir
        from bertdist.export.tokenizer import write_modernbert_tokenizer

        out = write_modernbert_hf_dir(out, w.config, w.state_dict, w.tokenizer_files)
        write_modernbert_tokenizer(out, w)
        return out

    def task_config(self, model: nn.Module) -> dict:
        return {"classifier_pooling": model.pooling, "classifier_dropout": model.classifier_dropout}

    def with_kernels(self, cfg, kernels):
        return cfg  # one implementation; its attention backend is the config's attention_backend

    def with_dropout(self, cfg, p):
        # BERT's hidden dropout sits on each block's output; ModernBERT's nearest is its MLP dropout.
        return cfg if p is None else dataclasses.replace(cfg, mlp_dropout=p)

    def decide_attention(self, model, device, *, batch, seq, precision):
        cfg = model.backbone.config
        if cfg.attention_backend != "auto":
            return None
        import torch

        from bertdist.ops.attention_choice import decide_attention_backend, set_attention_backend

        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the run's RNG untouched
            choice = decide_attention_backend(cfg, device, batch=batch, seq=seq, precision=precision)
        set_attention_backend(model, choice.backend)
        return choice.backend

    def kernel_sources(self, model):
        # what runs: attention_backend auto runs attention_choice.UNMEASURED until a decision sets one
        from bertdist.model.modernbert import ModernBertAttention

        return {"attention": next(m.backend for m in model.modules() if isinstance(m, ModernBertAttention))}

    captures_layers = True  # bertdist/distill/capture.py reads its layers (unpadded ones put back)

    def student_preset(self, name, teacher_cfg):
        keep = ("vocab_size", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
                "cls_token_id", "sep_token_id", "attention_backend")
        over = {k: getattr(teacher_cfg, k) for k in keep}
        return ModernBertConfig.from_preset(name, local_attention=min(128, teacher_cfg.max_position_embeddings)
                                            // 2 * 2, **over)


FAMILIES: tuple[EncoderFamily, ...] = (BertFamily(), ElectraFamily(), ModernBertFamily())


def family_of(cfg: Any) -> EncoderFamily:
    """The family of a model config (exact type: an ElectraConfig is not taken for a BertConfig)."""
    for f in FAMILIES:
        if f.owns(cfg):
            return f
    raise TypeError(f"no encoder family for a {type(cfg).__name__}; known: "
                    f"{[f.config_type.__name__ for f in FAMILIES]}")


def family_named(model_type: str | None) -> EncoderFamily | None:
    """The family of a config.json's ``model_type``, or None."""
    return next((f for f in FAMILIES if f.model_type == model_type), None)
