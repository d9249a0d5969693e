"""The whole BERT model in one file.

Module and parameter names mirror ``transformers.BertForPreTraining`` one to
one, so a state dict moves between the two without renaming. Layer norm and
attention go through the kernel seam (``bertdist.ops``): ``self.kernels`` is
the ``KernelSet`` chosen from ``config.kernels`` at construction, either the
fused extension or the pure-PyTorch reference, side by side behind the same
calls. Parallelism (DeepSpeed, ZeRO) and activation checkpointing are applied
from outside (``bertdist/train/``); nothing here knows about ranks.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.model.config import IGNORE_INDEX, BertConfig
from bertdist.ops import KernelSet, resolve_kernels
from bertdist.ops.dispatch import BIAS_IN_KERNEL


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm's parameters (HF names ``weight``/``bias``), computed through the seam."""

    def __init__(self, hidden: int, eps: float, kernels: KernelSet):
        super().__init__(hidden, eps=eps)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, layer norm, dropout. ``width``: the embedding size
    when it is not the hidden size (ELECTRA's factorised embeddings, bertdist/model/electra.py)."""

    def __init__(self, cfg: BertConfig, kernels: KernelSet, width: int | None = None):
        super().__init__()
        width = cfg.hidden_size if width is None else width
        self.word_embeddings = nn.Embedding(cfg.vocab_size, width, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, width)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, width)
        self.LayerNorm = LayerNorm(width, cfg.layer_norm_eps, kernels)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.max_positions = cfg.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.max_positions:
            raise ValueError(f"sequence length {seq} exceeds max_position_embeddings {self.max_positions}")
        pos = self.position_embeddings.weight[:seq].unsqueeze(0)
        h = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids) + pos
        return self.dropout(self.LayerNorm(h))


@dataclasses.dataclass(frozen=True)
class Unpadded:
    """Where the real tokens of a padded [B, S] batch went when packed into [T] rows.

    ``index`` holds each real token's flat position in [B * S]; ``cu_seqlens`` [B + 1] (int32)
    the cumulative lengths; ``max_seqlen`` the longest sequence. Attention over packed rows
    uses these instead of a padding mask, so no FLOPs are spent on padding.
    """

    index: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    seq: int

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor) -> "Unpadded":
        """Derived from the mask on the device: the right-padding check, the token index (its
        size) and ``max_seqlen`` each read the device (3 host syncs). The trainer's batches carry
        these instead (``from_packing``)."""
        b, s = attention_mask.shape
        lengths = attention_mask.sum(dim=1, dtype=torch.int32)
        # Real tokens must be a prefix of each row (BERT batches are right-padded): no 0 before a 1.
        if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("unpadded attention needs right-padded batches: attention_mask rows must be 1...1 0...0")
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
        index = attention_mask.reshape(-1).nonzero(as_tuple=False).squeeze(1)
        return cls(index, cu, int(lengths.max()), b, s)

    @classmethod
    def from_packing(cls, token_index: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, batch: int,
                     seq: int) -> "Unpadded":
        """From what the loader computed on the host when it collated the batch: no host sync."""
        return cls(token_index, cu_seqlens, host_int(max_seqlen), batch, seq)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [T, ...] real tokens only."""
        return x.reshape(self.batch * self.seq, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, S, ...] with zeros at padding."""
        out = x.new_zeros(self.batch * self.seq, *x.shape[1:])
        out.index_copy_(0, self.index, x)
        return out.view(self.batch, self.seq, *x.shape[1:])


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig, kernels: KernelSet):
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.kernels = kernels

    def forward(self, h: torch.Tensor, mask: "torch.Tensor | Unpadded | None") -> torch.Tensor:
        # One GEMM for Q, K and V (the concatenated weight is tiny next to the activations).
        w = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
        qkv = F.linear(h, w, bias)
        if isinstance(mask, Unpadded):  # h is [T, hidden]: packed real tokens
            t = h.shape[0]
            q, k, v = qkv.view(t, 3, self.heads, self.head_dim).unbind(1)  # [T, heads, head_dim]
            ctx = self.kernels.varlen_attention(
                q, k, v, mask.cu_seqlens, mask.max_seqlen, dropout_p=self.dropout_p, training=self.training
            )
            return ctx.reshape(t, self.heads * self.head_dim)
        b, s, _ = h.shape
        # unbind, not qkv[0], qkv[1], qkv[2]: in backward each index would zero-fill a whole QKV
        # gradient and the three would be added; unbind's backward stacks them once.
        q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        ctx = self.kernels.attention(q, k, v, mask, dropout_p=self.dropout_p, training=self.training
                                     )  # [b, heads, s, head_dim]
        return ctx.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)


class DenseDropoutAddNorm(nn.Module):
    """Dense projection, then LN(residual + dropout(x + bias)) in one seam call: the output of
    both halves of a layer (HF's ``BertSelfOutput`` after attention, ``BertOutput`` after the FFN)."""

    def __init__(self, cfg: BertConfig, in_features: int, kernels: KernelSet):
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout_p = cfg.hidden_dropout_prob
        self.kernels = kernels
        # Fused kernels (ours, their emulated run, Inductor's) add the bias together with dropout
        # and the residual; torch's ops are faster with the bias inside the GEMM (addmm) than as
        # a separate element-wise pass.
        self.bias_in_kernel = kernels.sources["bias_dropout_add_layer_norm"] in BIAS_IN_KERNEL

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.bias_in_kernel:
            y, bias = F.linear(x, self.dense.weight), self.dense.bias
        else:
            y, bias = F.linear(x, self.dense.weight, self.dense.bias), None
        return self.kernels.bias_dropout_add_layer_norm(
            y, bias, residual, self.LayerNorm.weight, self.LayerNorm.bias,
            p=self.dropout_p, training=self.training, eps=self.LayerNorm.eps,
        )


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig, kernels: KernelSet):
        super().__init__()
        self.self = BertSelfAttention(cfg, kernels)
        self.output = DenseDropoutAddNorm(cfg, cfg.hidden_size, kernels)

    def forward(self, h: torch.Tensor, mask: "torch.Tensor | Unpadded | None") -> torch.Tensor:
        return self.output(self.self(h, mask), h)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(h))


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, kernels: KernelSet):
        super().__init__()
        self.attention = BertAttention(cfg, kernels)
        self.intermediate = BertIntermediate(cfg)
        self.output = DenseDropoutAddNorm(cfg, cfg.intermediate_size, kernels)

    def forward(self, h: torch.Tensor, mask: "torch.Tensor | Unpadded | None") -> torch.Tensor:
        a = self.attention(h, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig, kernels: KernelSet):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, kernels) for _ in range(cfg.num_hidden_layers))

    def forward(self, h: torch.Tensor, mask: "torch.Tensor | Unpadded | None") -> torch.Tensor:
        """``mask``: [B, S] bool key-padding mask for padded h, or ``Unpadded`` for packed h [T, hidden]."""
        for layer in self.layer:
            h = layer(h, mask)
        return h


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(h[:, 0]))


class BertModel(nn.Module):
    """Embeddings -> encoder -> pooler. Returns (sequence_output, pooled_output)."""

    def __init__(self, cfg: BertConfig, add_pooling_layer: bool = True, device_type: str | None = None,
                 kernels: KernelSet | None = None):
        super().__init__()
        self.config = cfg
        # ``kernels``: a set agreed by all ranks (the trainer's); else resolved from cfg.kernels here.
        self.kernels = kernels if kernels is not None else resolve_kernels(
            cfg.kernels, device_type or _default_device_type(), model_config=cfg)
        self.embeddings = BertEmbeddings(cfg, self.kernels)
        self.encoder = BertEncoder(cfg, self.kernels)
        self.pooler = BertPooler(cfg) if add_pooling_layer else None
        self.apply(lambda m: init_weights(m, cfg.initializer_range))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        token_index: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: "int | torch.Tensor | None" = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (sequence_output [B, S, hidden], pooled [B, hidden]).

        With ``config.unpad`` and a padding mask, the encoder runs on the packed real tokens only
        (varlen attention); embeddings, and so token types and positions, are computed before
        packing, and the output is scattered back (zeros at padding) for the heads.
        ``token_index``, ``cu_seqlens`` and ``max_seqlen`` (a host int): the packing of the
        batch, as the trainer's loader ships it (see ``bertdist.train.loader``); without them
        the packing is derived from the mask, at the price of host syncs."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = self.embeddings(input_ids, token_type_ids)
        h = encode(self.encoder, h, attention_mask, self.config.unpad, token_index=token_index,
                   cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return h, (self.pooler(h) if self.pooler is not None else None)


def encode(encoder: BertEncoder, h: torch.Tensor, attention_mask: torch.Tensor | None, unpad: bool, *,
           token_index: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
           max_seqlen: "int | torch.Tensor | None" = None) -> torch.Tensor:
    """The encoder over embedded inputs ``h`` [B, S, hidden]: on the packed real tokens with
    ``unpad`` and a padding mask (the output scattered back, zeros at padding), else padded.
    The packing arguments: see ``BertModel.forward``."""
    if attention_mask is not None and unpad:
        b, s = attention_mask.shape
        if token_index is not None and cu_seqlens is not None and max_seqlen is not None:
            unpadded = Unpadded.from_packing(token_index, cu_seqlens, max_seqlen, b, s)
        else:
            unpadded = Unpadded.from_mask(attention_mask)
        return unpadded.unpack(encoder(unpadded.pack(h), unpadded))
    return encoder(h, None if attention_mask is None else attention_mask.bool())


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: BertConfig, kernels: KernelSet):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, kernels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(h)))


class BertLMPredictionHead(nn.Module):
    """Transform, then a decoder tied to the word embeddings, plus a bias (HF: ``cls.predictions``)."""

    def __init__(self, cfg: BertConfig, word_embeddings: nn.Embedding, kernels: KernelSet):
        super().__init__()
        self.transform = BertPredictionHeadTransform(cfg, kernels)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.decoder.weight = word_embeddings.weight  # tied
        self.decoder.bias = self.bias  # one tensor under both HF names

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(h))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, cfg: BertConfig, word_embeddings: nn.Embedding, kernels: KernelSet):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, word_embeddings, kernels)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


@dataclasses.dataclass
class PreTrainingOutput:
    prediction_logits: torch.Tensor  # [B, S, V], or [N_masked, V] with the sparse head
    seq_relationship_logits: torch.Tensor  # [B, 2]
    loss: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None
    nsp_loss: torch.Tensor | None = None
    mlm_labels: torch.Tensor | None = None  # labels aligned with prediction_logits' rows


class BertForPreTraining(nn.Module):
    """BERT with the MLM and NSP (or SOP) heads."""

    def __init__(self, cfg: BertConfig, device_type: str | None = None, kernels: KernelSet | None = None):
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg, device_type=device_type, kernels=kernels)
        self.cls = BertPreTrainingHeads(cfg, self.bert.embeddings.word_embeddings, self.bert.kernels)
        decoder = self.cls.predictions.decoder  # its weight is the (already initialised) embedding
        for m in self.cls.modules():
            if m is not decoder:
                init_weights(m, cfg.initializer_range)

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
    ) -> PreTrainingOutput:
        """``masked_positions``: the flat positions in [B * S] where ``labels`` is not
        IGNORE_INDEX, ascending (the loader ships them); without them the sparse head finds them
        on the device (one host sync, for their count). ``token_index``, ``cu_seqlens``,
        ``max_seqlen``: see ``BertModel.forward``."""
        seq, pooled = self.bert(input_ids, attention_mask, token_type_ids, token_index=token_index,
                                cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        mlm_labels = labels
        if labels is not None and self.config.sparse_mlm_head:
            # Gather the masked positions before the vocab projection, as the original BERT does:
            # the [N, hidden] x [hidden, V] GEMM replaces a [B*S, hidden] x [hidden, V] one.
            if masked_positions is None:
                masked_positions = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
            seq = seq.reshape(-1, seq.shape[-1]).index_select(0, masked_positions)
            mlm_labels = labels.reshape(-1).index_select(0, masked_positions)
        logits = self.cls.predictions(seq)
        nsp_logits = self.cls.seq_relationship(pooled)
        out = PreTrainingOutput(logits, nsp_logits, mlm_labels=mlm_labels)
        if labels is not None:
            out.mlm_loss = mlm_loss(logits, mlm_labels)
            out.loss = out.mlm_loss
        if next_sentence_label is not None:
            out.nsp_loss = nsp_loss(nsp_logits, next_sentence_label)
            out.loss = out.nsp_loss if out.loss is None else out.loss + out.nsp_loss
        return out


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over predicted positions (labels == IGNORE_INDEX are ignored); fp32 softmax."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def nsp_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the 2-way next-sentence (or sentence-order) head; 0 = IsNext, 1 = random."""
    return F.cross_entropy(logits.float(), labels.reshape(-1))


def init_weights(module: nn.Module, std: float) -> None:
    """BERT's init: N(0, std) weights, zero biases, LayerNorm at identity, the padding row zero."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def host_int(value: "int | torch.Tensor") -> int:
    """An int given as an int or a one-element tensor (a device tensor costs a host sync)."""
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def count_parameters(module: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
