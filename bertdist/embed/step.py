"""One training step's loss, by family, over a rank's share of a batch of units: ``embed`` (MNRL
over the global batch, or a distillation loss), ``sts`` (CoSENT or cosine MSE), ``rerank``
(listwise softmax or pointwise BCE over a cross-encoder's scores)."""
from __future__ import annotations

import random

import numpy as np
import torch

from bertdist.embed.config import EmbedConfig, resolved_negatives
from bertdist.embed.gather import global_batch_mnrl
from bertdist.embed.model import forward_by_length


class StepLoss:
    """One family's forward + loss over a rank's share of a batch of units."""

    def __init__(self, cfg: EmbedConfig, model, loss: str, distill: dict | None):
        self.cfg, self.model, self.loss, self.distill = cfg, model, loss, distill or {}
        self.k = resolved_negatives(cfg)

    def _autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16" and not self.ds)

    def _embed(self, fwd, texts: list[str], **kw) -> torch.Tensor:
        device = next(self.model.parameters()).device

        def one(batch):
            with self._autocast(device):
                return fwd(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], full_width=True, **kw)

        return forward_by_length(one, self.model.features(texts, self.cfg.max_seq_length), self.cfg.length_groups,
                                 device)

    def step_loss(self, fwd, units: list[dict], rng: random.Random) -> torch.Tensor:
        self.ds = fwd is not self.model
        if self.cfg.task == "sts":
            return self._sts(fwd, units)
        if self.cfg.task == "rerank":
            return self._rerank(fwd, units, rng)
        return self._retrieval(fwd, units, rng)

    def _mnrl(self, q: torch.Tensor, p: torch.Tensor, n: torch.Tensor | None) -> torch.Tensor:
        """MNRL over the global batch, summed over the Matryoshka widths."""
        c = self.cfg
        return global_batch_mnrl(q, p, n, c.scale, c.symmetric, c.matryoshka_dims, c.matryoshka_weights)

    def _negatives(self, u: dict, rng: random.Random) -> list[str]:
        pool = u["negs"]
        return list(pool) if len(pool) <= self.k else rng.sample(pool, self.k)

    def _retrieval(self, fwd, units, rng) -> torch.Tensor:
        negs = [self._negatives(u, rng) for u in units]
        flat = [n for ns in negs for n in ns]
        qs, ps = [u["q"] for u in units], [u["p"] for u in units]
        b = len(units)
        kind = self.distill.get("loss")
        kw = {"normalize": self.distill["teacher_normalize"]} if kind == "embedding_mse" else {}
        # Queries and passages in separate forwards, each padded to its own longest: padding short
        # queries to passage length doubled a MiniLM step at seq 256 (5.0 s against 2.6 s).
        q = self._embed(fwd, qs, **kw)
        d = self._embed(fwd, ps + flat, **kw)
        p, n = d[:b], (d[b:] if flat else None)
        if kind is None:
            return self._mnrl(q, p, n)
        from bertdist.embed.distill import embedding_mse, margin_mse

        if kind == "margin_mse":
            margin = torch.tensor([u["margin"] for u in units], dtype=torch.float32)
            loss = margin_mse(q, p, n, margin, self.cfg.scale)
        else:
            vecs = self.distill["vectors"]
            target = torch.from_numpy(np.stack([vecs[u["tq"]] for u in units] + [vecs[u["tp"]] for u in units]))
            loss = embedding_mse(torch.cat([q, p]), target)
        w = self.cfg.distill_task_weight
        return loss + w * self._mnrl(q, p, n) if w > 0 else loss

    def _sts(self, fwd, units) -> torch.Tensor:
        from bertdist.embed.losses import CoSENTLoss, CosineMSELoss, MatryoshkaLoss

        b = len(units)
        e = self._embed(fwd, [u["a"] for u in units] + [u["b"] for u in units])
        scores = torch.tensor([u["score"] for u in units], dtype=torch.float32, device=e.device)
        base = CoSENTLoss(self.cfg.scale) if self.loss == "cosent" else CosineMSELoss()
        if self.loss == "cosine_mse":
            scores = scores / 5.0  # STS-B's 0-5 to the cosine's scale
        if self.cfg.matryoshka_dims:
            return MatryoshkaLoss(base, self.cfg.matryoshka_dims, self.cfg.matryoshka_weights or None)(
                e[:b], e[b:], scores=scores)
        return base(e[:b], e[b:], scores)

    def _rerank(self, fwd, units, rng) -> torch.Tensor:
        from bertdist.embed.losses import binary_ce, listwise_softmax_loss

        groups = [[u["p"]] + self._negatives(u, rng) for u in units]
        width = max(len(g) for g in groups)
        pairs = [(u["q"], c) for u, g in zip(units, groups) for c in g]
        device = next(self.model.parameters()).device

        def one(batch):
            with self._autocast(device):
                return fwd(batch)[0].reshape(-1)

        logits = forward_by_length(one, self.model.features(pairs, self.cfg.max_seq_length), self.cfg.length_groups,
                                   device)
        # [groups, 1 + k] with the positive in column 0; rows with fewer negatives are masked
        mask = torch.tensor([[j < len(g) for j in range(width)] for g in groups], device=device)
        scores = logits.float().new_zeros(mask.shape).masked_scatter(mask, logits.float().reshape(-1))
        if self.loss == "listwise":
            return listwise_softmax_loss(scores.masked_fill(~mask, float("-inf")))
        labels = torch.zeros_like(scores)
        labels[:, 0] = 1.0
        return binary_ce(scores[mask], labels[mask])
