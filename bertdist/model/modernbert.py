"""ModernBERT (Warner et al., 2024) in one file: rotary positions, GeGLU, pre-norm without biases,
local sliding-window attention in every layer but every third (global), over padded or packed
sequences, and the masked-LM head with its decoder tied to the embeddings.

Module and parameter names mirror ``transformers.ModernBertForMaskedLM`` one to one, so a state
dict moves between the two without renaming (bertdist/export/modernbert_hf.py). Layer 0 has no
``attn_norm``: the embedding norm precedes it. Only the decoder has a bias.

Two input layouts, one set of weights:

- padded: ``input_ids`` [B, S] and an ``attention_mask`` [B, S]; with ``config.unpad`` the real
  tokens are packed before the first layer and scattered back after the last;
- packed: ``input_ids`` [T], the sequences back to back, and ``cu_seqlens`` [B + 1] with
  ``max_seqlen``; positions restart at 0 in each sequence, and attention stays inside it.

Attention goes through ``bertdist/ops/windowed_attention.py`` (``config.attention_backend``),
whose backends are tested against the reference there; ``auto`` runs ``attention_choice.UNMEASURED``
until the trainer sets the decided backend (``attention_choice.set_attention_backend``).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model.bert import Unpadded, host_int, mlm_loss
from bertdist.model.config import IGNORE_INDEX
from bertdist.model.modernbert_config import ModernBertConfig
from bertdist.ops.attention_choice import UNMEASURED
from bertdist.ops.windowed_attention import PADDED_BACKENDS, VARLEN_BACKENDS, Packing


def layer_norm(cfg: ModernBertConfig) -> nn.LayerNorm:
    """ModernBERT's LayerNorm: no bias."""
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)


class Rotary(nn.Module):
    """cos/sin of rotary embeddings for one base θ (ModernBERT has one for global layers, one for
    local ones). Computed in fp32 from the positions of each batch; no parameters, no buffers in
    the state dict."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., positions, heads, head_dim] in fp32; cos/sin are [..., positions, head_dim]."""
    xf = x.float()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.norm = layer_norm(cfg)
        self.drop = nn.Dropout(cfg.embedding_dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: ModernBertConfig, layer: int):
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.half_window = None if cfg.is_global(layer) else cfg.half_window
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.dropout_p = cfg.attention_dropout
        self.out_drop = nn.Dropout(cfg.attention_dropout)
        self.backend = UNMEASURED if cfg.attention_backend == "auto" else cfg.attention_backend

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: "torch.Tensor | Packing | None") -> torch.Tensor:
        """``h`` [B, S, hidden] with ``mask`` a [B, S] bool key-padding mask (or None), or packed
        ``h`` [T, hidden] with ``mask`` its ``Packing``."""
        qkv = self.Wqkv(h).view(*h.shape[:-1], 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(-3)  # [..., positions, heads, head_dim]
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        kwargs = dict(half_window=self.half_window, dropout_p=self.dropout_p, training=self.training,
                      scale=self.head_dim ** -0.5)
        if isinstance(mask, Packing):
            ctx = VARLEN_BACKENDS[self.backend](q, k, v, mask, **kwargs)  # [T, heads, head_dim]
        else:
            ctx = PADDED_BACKENDS[self.backend](*(t.transpose(1, 2) for t in (q, k, v)), mask, **kwargs)
            ctx = ctx.transpose(1, 2)  # [B, S, heads, head_dim]
        return self.out_drop(self.Wo(ctx.reshape(*h.shape[:-1], -1)))


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(gelu(x Wi_a) * x Wi_b)``, the two halves of ``Wi`` in one GEMM."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.drop = nn.Dropout(cfg.mlp_dropout)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x, gate = self.Wi(h).chunk(2, dim=-1)
        return self.Wo(self.drop(F.gelu(x) * gate))


class ModernBertEncoderLayer(nn.Module):
    """Pre-norm: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``; layer 0 has no attention norm."""

    def __init__(self, cfg: ModernBertConfig, layer: int):
        super().__init__()
        self.attn_norm = nn.Identity() if layer == 0 else layer_norm(cfg)
        self.attn = ModernBertAttention(cfg, layer)
        self.mlp_norm = layer_norm(cfg)
        self.mlp = ModernBertMLP(cfg)
        self.is_global = cfg.is_global(layer)

    def forward(self, h: torch.Tensor, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                mask: "torch.Tensor | Packing | None") -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), ropes[self.is_global], mask)
        return h + self.mlp(self.mlp_norm(h))


class ModernBertModel(nn.Module):
    """Embeddings -> layers -> final norm. Returns the hidden states of the input's layout."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = layer_norm(cfg)
        self.rotary = nn.ModuleDict({"global": Rotary(cfg.head_dim, cfg.global_rope_theta),
                                     "local": Rotary(cfg.head_dim, cfg.local_rope_theta)})

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: "int | torch.Tensor | None" = None
                ) -> torch.Tensor:
        """Padded ``input_ids`` [B, S] (``attention_mask`` [B, S], 1 = real token) -> [B, S, hidden],
        zeros at padding when ``config.unpad`` packs the batch; or packed ``input_ids`` [T] with
        ``cu_seqlens`` and ``max_seqlen`` -> [T, hidden]."""
        if cu_seqlens is not None:
            if max_seqlen is None or input_ids.dim() != 1:
                raise ValueError(f"packed input is input_ids [total_tokens] with cu_seqlens and max_seqlen; got "
                                 f"input_ids of shape {tuple(input_ids.shape)}, max_seqlen {max_seqlen}")
            packing = Packing.from_cu_seqlens(cu_seqlens, host_int(max_seqlen), input_ids.shape[0])
            return self.encode(self.embeddings(input_ids), packing.position, packing)
        if input_ids.dim() != 2:
            raise ValueError(f"padded input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}; "
                             "packed input ([total_tokens]) comes with cu_seqlens and max_seqlen")
        b, s = input_ids.shape
        h = self.embeddings(input_ids)
        if attention_mask is not None and self.config.unpad:
            unpadded = Unpadded.from_mask(attention_mask)
            packing = Packing.from_cu_seqlens(unpadded.cu_seqlens, unpadded.max_seqlen, unpadded.index.shape[0])
            return unpadded.unpack(self.encode(unpadded.pack(h), packing.position, packing))
        mask = None if attention_mask is None else attention_mask.bool()
        return self.encode(h, torch.arange(s, device=input_ids.device), mask, seq=s)

    def encode(self, h: torch.Tensor, positions: torch.Tensor, mask: "torch.Tensor | Packing | None",
               seq: int | None = None) -> torch.Tensor:
        longest = mask.max_seqlen if isinstance(mask, Packing) else seq
        if longest > self.config.max_position_embeddings:
            raise ValueError(f"a sequence of {longest} tokens is longer than the model's context, "
                             f"max_position_embeddings = {self.config.max_position_embeddings}")
        ropes = {True: self.rotary["global"](positions), False: self.rotary["local"](positions)}
        for layer in self.layers:
            h = layer(h, ropes, mask)
        return self.final_norm(h)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = layer_norm(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h)))


@dataclasses.dataclass
class MaskedLMOutput:
    logits: torch.Tensor  # [B, S, V] or [T, V]; [N_masked, V] with the sparse head and labels
    loss: torch.Tensor | None = None
    mlm_labels: torch.Tensor | None = None  # labels aligned with the logits' rows

    # The names pretraining reads from BERT's output (bertdist/train/objective.py): the loss is all MLM.
    @property
    def prediction_logits(self) -> torch.Tensor:
        return self.logits

    @property
    def mlm_loss(self) -> torch.Tensor | None:
        return self.loss

    nsp_loss = None
    seq_relationship_logits = None


def packed_inputs(batch: dict) -> dict:
    """The pretraining loader's batch (bertdist/train/loader.py, on the device) as ModernBERT's
    packed forward takes it: the real tokens back to back (``input_ids[token_index]``), attention
    segments as the loader's ``cu_seqlens`` give them (one per row, or one per document of a packed
    row), and the masked positions renumbered from the padded [B * S] layout to the packed [T] one
    (``token_index`` is ascending, so a search finds each; no host sync). Token types and NSP
    labels are not inputs of ModernBERT."""
    index = batch["token_index"]
    return {"input_ids": batch["input_ids"].reshape(-1).index_select(0, index),
            "labels": batch["labels"].reshape(-1).index_select(0, index),
            "cu_seqlens": batch["cu_seqlens"], "max_seqlen": batch["max_seqlen"],
            "masked_positions": torch.searchsorted(index, batch["masked_positions"])}


class ModernBertForMaskedLM(nn.Module):
    """ModernBERT with the MLM head; ``decoder.weight`` is the token embeddings (tied)."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.config = cfg
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
        init_weights(self, cfg)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: "int | torch.Tensor | None" = None,
                masked_positions: torch.Tensor | None = None) -> MaskedLMOutput:
        """``labels``: IGNORE_INDEX where there is no loss, in the layout of ``input_ids``.
        ``masked_positions``: the flat positions where ``labels`` is not IGNORE_INDEX, ascending
        (without them the sparse head finds them on the device)."""
        h = self.model(input_ids, attention_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        mlm_labels = labels
        if labels is not None and self.config.sparse_mlm_head:
            # Only masked positions go through the head and the [hidden, V] decoder.
            if masked_positions is None:
                masked_positions = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
            h = h.reshape(-1, h.shape[-1]).index_select(0, masked_positions)
            mlm_labels = labels.reshape(-1).index_select(0, masked_positions)
        logits = self.decoder(self.head(h))
        out = MaskedLMOutput(logits, mlm_labels=mlm_labels)
        if labels is not None:
            out.loss = mlm_loss(logits, mlm_labels)
        return out


@torch.no_grad()
def init_weights(model: ModernBertForMaskedLM, cfg: ModernBertConfig) -> None:
    """ModernBERT's init (transformers' ``_init_weights``): truncated normals, std 0.02 into a
    block, 0.02 / sqrt(2 * layers) out of it; LayerNorms at identity; the decoder bias zero."""
    std_in, std_out = cfg.initializer_range, cfg.initializer_range / math.sqrt(2.0 * cfg.num_hidden_layers)

    def trunc(weight: torch.Tensor, std: float) -> None:
        cut = cfg.initializer_cutoff_factor * std
        nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cut, b=cut)

    trunc(model.model.embeddings.tok_embeddings.weight, std_in)
    for layer in model.model.layers:
        trunc(layer.attn.Wqkv.weight, std_in)
        trunc(layer.attn.Wo.weight, std_out)
        trunc(layer.mlp.Wi.weight, std_in)
        trunc(layer.mlp.Wo.weight, std_out)
    trunc(model.head.dense.weight, std_out)
    nn.init.zeros_(model.decoder.bias)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
