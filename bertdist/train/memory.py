"""An estimate of one GPU's memory for a pretraining config, from the model config alone.

No torch import: ``bertdist pretrain --plan`` prints it for a device the machine may not have.

Per GPU, with P parameters, N data-parallel ranks and ZeRO stage z (a term divided by N where
that stage partitions it):

- weights: P x (4 for fp32 and bf16 under autocast, whose weights are fp32; 2 for fp16 and bf16
  weights), / N at z = 3;
- fp32 master weights: P x 4 for fp16 and bf16 weights (fp32, and bf16 under autocast, update the
  weights themselves), / N at z >= 1;
- bf16 weight copies: P x 2 for bf16 under autocast, which makes them once per forward and keeps
  them until the backward;
- gradients: P x (4, or 2 for fp16), / N at z >= 2; bf16 weights (ZeRO 0): P x (2 + 4), each
  micro-batch's bf16 gradient and the fp32 sum;
- optimizer state: LAMB and AdamW keep two fp32 moments, P x 8, / N at z >= 1;
- activations kept for the backward of one micro-batch of b sequences of length s, hidden h,
  a heads, L layers, e bytes per activation element (2 under bf16/fp16, 4 in fp32), one byte
  per dropout-mask element, after Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models", section 4.1; 34sbh + 5as^2b at e = 2):
      per layer  s*b*h*(16e + 2) + a*s^2*b*(2e + 1)
  The a*s^2*b term is the attention probabilities and their dropout mask; flash-style attention
  (our fused kernels, SDPA's flash and memory-efficient backends) keeps O(s) per head instead,
  so it is reported separately. Plus the MLM head: the b x m predicted positions' logits over
  the vocabulary V and their gradient, in fp32 (m = max_predictions_per_seq with the sparse
  head, s without);
- with activation checkpointing of every layer: the L layer inputs (s*b*h*e each) plus one
  layer's activations, rebuilt during its backward.

ELECTRA (an ``ElectraConfig``): P counts both towers and the shared embeddings
(``electra_parameter_count``); activations add the generator's layers (its h and a) to the
discriminator's, and the head term is the generator's MLM head over the predicted positions (at
the embedding size) plus the discriminator's head over all s tokens; the per-layer figures
reported are the discriminator's.

ModernBERT (a ``ModernBertConfig``, ``estimate_modernbert_memory``): P from
``modernbert_parameter_count``; its batches are packed (no padding), s being the longest sequence
a micro-batch holds (8,192 after context extension). Per layer, e bytes per element: the two
LayerNorm inputs and outputs (4 s*b*h), q, k and v before and after RoPE (6 s*b*h), the attention
output (s*b*h), GeGLU's 2f-wide input projection, its GELU and gated product (4 s*b*f), and, where
dropout is on, a byte per element of each dropout mask. Attention never keeps probabilities (every
backend is flash-style or re-pads for SDPA's fused kernels) except ``attention_backend:
reference``, which keeps a*s^2*b*e; the ``sdpa`` backend re-pads q, k, v and the output to the
longest sequence (4 s*b*h*e more) and keeps one [b, s, s] bool mask per layer (b*s^2 bytes, 0.5 GiB
per layer at b = 8, s = 8,192). The head: the predicted positions' logits and their gradient in fp32
(m = ceil(mask_prob x s) with the sparse head).

Not included: the CUDA context and libraries (about 0.5-1 GiB), allocator fragmentation,
communication buffers and temporaries such as the largest matmul's workspace.
"""
from __future__ import annotations

import dataclasses
import math

from bertdist.model.config import ElectraConfig

GIB = 2**30


def _layer_parameters(h: int, f: int) -> int:
    return (4 * h * h + 4 * h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h


def bert_parameter_count(m) -> int:
    """Parameters of ``BertForPreTraining`` for a ``BertConfig`` (the MLM decoder tied to the embeddings);
    of ``ElectraForPreTraining`` for an ``ElectraConfig``."""
    if isinstance(m, ElectraConfig):
        return electra_parameter_count(m)
    h, f, v = m.hidden_size, m.intermediate_size, m.vocab_size
    embeddings = (v + m.max_position_embeddings + m.type_vocab_size) * h + 2 * h
    pooler = h * h + h
    mlm_head = (h * h + h) + 2 * h + v  # transform, its LayerNorm, the decoder bias
    nsp_head = 2 * h + 2
    return embeddings + m.num_hidden_layers * _layer_parameters(h, f) + pooler + mlm_head + nsp_head


def electra_parameter_count(m: ElectraConfig) -> int:
    """Parameters of ``ElectraForPreTraining``: the shared embeddings (width E) once; per tower a
    projection from E where its hidden size differs, and its layers; the discriminator's head
    (dense, dense_prediction); the generator's (dense to E, LayerNorm, the tied decoder's bias)."""
    e, v = m.embedding_width, m.vocab_size
    total = (v + m.max_position_embeddings + m.type_vocab_size) * e + 2 * e

    def tower(h: int, f: int, layers: int) -> int:
        return (e * h + h if e != h else 0) + layers * _layer_parameters(h, f)

    h = m.hidden_size
    total += tower(h, m.intermediate_size, m.num_hidden_layers) + (h * h + h) + (h + 1)
    if m.has_generator:
        g = m.generator_hidden_size
        total += tower(g, m.generator_intermediate_size, m.generator_num_hidden_layers) + (g * e + e) + 2 * e + v
    return total


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    weights: int  # bytes, per GPU
    master_weights: int
    autocast_copies: int
    gradients: int
    optimizer_state: int
    activations_per_layer: int  # without the attention-probability term
    attention_probs_per_layer: int  # the a*s^2*b term (0 with flash-style attention)
    mlm_head_activations: int
    activations: int  # all layers + head, attention probabilities included
    activations_checkpointed: int
    total: int  # weights + masters + autocast copies + gradients + optimizer state + activations
    total_checkpointed: int

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["total_gib"] = round(self.total / GIB, 2)
        d["total_checkpointed_gib"] = round(self.total_checkpointed / GIB, 2)
        return d


def _states(p: int, precision: str, zero_stage: int, world_size: int,
            weights_dtype: str | None = None) -> tuple[int, int, int, int, int]:
    """(weights, fp32 masters, autocast copies, gradients, optimizer state) per GPU for P = ``p``;
    ``weights_dtype`` "bf16": bf16 weights with fp32 masters and an fp32 gradient sum beside the
    bf16 gradients, and no autocast copies."""
    n = max(1, world_size)
    bf16_weights = precision == "bf16" and weights_dtype == "bf16"
    weight_bytes = 2 if precision == "fp16" or bf16_weights else 4
    return (p * weight_bytes // (n if zero_stage == 3 else 1),
            p * 4 // (n if zero_stage >= 1 else 1) if precision == "fp16" or bf16_weights else 0,
            p * 2 if precision == "bf16" and not bf16_weights else 0,
            p * (weight_bytes + 4 if bf16_weights else weight_bytes) // (n if zero_stage >= 2 else 1),
            p * 8 // (n if zero_stage >= 1 else 1))


def estimate_modernbert_memory(model, *, micro_batch: int, seq: int, precision: str, zero_stage: int,
                               world_size: int, max_predictions: int | None, sparse_mlm_head: bool = True,
                               mask_prob: float = 0.3, weights_dtype: str | None = None) -> MemoryEstimate:
    """``model``: a ``ModernBertConfig`` (the module docstring)."""
    from bertdist.model.flops import modernbert_parameter_count

    p = modernbert_parameter_count(model)
    weights, masters, copies, grads, opt = _states(p, precision, zero_stage, world_size, weights_dtype)
    e = 4 if precision == "fp32" else 2
    b, s, h, f, a, L = (micro_batch, seq, model.hidden_size, model.intermediate_size, model.num_attention_heads,
                        model.num_hidden_layers)
    masks = (s * b * h if model.attention_dropout else 0) * 2 + (s * b * f if model.mlp_dropout else 0)
    per_layer = s * b * h * 11 * e + 4 * s * b * f * e + masks
    backend = model.attention_backend
    if backend == "auto":  # decided at the run's start; estimated as SDPA (attention_choice.UNMEASURED)
        backend = "sdpa"
    if backend == "reference":
        probs = a * s * s * b * e
    elif backend == "sdpa":
        per_layer += 4 * s * b * h * e
        probs = b * s * s
    else:
        probs = 0
    m = (max_predictions or math.ceil(mask_prob * s)) if sparse_mlm_head else s
    head = 2 * b * m * model.vocab_size * 4 + b * m * h * e * 2
    activations = L * (per_layer + probs) + head
    checkpointed = L * s * b * h * e + per_layer + probs + head
    states = weights + masters + copies + grads + opt
    return MemoryEstimate(p, weights, masters, copies, grads, opt, per_layer, probs, head, activations, checkpointed,
                          states + activations, states + checkpointed)


def estimate_memory(model, *, micro_batch: int, seq: int, precision: str, zero_stage: int, world_size: int,
                    max_predictions: int | None, sparse_mlm_head: bool = True,
                    mask_prob: float = 0.15, weights_dtype: str | None = None) -> MemoryEstimate:
    """``model``: a ``BertConfig``. Bytes per GPU by the formulas in this module's docstring.
    ``weights_dtype``: the weights' dtype (``TrainConfig.weights``); None: fp16's or fp32."""
    p = bert_parameter_count(model)
    weights, masters, copies, grads, opt = _states(p, precision, zero_stage, world_size, weights_dtype)

    e = 4 if precision == "fp32" else 2
    b, s, h, a, L = micro_batch, seq, model.hidden_size, model.num_attention_heads, model.num_hidden_layers
    per_layer = s * b * h * (16 * e + 2)
    probs = a * s * s * b * (2 * e + 1)
    m = (max_predictions or math.ceil(mask_prob * s)) if sparse_mlm_head else s
    head = 2 * b * m * model.vocab_size * 4 + b * m * h * e * 2
    activations = L * (per_layer + probs) + head
    checkpointed = L * s * b * h * e + per_layer + probs + head
    if isinstance(model, ElectraConfig) and model.has_generator:
        hg, ag, Lg = model.generator_hidden_size, model.generator_num_attention_heads, model.generator_num_hidden_layers
        g_layer, g_probs = s * b * hg * (16 * e + 2), ag * s * s * b * (2 * e + 1)
        head = 2 * b * m * model.vocab_size * 4 + b * m * model.embedding_width * e * 2 + b * s * h * e * 2
        activations = L * (per_layer + probs) + Lg * (g_layer + g_probs) + head
        checkpointed = (L * h + Lg * hg) * s * b * e + max(per_layer + probs, g_layer + g_probs) + head
    states = weights + masters + copies + grads + opt
    return MemoryEstimate(p, weights, masters, copies, grads, opt, per_layer, probs, head, activations, checkpointed,
                          states + activations, states + checkpointed)
