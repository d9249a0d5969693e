"""Check an HF directory against our model: same logits on a padded batch (fp32)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

import torch

from bertdist.model import BertConfig, BertForPreTraining


def padded_batch(vocab_size: int, batch: int = 4, seq: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids with [CLS]/[SEP]-like structure, two segments and different amounts of padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(999, vocab_size, (batch, seq), generator=g)
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
    """Max |ours - HF| over real (unpadded) positions for MLM logits, and for the NSP logits."""
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
