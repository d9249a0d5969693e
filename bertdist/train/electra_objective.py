"""ELECTRA replaced-token detection as a pretraining objective: the ``electra`` section of a
pretraining config (Clark et al., 2020).

The model (``bertdist.model.electra.ElectraForPreTraining``) runs the generator at the masked
positions, draws the replacements with its ``sampler`` and runs the discriminator on the
corrupted batch, returning the two losses as parts. From outside the model, as general
distillation does (distill_objective.py), this objective

* weighs them: ``loss = gen_weight * generator MLM CE + disc_weight * discriminator BCE``
  (the paper's 1 and λ = 50);
* owns the sampler: temperature, method and a ``torch.Generator`` on the run's device, one stream
  per rank, seeded at a fresh start and saved in every checkpoint beside the global RNG states
  (``rng_state_rank<r>.json``), so a resumed run draws exactly the tokens the uninterrupted run
  draws (bertdist/train/checkpoint.py, restore.py);
* draws evaluation replacements from a generator seeded by ``eval.seed`` at each evaluation, so
  held-out numbers are comparable across runs and resumes and the training stream does not move.

The masking is the loader's (``data.*``: the paper's recipes mask 15% of the tokens, 85% of them
to [MASK] and 15% kept, no random tokens). Records that carry NSP labels train without them.
What a resume must match (the same ``electra`` section) and a new phase (the same generator and
embedding sizes) is checked with every objective's, in bertdist/train/objective.py.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from bertdist.config import ConfigError
from bertdist.model.config import ElectraConfig
from bertdist.model.electra import ElectraForPreTraining, ElectraPreTrainingOutput, TokenSampler
from bertdist.train.config import PretrainElectraConfig, TrainConfig
from bertdist.train.objective import ObjectiveOutput, mlm_counts, mlm_eval_sums

SAMPLING_RNG = "electra_sampling"  # its name in the checkpoint's RNG state files


def combined_loss(cfg: PretrainElectraConfig, out: ElectraPreTrainingOutput) -> ElectraPreTrainingOutput:
    """``out`` with ``loss`` = gen_weight * its generator MLM loss + disc_weight * its discriminator loss."""
    return dataclasses.replace(out, loss=cfg.gen_weight * out.mlm_loss + cfg.disc_weight * out.disc_loss)


def disc_counts(out: ElectraPreTrainingOutput) -> dict[str, torch.Tensor]:
    """The discriminator's correct tokens, its count (the real tokens) and the replaced tokens."""
    return {"disc_correct": (((out.discriminator_logits > 0) == out.replaced) & out.real).sum(),
            "disc_count": out.real.sum(), "replaced_count": out.replaced.sum()}


class ReplacedTokenDetection:
    """The objective (bertdist/train/objective.py) of a run with an ``electra`` section;
    ``generators``: the sampling RNG, which checkpoints save and a resume restores."""

    without_nsp = "ELECTRA has no NSP head"

    def __init__(self, cfg: TrainConfig, model: ElectraForPreTraining, device: torch.device, rank: int = 0):
        if cfg.electra is None:
            raise ConfigError("ReplacedTokenDetection needs a config with an electra section")
        self.cfg, self.model, self.device, self.rank = cfg.electra, model, device, rank
        self.model_config: ElectraConfig = cfg.model_config
        self.eval_seed = cfg.eval.seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.seed)  # restore() seeds it per rank (or restores it)
        model.sampler = TokenSampler(self.cfg.temperature, self.cfg.sampling, self.generator)
        self.generators = {SAMPLING_RNG: self.generator}

    def __call__(self, out: ElectraPreTrainingOutput, batch: dict[str, torch.Tensor]) -> ObjectiveOutput:
        out = combined_loss(self.cfg, out)
        return ObjectiveOutput(out.loss, {"mlm_loss": out.mlm_loss, "disc_loss": out.disc_loss},
                               {**mlm_counts(out), **disc_counts(out)}, out)

    def eval_sums(self, out: ElectraPreTrainingOutput, batch: dict[str, torch.Tensor]) -> dict:
        import torch.nn.functional as F

        bce = F.binary_cross_entropy_with_logits(out.discriminator_logits.float(), out.replaced.float(),
                                                 reduction="none")
        return {**mlm_eval_sums(out, batch), **disc_counts(out), "disc_loss_sum": (bce * out.real).sum().double()}

    @contextlib.contextmanager
    def evaluation(self):
        """Samples from a generator seeded by (eval.seed, rank) while the block runs."""
        g = torch.Generator(device=self.device)
        g.manual_seed(self.eval_seed * 1000003 + self.rank)
        training = self.model.sampler
        self.model.sampler = dataclasses.replace(training, generator=g)
        try:
            yield
        finally:
            self.model.sampler = training

    def describe(self) -> str:
        c, m = self.cfg, self.model_config
        g = m.generator_config()
        return (f"ELECTRA replaced-token detection: loss = {c.gen_weight} x generator MLM CE + {c.disc_weight} x "
                f"discriminator BCE; generator {g.num_hidden_layers} x {g.hidden_size} ({g.num_attention_heads} heads, "
                f"FFN {g.intermediate_size}), discriminator {m.num_hidden_layers} x {m.hidden_size}, shared embeddings "
                f"of width {m.embedding_width}; {c.sampling} sampling at temperature {c.temperature}")


def from_config(cfg: TrainConfig, model: ElectraForPreTraining, device: torch.device, rank: int = 0
                ) -> ReplacedTokenDetection:
    """The objective of a run with an ``electra`` section (bertdist/train/objective.py: OBJECTIVES)."""
    return ReplacedTokenDetection(cfg, model, device, rank)
