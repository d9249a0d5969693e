"""The registry of model families: BERT, ELECTRA and ModernBERT, each in one entry.

An entry says, per family, what the rest of bertdist asks of a model: its config class and
presets, the pretraining model and how it takes the loader's batch, its parameter and FLOP
counts, its memory plan, its Hugging Face export and import, which model fields a resume and a
new phase must match, and which objectives (the ``distill`` / ``electra`` sections of a
pretraining config) it trains with. The trainer, ``--plan``, export and import look the family up
here (``family_of``) instead of testing config classes themselves, so a new family is one entry.

No torch: code that needs it is named as ``"module:attribute"`` and imported when first called,
so the config layer can use the registry.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Mapping

from bertdist.config import ConfigError
from bertdist.model.config import PRESETS, BertConfig, ElectraConfig
from bertdist.model.modernbert_config import MODERNBERT_PRESETS, ModernBertConfig

# Model fields that change a BERT's weight shapes; a resume or a new phase with any of them changed is refused.
BERT_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "max_position_embeddings", "type_vocab_size")
ELECTRA_FIELDS = ("embedding_width", "generator_hidden_size", "generator_num_hidden_layers",
                  "generator_num_attention_heads", "generator_intermediate_size")
# ModernBERT's shapes and what its weights were trained to see: the window, the layer pattern, the
# RoPE bases and the context. A new phase may change the context and the global RoPE base only
# (the paper's extension from 1,024 to 8,192 tokens, global θ 10,000 -> 160,000).
MODERNBERT_ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "intermediate_size", "max_position_embeddings", "global_attn_every_n_layers",
                          "local_attention", "global_rope_theta", "local_rope_theta")
MODERNBERT_PHASE_FIELDS = ("max_position_embeddings", "global_rope_theta")


@functools.lru_cache(maxsize=None)  # looked up per micro-batch (inputs, FLOPs): resolved once
def _resolve(ref: str) -> Callable:
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def _describe_bert(m: BertConfig) -> str:
    return (f"a BERT (no electra section), L={m.num_hidden_layers} H={m.hidden_size} A={m.num_attention_heads} "
            f"FFN {m.intermediate_size}")


def _describe_electra(m: ElectraConfig) -> str:
    if not m.has_generator:
        return f"an ELECTRA discriminator without a generator (embedding_size {m.embedding_width})"
    return (f"ELECTRA with embedding_size {m.embedding_width}, generator hidden {m.generator_hidden_size}, "
            f"layers {m.generator_num_hidden_layers}, heads {m.generator_num_attention_heads}, FFN "
            f"{m.generator_intermediate_size}")


def _describe_modernbert(m: ModernBertConfig) -> str:
    return (f"a ModernBERT, L={m.num_hidden_layers} H={m.hidden_size} A={m.num_attention_heads} GeGLU "
            f"{m.intermediate_size}, context {m.max_position_embeddings}, window {m.local_attention}, global every "
            f"{m.global_attn_every_n_layers} layers, RoPE θ global {m.global_rope_theta:g} / local "
            f"{m.local_rope_theta:g}")


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    config_class: type  # the model's config (what ``model_config`` of a run resolves to)
    section_class: type  # the class of a pretraining config's ``model`` section for this family
    presets: Mapping[str, Mapping[str, int]]
    model_class: str  # "module:Class" of the pretraining model, built as Class(config[, device_type, kernels])
    uses_kernels: bool  # takes a bertdist.ops KernelSet (kernels_for_run decides it)
    parameter_count: str  # "module:function"(config) -> parameters of the pretraining model
    forward_flops: str  # "module:function"(config, seq, predicted) -> {part: FLOPs, "total": ...}
    memory: str  # "module:function"(config, ...) -> MemoryEstimate (bertdist/train/memory.py)
    export_hf: str  # "module:function"(args, weights) -> exit code of `bertdist export`
    import_hf: str  # "module:function"(args, weights) -> exit code of `bertdist import-hf`
    arch_fields: tuple[str, ...]  # model fields a resume and a new phase must match
    phase_fields: tuple[str, ...] = ()  # of those, the ones a new phase (checkpoint.init_from) may change
    objectives: tuple[str, ...] = ()  # the objective sections (distill, electra) a run of this model may set
    # "module:function"(batch) -> the model's keyword arguments; None: the loader's batch as it is
    inputs: str | None = None
    layer_class: str = "bertdist.model.bert:BertLayer"  # "module:Class" of an encoder layer (activation checkpointing)
    # Attends within each cu_seqlens segment with positions restarting there: it may train on packed
    # records (several documents a row); BERT's learned positions would run across them.
    attends_within_segments: bool = False
    # "module:function"(config, cu_seqlens, predicted) -> the training FLOPs of a packed batch (device);
    # None: its sequences at the batch's padded width (what the model computes)
    batch_flops: str | None = None
    plan_fields: tuple[str, ...] = ()  # model fields `pretrain --plan` shows beside the sizes
    nsp_head: bool = False  # has an NSP (or SOP) head, trained where the records carry the label
    hf_architecture: str = ""  # what `bertdist export` writes
    describe: Callable[[Any], str] = repr
    # "module:function"(train config, device, run dir) -> the attention a run decides at its start
    # (None: fixed by the config), and "module:function"(model, that decision) applying it once built;
    # None: the family's attention comes with its kernel plan (``uses_kernels``)
    decide_attention: str | None = None
    apply_attention: str | None = None

    def build(self, config, device_type: str = "cpu", kernels=None):
        """The pretraining model of ``config`` (weights initialised from the global RNG)."""
        cls = _resolve(self.model_class)
        return cls(config, device_type=device_type, kernels=kernels) if self.uses_kernels else cls(config)

    def model_inputs(self, batch: dict) -> dict:
        """The loader's batch (on the device) as the model's forward takes it."""
        return batch if self.inputs is None else _resolve(self.inputs)(batch)

    def choose_attention(self, cfg, device, run_dir):
        """The attention a run of this family decided at its start, or None."""
        return None if self.decide_attention is None else _resolve(self.decide_attention)(cfg, device, run_dir)

    def use_attention(self, model, choice) -> None:
        """Makes the built ``model`` run ``choice`` (from ``choose_attention``; None: nothing to do)."""
        if choice is not None:
            _resolve(self.apply_attention)(model, choice)

    def encoder_layer(self) -> type:
        return _resolve(self.layer_class)

    def train_flops_of_batch(self, config, batch: dict, predicted):
        """The training FLOPs of a loader batch (a device tensor or a number): on its packed
        segments where the family computes only those, else at the batch's padded width."""
        if self.batch_flops is not None:
            return _resolve(self.batch_flops)(config, batch["cu_seqlens"], predicted)
        from bertdist.model.flops import train_flops_per_sequence

        n_seq, width = batch["input_ids"].shape
        if getattr(config, "sparse_mlm_head", False):  # linear in the predicted positions
            head = train_flops_per_sequence(config, 1, 1) - train_flops_per_sequence(config, 1, 0)
            return n_seq * train_flops_per_sequence(config, width, 0) + head * predicted.double()
        return n_seq * train_flops_per_sequence(config, width)

    def count_parameters(self, config) -> int:
        return _resolve(self.parameter_count)(config)

    def flops(self, config, seq: int, predicted: int | None = None) -> dict[str, int]:
        return _resolve(self.forward_flops)(config, seq, predicted)

    def estimate_memory(self, config, **kwargs):
        return _resolve(self.memory)(config, **kwargs)

    def export(self, args, weights) -> int:
        return _resolve(self.export_hf)(args, weights)

    def import_(self, args, weights) -> int:
        return _resolve(self.import_hf)(args, weights)


FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    ModelFamily(
        "bert", BertConfig, BertConfig, PRESETS, "bertdist.model.bert:BertForPreTraining", True,
        "bertdist.train.memory:bert_parameter_count", "bertdist.model.flops:bert_forward_flops",
        "bertdist.train.memory:estimate_memory", "bertdist.cli.export:export_bert",
        "bertdist.cli.import_hf:import_bert", BERT_ARCH_FIELDS, objectives=("distill", "electra"),
        nsp_head=True, hf_architecture="BertForPreTraining", describe=_describe_bert),
    ModelFamily(
        "electra", ElectraConfig, BertConfig, PRESETS, "bertdist.model.electra:ElectraForPreTraining", True,
        "bertdist.train.memory:electra_parameter_count", "bertdist.model.flops:electra_forward_flops_per_sequence",
        "bertdist.train.memory:estimate_memory", "bertdist.cli.export:export_bert",
        "bertdist.cli.import_hf:import_bert", BERT_ARCH_FIELDS + ELECTRA_FIELDS, objectives=("electra",),
        hf_architecture="ElectraForPreTraining (the generator, ElectraForMaskedLM, in generator/)",
        describe=_describe_electra),
    ModelFamily(
        "modernbert", ModernBertConfig, ModernBertConfig, MODERNBERT_PRESETS,
        "bertdist.model.modernbert:ModernBertForMaskedLM", False,
        "bertdist.model.flops:modernbert_parameter_count", "bertdist.model.flops:modernbert_forward_flops",
        "bertdist.train.memory:estimate_modernbert_memory", "bertdist.cli.export:export_modernbert",
        "bertdist.cli.import_hf:import_modernbert", MODERNBERT_ARCH_FIELDS, MODERNBERT_PHASE_FIELDS,
        inputs="bertdist.model.modernbert:packed_inputs",
        layer_class="bertdist.model.modernbert:ModernBertEncoderLayer",
        attends_within_segments=True,
        batch_flops="bertdist.model.flops:modernbert_batch_train_flops", hf_architecture="ModernBertForMaskedLM",
        plan_fields=("max_position_embeddings", "local_attention", "global_attn_every_n_layers", "global_rope_theta",
                     "local_rope_theta", "attention_backend"),
        describe=_describe_modernbert, decide_attention="bertdist.ops.attention_choice:decide_for_run",
        apply_attention="bertdist.ops.attention_choice:apply_choice"),
)}


def family_of(config) -> ModelFamily:
    """The family of a model config (the most specific class wins: ELECTRA's config is a BertConfig)."""
    for fam in sorted(FAMILIES.values(), key=lambda f: -len(f.config_class.__mro__)):
        if isinstance(config, fam.config_class):
            return fam
    raise ConfigError(f"no model family has config class {type(config).__name__}; families: {sorted(FAMILIES)}")


def family_of_mapping(data: Mapping[str, Any]) -> ModelFamily:
    """The family a ``model:`` mapping names with ``model_type`` (none: BERT)."""
    tag = data.get("model_type") or "bert"
    if tag not in FAMILIES:
        raise ConfigError(f"model.model_type: {tag!r} is not one of {sorted(FAMILIES)}")
    return FAMILIES[tag]


def section_presets(data: Mapping[str, Any]) -> Mapping[str, Mapping[str, int]]:
    """The presets of the family a pretraining config's ``model`` section describes."""
    return family_of_mapping(data).presets


def arch_mismatches(theirs: Mapping[str, Any], ours, new_phase: bool) -> list[str]:
    """``model.<field>: checkpoint A, config B`` for each field of ``ours``'s family that a
    checkpoint's model (as a mapping) must match: all of them for a resume, those but the family's
    ``phase_fields`` for a new phase. A different family is one line saying so."""
    fam = family_of(ours)
    saved_type = theirs.get("model_type") or "bert"
    ours_type = getattr(ours, "model_type", None) or "bert"
    if saved_type != ours_type and {saved_type, ours_type} != {"bert", "electra"}:
        return [f"model.model_type: checkpoint {saved_type!r}, config {ours_type!r}"]
    fields = [f for f in fam.arch_fields if not (new_phase and f in fam.phase_fields)]
    return [f"model.{k}: checkpoint {theirs.get(k)}, config {getattr(ours, k)}" for k in fields
            if theirs.get(k) != getattr(ours, k)]
