"""ELECTRA in one file, built from bert.py's parts (Clark et al., 2020, "ELECTRA: Pre-training
Text Encoders as Discriminators Rather Than Generators").

A small generator, a BERT trained as a masked language model, fills the masked positions of a
batch with tokens sampled from its own predictions; the discriminator, the model that is kept,
reads the result and tells for every real token whether it was replaced. A sampled token equal to
the original counts as original. The two towers share one set of token, position and token-type
embeddings (and their layer norm, as the original's shared ``electra/embeddings`` scope does), of
width ``embedding_size``; a tower whose hidden size differs projects them first (HF's
``embeddings_project``).

Module and parameter names mirror ``transformers``: ``discriminator.*`` is an
``ElectraForPreTraining``, ``generator.*`` an ``ElectraForMaskedLM``, so each exports by dropping
its prefix (bertdist/export/electra_hf.py). Layout::

    ElectraForPreTraining
      discriminator: ElectraDiscriminator        (HF ElectraForPreTraining)
        electra: ElectraModel                    embeddings, embeddings_project?, encoder
        discriminator_predictions                dense, dense_prediction -> 1 logit per token
      generator: ElectraGenerator                (HF ElectraForMaskedLM)
        electra: ElectraModel                    the same embeddings module, its own projection
        generator_predictions                    dense (to the embedding size), LayerNorm
        generator_lm_head                        weight tied to the word embeddings

The encoders are ``bert.BertEncoder``: the same layers and kernel seam (reference, fused, auto),
and the same unpadded path (``model.unpad``), as BERT's. The forward computes the generator's
MLM loss and the discriminator's loss as separate parts; how they are weighed (the paper's
λ = 50), and which sampler draws the tokens, is the objective's, applied from outside
(bertdist/train/electra_objective.py). Sampling runs in fp32 under ``no_grad``: no gradient
flows from the discriminator into the generator through the sampled tokens.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model.bert import (
    BertEmbeddings,
    BertEncoder,
    LayerNorm,
    PreTrainingOutput,
    _default_device_type,
    encode,
    init_weights,
    mlm_loss,
)
from bertdist.model.config import IGNORE_INDEX, BertConfig, ElectraConfig
from bertdist.ops import KernelSet, resolve_kernels

SAMPLING_METHODS = ("multinomial", "gumbel")


def _init(module: nn.Module, std: float) -> None:
    module.apply(lambda m: init_weights(m, std))


class ElectraModel(nn.Module):
    """Embeddings (width E) -> projection to this tower's hidden size where E differs -> BERT
    encoder. No pooler: ELECTRA has none. ``embeddings``: a module shared with the other tower
    (None: its own, newly initialised). Returns the sequence output [B, S, hidden]."""

    def __init__(self, cfg: BertConfig, embedding_size: int, kernels: KernelSet,
                 embeddings: BertEmbeddings | None = None):
        super().__init__()
        self.config, self.kernels = cfg, kernels
        own = embeddings is None
        self.embeddings = BertEmbeddings(cfg, kernels, width=embedding_size) if own else embeddings
        self.embeddings_project = (nn.Linear(embedding_size, cfg.hidden_size)
                                   if embedding_size != cfg.hidden_size else None)
        self.encoder = BertEncoder(cfg, kernels)
        for module in ([self.embeddings] if own else []) + [self.embeddings_project, self.encoder]:
            if module is not None:
                _init(module, cfg.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        token_index: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: "int | torch.Tensor | None" = None,
    ) -> torch.Tensor:
        """The packing arguments: see ``BertModel.forward``."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = self.embeddings(input_ids, token_type_ids)
        if self.embeddings_project is not None:
            h = self.embeddings_project(h)
        return encode(self.encoder, h, attention_mask, self.config.unpad, token_index=token_index,
                      cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


class ElectraGeneratorPredictions(nn.Module):
    """LayerNorm(gelu(dense(h))), from the generator's hidden size to the embedding size."""

    def __init__(self, cfg: BertConfig, embedding_size: int, kernels: KernelSet):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, embedding_size)
        self.LayerNorm = LayerNorm(embedding_size, cfg.layer_norm_eps, kernels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(h)))


class ElectraGenerator(nn.Module):
    """The generator: an MLM whose output projection is the (shared) word embeddings, plus a bias."""

    def __init__(self, cfg: BertConfig, embedding_size: int, kernels: KernelSet,
                 embeddings: BertEmbeddings | None = None):
        super().__init__()
        self.electra = ElectraModel(cfg, embedding_size, kernels, embeddings)
        self.generator_predictions = ElectraGeneratorPredictions(cfg, embedding_size, kernels)
        self.generator_lm_head = nn.Linear(embedding_size, cfg.vocab_size)
        self.generator_lm_head.weight = self.electra.embeddings.word_embeddings.weight  # tied
        _init(self.generator_predictions, cfg.initializer_range)
        nn.init.zeros_(self.generator_lm_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, *, positions: torch.Tensor | None = None,
                sparse: bool = True, **packing) -> torch.Tensor:
        """MLM logits: [B, S, V], or [N, V] at ``positions`` (flat positions in [B * S]). ``sparse``:
        gather those positions before the head (the vocabulary GEMM over N rows, not B * S)."""
        h = self.electra(input_ids, attention_mask, token_type_ids, **packing)
        if positions is not None and sparse:
            h = h.reshape(-1, h.shape[-1]).index_select(0, positions)
        logits = self.generator_lm_head(self.generator_predictions(h))
        if positions is not None and not sparse:
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
        return logits


class ElectraDiscriminatorPredictions(nn.Module):
    """dense_prediction(gelu(dense(h))): one replaced-or-original logit per token."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dense_prediction = nn.Linear(cfg.hidden_size, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dense_prediction(F.gelu(self.dense(h))).squeeze(-1)


class ElectraDiscriminator(nn.Module):
    """The discriminator: the encoder that is kept, with its replaced-token head. Returns [B, S] logits."""

    def __init__(self, cfg: BertConfig, embedding_size: int, kernels: KernelSet,
                 embeddings: BertEmbeddings | None = None):
        super().__init__()
        self.electra = ElectraModel(cfg, embedding_size, kernels, embeddings)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(cfg)
        _init(self.discriminator_predictions, cfg.initializer_range)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, **packing) -> torch.Tensor:
        return self.discriminator_predictions(self.electra(input_ids, attention_mask, token_type_ids, **packing))


@torch.no_grad()
def sample_tokens(logits: torch.Tensor, temperature: float = 1.0, method: str = "multinomial",
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V], drawn from softmax(logits / temperature) in fp32.

    ``gumbel``: argmax(logits / T + Gumbel noise), the original's: N x V uniform draws and two
    logarithms each. ``multinomial``: the inverse CDF, one uniform draw per row against the
    cumulative unnormalised softmax (one exponential per logit): the same distribution, about
    3x cheaper on a CPU. ``generator``: the RNG drawn from (None: torch's global one)."""
    z = logits.detach().float() / temperature
    if method == "gumbel":
        u = torch.rand(z.shape, generator=generator, device=z.device, dtype=torch.float32)
        return (z - torch.log(-torch.log(u + 1e-9) + 1e-9)).argmax(-1)
    if method == "multinomial":
        cdf = (z - z.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)
        u = torch.rand(z.shape[0], 1, generator=generator, device=z.device, dtype=torch.float32)
        return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=z.shape[-1] - 1)
    raise ValueError(f"sampling method {method!r} is not one of {list(SAMPLING_METHODS)}")


@dataclasses.dataclass
class TokenSampler:
    """What ``ElectraForPreTraining`` draws the replacements with: ``sample_tokens`` with these
    settings. The trainer installs one with its own checkpointed ``generator``
    (bertdist/train/electra_objective.py); the default draws from torch's global RNG."""

    temperature: float = 1.0
    method: str = "multinomial"
    generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return sample_tokens(logits, self.temperature, self.method, self.generator)


@dataclasses.dataclass
class ElectraPreTrainingOutput(PreTrainingOutput):
    """``prediction_logits`` / ``mlm_labels`` / ``mlm_loss``: the generator's, at the masked
    positions ([N, V] / [N]); ``seq_relationship_logits`` and ``nsp_loss`` are None (no NSP).
    ``loss`` is left to the objective, which weighs ``mlm_loss`` and ``disc_loss``."""

    discriminator_logits: torch.Tensor | None = None  # [B, S]
    replaced: torch.Tensor | None = None  # [B, S] bool: the discriminator's labels (False at padding)
    real: torch.Tensor | None = None  # [B, S] bool: the tokens the discriminator's loss averages over
    sampled_ids: torch.Tensor | None = None  # [N]: the generator's samples, in masked-position order
    corrupted_ids: torch.Tensor | None = None  # [B, S]: the discriminator's input
    disc_loss: torch.Tensor | None = None  # mean BCE over the real tokens


def replaced_token_loss(logits: torch.Tensor, replaced: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the discriminator's logits [B, S] against ``replaced``, averaged over
    the ``real`` (non-padding) tokens; fp32. Weighted by the mask, so it reads nothing back to the host."""
    per_token = F.binary_cross_entropy_with_logits(logits.float(), replaced.float(), reduction="none")
    weight = real.float()
    return (per_token * weight).sum() / weight.sum().clamp(min=1.0)


class ElectraForPreTraining(nn.Module):
    """Generator + discriminator over shared embeddings; ``forward`` runs the whole step: the
    generator at the masked positions, ``sampler`` for the replacements, the discriminator on the
    corrupted batch. A config without generator sizes builds the discriminator alone (for
    loading and export; ``forward`` then refuses)."""

    def __init__(self, cfg: ElectraConfig, device_type: str | None = None, kernels: KernelSet | None = None):
        super().__init__()
        self.config = cfg
        disc = cfg.discriminator_config()
        # ``kernels``: a set agreed by all ranks (the trainer's); else resolved from cfg.kernels here. The
        # generator's layers run the same set (its head size is the discriminator's in the paper's recipes).
        self.kernels = kernels if kernels is not None else resolve_kernels(
            cfg.kernels, device_type or _default_device_type(), model_config=disc)
        # The discriminator first: the shared embeddings are created, initialised and named under it.
        self.discriminator = ElectraDiscriminator(disc, cfg.embedding_width, self.kernels)
        self.generator = None
        if cfg.has_generator:
            self.generator = ElectraGenerator(cfg.generator_config(), cfg.embedding_width, self.kernels,
                                              embeddings=self.discriminator.electra.embeddings)
        self.sampler: TokenSampler = TokenSampler()

    @property
    def embeddings(self) -> BertEmbeddings:
        return self.discriminator.electra.embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        *,
        masked_positions: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: "int | torch.Tensor | None" = None,
    ) -> ElectraPreTrainingOutput:
        """``input_ids``: the masked batch; ``labels``: the original token at each masked position,
        IGNORE_INDEX elsewhere. ``next_sentence_label`` is accepted and not used (records built for
        BERT carry it; ELECTRA has no NSP). ``masked_positions`` and the packing: see
        ``BertForPreTraining.forward``."""
        if self.generator is None:
            raise ValueError("this ELECTRA model has no generator (a discriminator alone): it cannot run "
                             "replaced-token detection; call .discriminator(...) for its logits")
        if labels is None:
            raise ValueError("ELECTRA pretraining needs the MLM labels (the masked positions); the towers alone: "
                             ".generator(...) and .discriminator(...)")
        packing = dict(token_index=token_index, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if masked_positions is None:  # ascending flat positions with a label (one host sync)
            masked_positions = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        mlm_labels = labels.reshape(-1).index_select(0, masked_positions)
        logits = self.generator(input_ids, attention_mask, token_type_ids, positions=masked_positions,
                                sparse=self.config.sparse_mlm_head, **packing)
        sampled = self.sampler(logits.detach())
        original = torch.where(labels != IGNORE_INDEX, labels, input_ids)
        corrupted = original.reshape(-1).index_copy(0, masked_positions, sampled).view_as(original)
        real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        replaced = (corrupted != original) & real
        disc_logits = self.discriminator(corrupted, attention_mask, token_type_ids, **packing)
        return ElectraPreTrainingOutput(
            logits, None, mlm_loss=mlm_loss(logits, mlm_labels), mlm_labels=mlm_labels,
            discriminator_logits=disc_logits, replaced=replaced, real=real, sampled_ids=sampled,
            corrupted_ids=corrupted, disc_loss=replaced_token_loss(disc_logits, replaced, real))
