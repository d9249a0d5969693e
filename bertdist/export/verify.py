"""Check an HF directory against our model: same logits on a padded batch (fp32); for ELECTRA,
the discriminator's directory and the generator's (``generator/``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import torch

from bertdist.model import BertConfig, BertForPreTraining, ElectraConfig
from bertdist.model.modernbert_config import ModernBertConfig


def padded_batch(vocab_size: int, batch: int = 4, seq: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids with [CLS]/[SEP]-like structure, two segments and different amounts of padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(999, vocab_size // 2), vocab_size, (batch, seq), generator=g)  # past the specials
    mask = torch.zeros(batch, seq, dtype=torch.long)
    types = torch.zeros(batch, seq, dtype=torch.long)
    for i in range(batch):
        n = seq - (i * seq) // (batch + 1)  # row 0 full, later rows padded more
        mask[i, :n] = 1
        types[i, n // 2:n] = 1
        ids[i, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


@torch.no_grad()
def max_logit_diff(hf_dir: str | Path, cfg: BertConfig, state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Max |ours - HF| over real (unpadded) positions for MLM logits, and for the NSP logits. For an
    ELECTRA model (``electra_max_logit_diff``) the two keys the export command checks hold its two
    heads: "mlm" the generator's MLM logits (0 without a generator), "nsp" the discriminator's
    replaced-token logits (ELECTRA has no NSP head)."""
    if isinstance(cfg, ElectraConfig):
        d = electra_max_logit_diff(hf_dir, cfg, state_dict)
        return {"mlm": d.get("generator_mlm", 0.0), "nsp": d["discriminator"]}
    from transformers import BertForPreTraining as HFBertForPreTraining

    ours = BertForPreTraining(dataclasses.replace(cfg, kernels="reference"), device_type="cpu")
    ours.load_state_dict(state_dict, strict=True)
    ours.eval()
    hf = HFBertForPreTraining.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    batch = padded_batch(cfg.vocab_size, seq=min(32, cfg.max_position_embeddings))
    a = ours(**batch)
    b = hf(**batch)
    real = batch["attention_mask"].bool()
    return {
        "mlm": (a.prediction_logits - b.prediction_logits)[real].abs().max().item(),
        "nsp": (a.seq_relationship_logits - b.seq_relationship_logits).abs().max().item(),
    }


@torch.no_grad()
def electra_max_logit_diff(hf_dir: str | Path, cfg: ElectraConfig, state_dict: Mapping[str, torch.Tensor]
                           ) -> dict[str, float]:
    """Max |ours - HF| over real positions: "discriminator" (``ElectraForPreTraining`` at ``hf_dir``)
    and, with a generator, "generator_mlm" (``ElectraForMaskedLM`` at ``hf_dir/generator``)."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining as HFElectraForPreTraining

    from bertdist.export.electra_hf import GENERATOR_DIR
    from bertdist.model.electra import ElectraForPreTraining

    ours = ElectraForPreTraining(dataclasses.replace(cfg, kernels="reference"), device_type="cpu")
    ours.load_state_dict(state_dict, strict=True)
    ours.eval()
    batch = padded_batch(cfg.vocab_size, seq=min(32, cfg.max_position_embeddings))
    real = batch["attention_mask"].bool()
    hf = HFElectraForPreTraining.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = {"discriminator": (ours.discriminator(**batch) - hf(**batch).logits)[real].abs().max().item()}
    if ours.generator is not None:
        gen = ElectraForMaskedLM.from_pretrained(str(Path(hf_dir) / GENERATOR_DIR), dtype=torch.float32).eval()
        out["generator_mlm"] = (ours.generator(**batch) - gen(**batch).logits)[real].abs().max().item()
    return out


@torch.no_grad()
def modernbert_max_logit_diff(hf_dir: str | Path, cfg: ModernBertConfig, state_dict: Mapping[str, torch.Tensor]
                              ) -> dict[str, float]:
    """Max |ours - HF| MLM logits over real positions, ``ModernBertForMaskedLM`` at ``hf_dir``: on a
    padded batch longer than the local window (so local and global layers differ), our padded path
    ("mlm") and our packed one ("mlm_packed")."""
    from transformers import ModernBertForMaskedLM as HFModernBertForMaskedLM

    from bertdist.model.modernbert import ModernBertForMaskedLM

    ours = ModernBertForMaskedLM(dataclasses.replace(cfg, unpad=False)).eval()
    ours.load_state_dict(state_dict, strict=True)
    hf = HFModernBertForMaskedLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    batch = padded_batch(cfg.vocab_size, seq=min(cfg.local_attention + 32, cfg.max_position_embeddings))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    real = mask.bool()
    want = hf(input_ids=ids, attention_mask=mask).logits
    lengths = mask.sum(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    packed = ours(ids[real], cu_seqlens=cu, max_seqlen=int(lengths.max())).logits
    return {"mlm": (ours(ids, mask).logits - want)[real].abs().max().item(),
            "mlm_packed": (packed - want[real]).abs().max().item()}
