"""ModernBertConfig: the schema of ModernBERT (Warner et al., 2024), bertdist/model/modernbert.py,
with the tiny/base/large presets.

Field names follow ``transformers.ModernBertConfig`` so that export is a straight copy, with one
difference: transformers stores the layer pattern as ``layer_types`` and the two RoPE bases under
``rope_parameters``; we keep the paper's ``global_attn_every_n_layers``, ``global_rope_theta`` and
``local_rope_theta`` and write transformers' form on export (bertdist/export/modernbert_hf.py).
``local_attention`` is the whole window: a token of a local layer sees ``local_attention // 2``
tokens on each side, and itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

from bertdist.config import ConfigError, from_dict

# The sizes of answerdotai/ModernBERT-base and -large (their config.json); tiny is ours, for CI:
# three layers, so it has both a global (layer 0) and local layers.
MODERNBERT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=2, intermediate_size=96),
    "base": dict(num_hidden_layers=22, hidden_size=768, num_attention_heads=12, intermediate_size=1152),
    "large": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, intermediate_size=2624),
}
MODERNBERT_VOCAB_SIZE = 50368  # the OLMo tokenizer's 50,280 tokens, padded to a multiple of 64


@dataclasses.dataclass
class ModernBertConfig:
    model_type: Literal["modernbert"] = "modernbert"  # marks the mapping form (YAML) as ModernBERT's
    preset: str = "base"
    vocab_size: int = MODERNBERT_VOCAB_SIZE
    hidden_size: int = 768
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    intermediate_size: int = 1152  # each half of the GeGLU input projection (Wi is 2x this wide)
    max_position_embeddings: int = 8192  # the context: the longest sequence the model takes
    # Layer i is global when i % global_attn_every_n_layers == 0, local (sliding window) otherwise.
    global_attn_every_n_layers: int = 3
    local_attention: int = 128  # the whole window of local layers: half of it on each side
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0  # init is a normal truncated at this many std
    pad_token_id: int = 50283
    bos_token_id: int = 50281
    eos_token_id: int = 50282
    cls_token_id: int = 50281
    sep_token_id: int = 50282
    # Which attention runs the packed path (bertdist/ops/windowed_attention.py): sdpa, flex
    # (torch's FlexAttention), reference (the Python loop every backend is tested against), or
    # auto: the trainer gates each against the reference on the run's shapes and takes the
    # fastest that passes (bertdist/ops/attention_choice.py); a model built outside one runs sdpa.
    attention_backend: Literal["auto", "sdpa", "flex", "reference"] = "sdpa"
    # Project only masked positions to the vocabulary when MLM labels are given.
    sparse_mlm_head: bool = True
    # Run the encoder on real tokens only (packed, varlen attention) when a padding mask is given.
    unpad: bool = True
    # Wrap the model in torch.compile for training (bertdist.train.compile): true, false, or
    # auto, the measured choice per device type. Weights, checkpoints and export are unchanged.
    compile: Literal["auto", True, False] = "auto"
    # Capture the compiled regions in CUDA graphs (bertdist.train.cuda_graphs; needs compile, CUDA
    # only): true, false, or auto, the measured choice per device type.
    cuda_graphs: Literal["auto", True, False] = "auto"

    def __post_init__(self) -> None:
        if self.preset not in MODERNBERT_PRESETS and self.preset != "custom":
            raise ConfigError(f"model.preset: {self.preset!r} is not one of {sorted(MODERNBERT_PRESETS) + ['custom']}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "global_attn_every_n_layers", "local_attention"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        h, a = self.hidden_size, self.num_attention_heads
        if h % a:
            raise ConfigError(f"model: hidden_size ({h}) must be divisible by num_attention_heads ({a}); "
                              f"{h} / {a} = {h / a:.3f}")
        if self.head_dim % 2:
            raise ConfigError(f"model: RoPE rotates pairs of dimensions, so the head size must be even; "
                              f"hidden_size {h} / num_attention_heads {a} = head size {self.head_dim}")
        if self.local_attention % 2:
            raise ConfigError(f"model.local_attention ({self.local_attention}) must be even: the window is "
                              f"local_attention / 2 tokens on each side")
        if self.local_attention > self.max_position_embeddings:
            raise ConfigError(f"model.local_attention ({self.local_attention}) is larger than the context, "
                              f"max_position_embeddings ({self.max_position_embeddings})")
        if not 0 <= self.pad_token_id < self.vocab_size:  # the embedding's padding row
            raise ConfigError(f"model.pad_token_id {self.pad_token_id} is not a token of the vocabulary of "
                              f"{self.vocab_size}; set it (and cls/sep/bos/eos_token_id) to the vocab's ids: for a "
                              f"BERT vocab.txt [PAD] 0, [CLS] 101, [SEP] 102")
        for name in ("global_rope_theta", "local_rope_theta", "norm_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        for name in ("embedding_dropout", "attention_dropout", "mlp_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def half_window(self) -> int:
        """How far a token of a local layer sees on each side (transformers' ``sliding_window``)."""
        return self.local_attention // 2

    def is_global(self, layer: int) -> bool:
        return layer % self.global_attn_every_n_layers == 0

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModernBertConfig":
        if name not in MODERNBERT_PRESETS:
            raise ConfigError(f"unknown ModernBERT preset {name!r}; choose from {sorted(MODERNBERT_PRESETS)}")
        return cls(**{"preset": name, **MODERNBERT_PRESETS[name], **overrides})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "ModernBertConfig":
        """Build from a YAML ``model:`` section: ``preset`` fills the sizes, explicit keys win."""
        data = dict(data)
        base = dict(MODERNBERT_PRESETS.get(data.get("preset", "base"), {}))
        base.update(data)
        return from_dict(cls, base)

    def with_vocab(self, vocab_size: int) -> "ModernBertConfig":
        return dataclasses.replace(self, vocab_size=vocab_size)
