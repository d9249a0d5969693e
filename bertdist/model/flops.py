"""Parameter and FLOP accounting for BERT (used by `model summary`, MFU logging and benchmarks).

FLOPs count a multiply-add as 2. Training costs 3x the forward (forward, plus
backward for activations and for weights). Per sequence of ``seq`` real tokens:

- encoder GEMMs: 2 * seq * (4 d^2 + 2 d f) per layer, i.e. 2 x non-embedding
  matmul parameters x tokens (BERT's "6 N T" for training);
- attention scores and context: 2 * seq^2 * d each, per layer;
- MLM head: 2 * P * (d^2 + d V) for P predicted positions (P = seq for a dense head);
- pooler and NSP head: 2 * (d^2 + 2 d).
Embedding lookups and element-wise ops are not counted, as is customary for MFU.

ELECTRA (``ElectraConfig``) counts both towers, each trained: the generator's encoder and its MLM
head (2 * P * (h_g * E + E * V) at the P masked positions), the discriminator's encoder and its
replaced-token head on every token (2 * seq * (d^2 + d)), and each tower's projection from the
embedding size E where it differs from its hidden size (2 * seq * E * h). Sampling is not counted.

ModernBERT (``ModernBertConfig``), per layer: the GEMMs 2 * seq * (4 d^2 + 3 d f) (fused QKV and
output projections; GeGLU's input projection is 2f wide, its output f); RoPE's rotation of q and k,
3 FLOPs per element (x * cos + rotate(x) * sin), 2 * 3 * seq * d; GeGLU's gate product seq * f;
attention scores and context 2 * 2 * K * d, where K is the number of (query, key) pairs the layer
computes: seq^2 in a global layer, and in a local one each query sees itself and at most
``local_attention / 2`` keys on each side inside its sequence (at most ``local_attention + 1``
keys, fewer at the edges). The MLM head (dense d x d, then the tied decoder d x V) at the P
predicted positions: 2 * P * (d^2 + d V). No pooler, no NSP head. Norms, GELU and softmax are not
counted, as for BERT.
"""
from __future__ import annotations

from bertdist.model.config import BertConfig, ElectraConfig
from bertdist.model.modernbert_config import ModernBertConfig


def forward_flops_per_sequence(cfg, seq: int, predicted: int | None = None) -> dict[str, int]:
    """The forward FLOPs of one sequence of ``seq`` tokens with ``predicted`` MLM positions (None:
    all), by part, for any model family (bertdist/model/families.py)."""
    from bertdist.model.families import family_of

    return family_of(cfg).flops(cfg, seq, predicted)


def bert_forward_flops(cfg: BertConfig, seq: int, predicted: int | None = None) -> dict[str, int]:
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    p = seq if predicted is None else predicted
    parts = {
        "encoder_gemm": L * 2 * seq * (4 * d * d + 2 * d * f),
        "attention": L * 2 * (2 * seq * seq * d),
        "mlm_head": 2 * p * (d * d + d * v),
        "pooler_nsp": 2 * (d * d + 2 * d),
    }
    parts["total"] = sum(parts.values())
    return parts


def _encoder(cfg: BertConfig, seq: int) -> tuple[int, int]:
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    return L * 2 * seq * (4 * d * d + 2 * d * f), L * 2 * (2 * seq * seq * d)


def electra_forward_flops_per_sequence(cfg: ElectraConfig, seq: int, predicted: int | None = None) -> dict[str, int]:
    """Generator + discriminator (the module docstring); without generator sizes, the discriminator alone."""
    e, v, d = cfg.embedding_width, cfg.vocab_size, cfg.hidden_size
    p = seq if predicted is None else predicted
    gemm, attention = _encoder(cfg, seq)
    parts = {"discriminator_encoder_gemm": gemm, "discriminator_attention": attention,
             "discriminator_head": 2 * seq * (d * d + d),
             "embeddings_project": 2 * seq * e * d if e != d else 0}
    if cfg.has_generator:
        g = cfg.generator_config()
        gemm, attention = _encoder(g, seq)
        h = g.hidden_size
        parts.update(generator_encoder_gemm=gemm, generator_attention=attention,
                     generator_mlm_head=2 * p * (h * e + e * v))
        parts["embeddings_project"] += 2 * seq * e * h if e != h else 0
    parts["total"] = sum(parts.values())
    return parts


def window_pairs(seq: int, half_window: int) -> int:
    """(query, key) pairs of a sliding-window layer over one sequence of ``seq`` tokens: each query
    sees itself and up to ``half_window`` tokens on each side: seq + 2 * sum_i min(i, half_window)."""
    if seq <= 0:
        return 0
    edge = min(seq - 1, half_window)
    one_side = edge * (edge + 1) // 2 + (seq - 1 - edge) * half_window
    return seq + 2 * one_side


def modernbert_forward_flops(cfg: ModernBertConfig, seq: int, predicted: int | None = None) -> dict[str, int]:
    """ModernBERT's parts (the module docstring): global and local attention counted apart."""
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    p = seq if predicted is None else predicted
    n_global = sum(cfg.is_global(i) for i in range(L))
    parts = {
        "encoder_gemm": L * 2 * seq * (4 * d * d + 3 * d * f),
        "rope": L * 2 * 3 * seq * d,
        "geglu_gate": L * seq * f,
        "global_attention": n_global * 2 * 2 * seq * seq * d,
        "local_attention": (L - n_global) * 2 * 2 * window_pairs(seq, cfg.half_window) * d,
        "mlm_head": 2 * p * (d * d + d * v),
    }
    parts["total"] = sum(parts.values())
    return parts


def modernbert_batch_train_flops(cfg: ModernBertConfig, cu_seqlens, predicted):
    """Training FLOPs of one packed batch, counted on its segments (``cu_seqlens``, a device tensor:
    rows, or documents packed into rows) rather than at a padded width: the linear parts on the
    real tokens, global attention on each segment's length squared, local attention on each
    segment's window pairs, the head at ``predicted`` positions (a device count; all tokens with the
    dense head). A float64 device tensor, computed without reading the device."""
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    n_global = sum(cfg.is_global(i) for i in range(L))
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
    tokens = lens.sum()
    hw = cfg.half_window
    edge = (lens - 1).clamp(min=0, max=hw)  # window_pairs, for every segment at once
    pairs = lens + 2 * (edge * (edge + 1) / 2 + (lens - 1 - edge).clamp(min=0) * hw)
    forward = (tokens * L * (2 * (4 * d * d + 3 * d * f) + 2 * 3 * d + f)
               + n_global * 2 * 2 * d * (lens * lens).sum() + (L - n_global) * 2 * 2 * d * pairs.sum())
    head = (predicted if cfg.sparse_mlm_head else tokens) * (2 * (d * d + d * v))
    return 3 * (forward + head)


def modernbert_parameter_count(cfg: ModernBertConfig) -> int:
    """Parameters of ``ModernBertForMaskedLM`` (the decoder's weight tied to the embeddings; no biases
    but the decoder's; layer 0 has no attention norm)."""
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    layer = 4 * d * d + 3 * d * f + 2 * d  # Wqkv, Wo, GeGLU Wi (2f) and Wo, attention and MLP norms
    return v * d + d + L * layer - d + d + (d * d + d) + v  # embeddings + norm, layers, final norm, head, bias


def train_flops_per_sequence(cfg: BertConfig, seq: int, predicted: int | None = None) -> int:
    return 3 * forward_flops_per_sequence(cfg, seq, predicted)["total"]


def mfu(cfg: BertConfig, sequences_per_s: float, seq: int, peak_flops: float, predicted: int | None = None) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak."""
    return sequences_per_s * train_flops_per_sequence(cfg, seq, predicted) / peak_flops
