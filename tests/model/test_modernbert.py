"""ModernBERT against transformers' ModernBertForMaskedLM with the same weights (fp32, padded and
packed, 128 and 2,048 tokens), the sliding window's exactness, the sizes, and bad input."""
from __future__ import annotations

import pytest
import torch

from bertdist.config import ConfigError
from bertdist.export.modernbert_hf import hf_config_dict
from bertdist.model.bert import count_parameters
from bertdist.model.modernbert import ModernBertForMaskedLM
from bertdist.model.modernbert_config import ModernBertConfig

transformers = pytest.importorskip("transformers")

VOCAB = 256
TOLERANCE = 1e-5


def tiny(**overrides) -> ModernBertConfig:
    """Three layers (global, local, local), a window of 16 (8 each side), a small vocabulary."""
    return ModernBertConfig.from_preset("tiny", **{**dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                                                          eos_token_id=2, cls_token_id=1, sep_token_id=2,
                                                          local_attention=16), **overrides})


def hf_twin(model: ModernBertForMaskedLM):
    """transformers' ModernBertForMaskedLM (SDPA) holding ``model``'s weights."""
    hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig.from_dict(
        hf_config_dict(model.config), attn_implementation="sdpa")).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def models(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    ours = ModernBertForMaskedLM(tiny(**overrides)).eval()
    return ours, hf_twin(ours)


def random_lengths(total: int, seed: int) -> list[int]:
    """Sequence lengths that fill ``total`` tokens, some shorter and some longer than the window."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(3, max(4, total // 3), (1,), generator=g)), total - sum(lengths)))
    return lengths


def padded_batch(lengths: list[int], seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@pytest.mark.parametrize("tokens", [128, 2048])
@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
@torch.no_grad()
def test_padded_logits_match_transformers(tokens, unpad):
    ours, hf = models(unpad=unpad)
    ids, mask = padded_batch([tokens, tokens - 37, tokens // 3], tokens)
    got = ours(ids, mask).logits
    want = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert got.shape == want.shape
    diff = (got - want)[real].abs().max().item()
    assert diff <= TOLERANCE, f"max |ours - transformers| = {diff:.3e} over {int(real.sum())} real tokens"


@pytest.mark.parametrize("tokens,backend", [(128, "sdpa"), (128, "flex"), (128, "reference"), (2048, "sdpa")])
@torch.no_grad()
def test_packed_logits_match_transformers_per_sequence(tokens, backend):
    """The packed batch against transformers run on the same sequences as a padded batch: attention
    stays inside each sequence, positions restart at 0 in each."""
    ours, hf = models(attention_backend=backend)
    lengths = random_lengths(tokens, seed=tokens)
    ids, mask = padded_batch(lengths, max(lengths), seed=1)
    packed = ids[mask.bool()]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    got = ours(packed, cu_seqlens=cu, max_seqlen=max(lengths)).logits
    want = hf(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    assert got.shape == (tokens, VOCAB)
    diff = (got - want).abs().max().item()
    assert diff <= TOLERANCE, f"max |ours - transformers| = {diff:.3e}, {len(lengths)} sequences {lengths}"


@torch.no_grad()
def test_sparse_head_gives_the_masked_rows_and_their_loss():
    ours, hf = models()
    ids, mask = padded_batch([40, 25], 40)
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[0, 30], labels[1, 7] = 5, 6, 7
    out = ours(ids, mask, labels)
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == (3, VOCAB)
    assert torch.equal(out.mlm_labels, torch.tensor([5, 6, 7]))
    assert abs(out.loss.item() - ref.loss.item()) <= TOLERANCE


def attention_output(model: ModernBertForMaskedLM, layer: int, h: torch.Tensor) -> torch.Tensor:
    """The attention of one layer on hidden states ``h`` [1, S, hidden] (padded path, no padding):
    where the window applies, without the residual that would hide a small change."""
    encoder = model.model
    pos = torch.arange(h.shape[1])
    rope = encoder.rotary["global" if model.config.is_global(layer) else "local"](pos)
    return encoder.layers[layer].attn(h, rope, None)


@torch.no_grad()
def test_window_is_exact_in_local_layers_and_absent_in_global_ones():
    model, _ = models()
    half = model.config.half_window  # 8
    query, seq = 30, 64
    h = torch.randn(1, seq, model.config.hidden_size)
    outside = h.clone()
    far = [p for p in range(seq) if abs(p - query) > half]
    outside[0, far] += torch.randn(len(far), model.config.hidden_size)
    edge = h.clone()
    edge[0, query - half] += torch.randn(model.config.hidden_size)  # the window's edge: still seen
    local, global_ = 1, 0
    assert not model.config.is_global(local) and model.config.is_global(global_)

    def moved(layer, changed):
        return (attention_output(model, layer, h)[0, query] - attention_output(model, layer, changed)[0, query]
                ).abs().max().item()

    assert moved(local, outside) == 0.0
    assert moved(local, edge) > 1e-4
    assert moved(global_, outside) > 1e-4


@pytest.mark.parametrize("backend", ["sdpa", "flex", "reference"])
@torch.no_grad()
def test_packed_sequences_do_not_see_each_other(backend):
    model, _ = models(attention_backend=backend)
    lengths = [20, 33, 11]
    ids = torch.randint(3, VOCAB, (sum(lengths),))
    cu = torch.tensor([0, 20, 53, 64], dtype=torch.int32)
    changed = ids.clone()
    changed[20:53] = torch.randint(3, VOCAB, (33,))  # the middle sequence only
    a = model(ids, cu_seqlens=cu, max_seqlen=33).logits
    b = model(changed, cu_seqlens=cu, max_seqlen=33).logits
    assert torch.equal(a[:20], b[:20]) and torch.equal(a[53:], b[53:])
    assert not torch.allclose(a[20:53], b[20:53])


@pytest.mark.parametrize("preset,millions", [("base", 149), ("large", 395)])
def test_sizes_are_the_papers_and_transformers(preset, millions):
    cfg = ModernBertConfig.from_preset(preset)
    with torch.device("meta"):
        ours = count_parameters(ModernBertForMaskedLM(cfg))
        theirs = count_parameters(transformers.ModernBertForMaskedLM(
            transformers.ModernBertConfig.from_dict(hf_config_dict(cfg))))
    assert ours == theirs
    assert round(ours / 1e6) in (millions, millions + 1), f"{preset}: {ours:,} parameters"


def test_window_larger_than_the_context_is_refused():
    with pytest.raises(ConfigError, match=r"local_attention \(256\) is larger than the context.*\(128\)"):
        tiny(local_attention=256, max_position_embeddings=128)


def test_head_size_rope_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="hidden_size 66 / num_attention_heads 2 = head size 33"):
        tiny(hidden_size=66)


@torch.no_grad()
def test_sequence_longer_than_the_context_is_refused():
    model, _ = models(max_position_embeddings=64)
    with pytest.raises(ValueError, match="65 tokens is longer than the model's context.*= 64"):
        model(torch.randint(3, VOCAB, (1, 65)))
    cu = torch.tensor([0, 10, 80], dtype=torch.int32)
    with pytest.raises(ValueError, match="70 tokens is longer than the model's context.*= 64"):
        model(torch.randint(3, VOCAB, (80,)), cu_seqlens=cu, max_seqlen=70)


@torch.no_grad()
def test_packed_input_must_be_one_row_of_tokens():
    model, _ = models()
    with pytest.raises(ValueError, match=r"got input_ids of shape \(2, 10\), max_seqlen 10"):
        model(torch.randint(3, VOCAB, (2, 10)), cu_seqlens=torch.tensor([0, 10, 20], dtype=torch.int32), max_seqlen=10)
