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
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from bertdist.config import ConfigError, to_dict
from bertdist.model.config import ElectraConfig
from bertdist.model.electra import ElectraForPreTraining, ElectraPreTrainingOutput, TokenSampler
from bertdist.train.config import PretrainElectraConfig, TrainConfig

SAMPLING_RNG = "electra_sampling"  # its name in the checkpoint's RNG state files


def combined_loss(cfg: PretrainElectraConfig, out: ElectraPreTrainingOutput) -> ElectraPreTrainingOutput:
    """``out`` with ``loss`` = gen_weight * its generator MLM loss + disc_weight * its discriminator loss."""
    return dataclasses.replace(out, loss=cfg.gen_weight * out.mlm_loss + cfg.disc_weight * out.disc_loss)


class ReplacedTokenDetection:
    """The objective the trainer applies to each output: ``__call__(out, batch)``; ``generators``:
    the RNGs it draws from, which checkpoints save and a resume restores."""

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

    def __call__(self, out: ElectraPreTrainingOutput, batch: dict[str, torch.Tensor]) -> ElectraPreTrainingOutput:
        return combined_loss(self.cfg, out)

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


def _saved_run_config(load_dir: Path, tag: str) -> dict | None:
    import yaml

    from bertdist.train.checkpoint import CONFIG_FILE

    path = Path(load_dir) / tag / CONFIG_FILE
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else None


def _describe(model) -> str:
    if not isinstance(model, ElectraConfig):
        return "a BERT (no electra section)"
    if not model.has_generator:
        return f"an ELECTRA discriminator without a generator (embedding_size {model.embedding_width})"
    return (f"ELECTRA with embedding_size {model.embedding_width}, generator hidden {model.generator_hidden_size}, "
            f"layers {model.generator_num_hidden_layers}, heads {model.generator_num_attention_heads}, FFN "
            f"{model.generator_intermediate_size}")


def check_checkpoint(cfg: TrainConfig, load_dir: Path, tag: str, mode: str) -> None:
    """A resume continues the objective it was saved with: the checkpoint's ``electra`` section (none,
    or every field) must be this config's. A new phase (``checkpoint.init_from``) needs the same
    model: BERT from BERT, ELECTRA from ELECTRA with the same embedding and generator sizes (the
    discriminator's are checked with the other architecture fields)."""
    from bertdist.train.config import model_config_of

    saved = _saved_run_config(load_dir, tag)
    if saved is None:
        return
    where = Path(load_dir) / tag
    if mode == "resume":
        theirs, ours = saved.get("electra"), to_dict(cfg.electra) if cfg.electra is not None else None
        if theirs != ours:
            raise ConfigError(f"cannot resume from {where}: its electra section differs from this config's "
                              f"(checkpoint {theirs}, config {ours}); resume with the same electra section, or start "
                              f"a new phase from it with checkpoint.init_from")
        return
    saved_electra = saved.get("electra") is not None or (saved.get("model") or {}).get("model_type") == "electra"
    if cfg.electra is None and not saved_electra:
        return  # BERT from BERT: check_compatible compares the shapes
    try:
        theirs = model_config_of(saved)
    except ConfigError as e:
        raise ConfigError(f"checkpoint.init_from {where}: its saved config does not describe a model: {e}") from None
    ours = cfg.model_config
    fields = ("embedding_width", "generator_hidden_size", "generator_num_hidden_layers",
              "generator_num_attention_heads", "generator_intermediate_size")
    same = (isinstance(theirs, ElectraConfig) == isinstance(ours, ElectraConfig)
            and (not isinstance(ours, ElectraConfig)
                 or all(getattr(theirs, f) == getattr(ours, f) for f in fields)))
    if not same:
        raise ConfigError(f"cannot start a new phase from {where}: it holds {_describe(theirs)}, this config trains "
                          f"{_describe(ours)}; the weights must fit the model (set the electra section to match)")
