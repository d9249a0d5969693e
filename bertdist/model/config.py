"""BertConfig: the model's schema, with the tiny/mini/base/large presets; ElectraConfig: an ELECTRA
pretraining model (a BertConfig for the discriminator plus the embedding and generator sizes).

Field names follow Hugging Face's ``transformers.BertConfig`` so that export
is a straight copy. ``vocab_size`` is normally taken from the vocab file
(``with_vocab``); it has no default on purpose for presets built from a
recipe, but the presets default to BERT's 30,522 so that parameter counts
and summaries work without a vocab.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional

from bertdist.config import ConfigError, from_dict

if TYPE_CHECKING:
    from bertdist.model.modernbert_config import ModernBertConfig

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512),
    "mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
}
BERT_VOCAB_SIZE = 30522
# The label of positions that get no loss (MLM: tokens not masked; NER: continuation pieces):
# torch's cross_entropy ignore_index default, and Hugging Face's.
IGNORE_INDEX = -100


@dataclasses.dataclass
class BertConfig:
    preset: str = "base"
    vocab_size: int = BERT_VOCAB_SIZE
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: Literal["gelu"] = "gelu"  # erf GELU, as in the original BERT
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    # Which implementation of layer norm / attention to use (bertdist.ops); emulated: the CUDA
    # kernels run on the CPU by the SIMT emulator (tests only: very slow).
    kernels: Literal["reference", "fused", "auto", "emulated"] = "auto"
    # Seconds kernels: auto may spend measuring before the first step (null: no limit). Cases left
    # when it is spent run the baseline (torch's kernels) and are not cached, so a later run
    # measures them; a case that has started is finished.
    kernels_budget_s: Optional[float] = 300.0
    # Project only masked positions to the vocabulary when MLM labels are given.
    sparse_mlm_head: bool = True
    # Run the encoder on real tokens only (varlen attention over packed sequences) when a
    # padding mask is given; NSP, token types and positions are unaffected.
    unpad: bool = False
    # Wrap the model in torch.compile for training (bertdist.train.compile): true, false, or
    # auto, the measured choice per device type. Weights, checkpoints and export are unchanged.
    compile: Literal["auto", True, False] = "auto"
    # Capture the compiled regions in CUDA graphs (bertdist.train.cuda_graphs; needs compile, CUDA
    # only): true, false, or auto, the measured choice per device type.
    cuda_graphs: Literal["auto", True, False] = "auto"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS and self.preset != "custom":
            raise ConfigError(f"model.preset: {self.preset!r} is not one of {sorted(PRESETS) + ['custom']}")
        # Positivity first: the divisibility check below divides by num_attention_heads.
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model: hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads}); "
                f"{self.hidden_size} / {self.num_attention_heads} = {self.hidden_size / self.num_attention_heads:.3f}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.kernels_budget_s is not None and not self.kernels_budget_s >= 0:  # NaN fails too
            raise ConfigError(f"model.kernels_budget_s must be >= 0 seconds or null (no limit), "
                              f"got {self.kernels_budget_s}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "BertConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{"preset": name, **PRESETS[name], **overrides})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "BertConfig":
        """Build from a YAML ``model:`` section: ``preset`` fills the sizes, explicit keys win."""
        data = dict(data)
        preset = data.get("preset", "base")
        base = dict(PRESETS.get(preset, {}))
        base.update(data)
        return from_dict(cls, base)

    def with_vocab(self, vocab_size: int) -> "BertConfig":
        return dataclasses.replace(self, vocab_size=vocab_size)

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields of ``transformers.BertConfig`` (for export and parity tests)."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            hidden_dropout_prob=self.hidden_dropout_prob,
            attention_probs_dropout_prob=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings,
            type_vocab_size=self.type_vocab_size,
            initializer_range=self.initializer_range,
            layer_norm_eps=self.layer_norm_eps,
            pad_token_id=self.pad_token_id,
        )

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any], **overrides: Any) -> "BertConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in data.items() if k in fields and k != "preset"}
        return cls(preset="custom", **kept, **overrides)


GENERATOR_FIELDS = ("generator_hidden_size", "generator_num_hidden_layers", "generator_num_attention_heads",
                    "generator_intermediate_size")


@dataclasses.dataclass
class ElectraConfig(BertConfig):
    """ELECTRA (Clark et al., 2020), bertdist/model/electra.py: the BertConfig fields are the
    discriminator's, the model being pretrained and then fine-tuned. The generator is a narrower
    BERT with the same vocabulary, positions, token types, dropout and layer-norm eps. Both read
    one set of embeddings of width ``embedding_size`` (None: ``hidden_size``), projected to each
    tower's hidden size where it differs (HF's ``embeddings_project``).

    The ``generator_*`` sizes are all set, or all None for a discriminator alone (a published
    ``ElectraForPreTraining`` or ``ElectraModel`` without its generator): a backbone for
    fine-tuning and distillation, not a model ELECTRA pretraining can continue.
    """

    model_type: Literal["electra"] = "electra"  # marks the mapping form (YAML) as ELECTRA's
    embedding_size: Optional[int] = None
    generator_hidden_size: Optional[int] = None
    generator_num_hidden_layers: Optional[int] = None
    generator_num_attention_heads: Optional[int] = None
    generator_intermediate_size: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.embedding_size is not None and self.embedding_size <= 0:
            raise ConfigError(f"model.embedding_size must be positive, got {self.embedding_size}")
        given = {name: getattr(self, name) for name in GENERATOR_FIELDS}
        if any(v is None for v in given.values()) and any(v is not None for v in given.values()):
            raise ConfigError(f"model: the generator sizes are all set or all null, got {given}")
        if self.has_generator:
            for name, value in given.items():
                if value <= 0:
                    raise ConfigError(f"model.{name} must be positive, got {value}")
            h, a = self.generator_hidden_size, self.generator_num_attention_heads
            if h % a:
                raise ConfigError(f"model: generator_hidden_size ({h}) must be divisible by "
                                  f"generator_num_attention_heads ({a}); {h} / {a} = {h / a:.3f}")

    @property
    def embedding_width(self) -> int:
        return self.hidden_size if self.embedding_size is None else self.embedding_size

    @property
    def has_generator(self) -> bool:
        return self.generator_hidden_size is not None

    def discriminator_config(self) -> BertConfig:
        """The discriminator as a plain BertConfig (the encoder fine-tuning builds on)."""
        return BertConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BertConfig)})

    def generator_config(self) -> BertConfig:
        """The generator's encoder: the discriminator's config with the generator's four sizes."""
        if not self.has_generator:
            raise ConfigError("this ELECTRA config has no generator (a discriminator alone)")
        return dataclasses.replace(self.discriminator_config(), preset="custom",
                                   hidden_size=self.generator_hidden_size,
                                   num_hidden_layers=self.generator_num_hidden_layers,
                                   num_attention_heads=self.generator_num_attention_heads,
                                   intermediate_size=self.generator_intermediate_size)

    def without_generator(self) -> "ElectraConfig":
        return dataclasses.replace(self, **{name: None for name in GENERATOR_FIELDS})


def model_config_from_mapping(data: Mapping[str, Any]) -> "BertConfig | ModernBertConfig":
    """A ``model:`` mapping (a run's YAML, a torch-format dir): ElectraConfig when it says
    ``model_type: electra``, ModernBertConfig when it says ``model_type: modernbert``, else BertConfig."""
    if data.get("model_type") == "electra":
        return ElectraConfig.from_mapping(data)
    if data.get("model_type") == "modernbert":
        from bertdist.model.modernbert_config import ModernBertConfig

        return ModernBertConfig.from_mapping(data)
    return BertConfig.from_mapping(data)
