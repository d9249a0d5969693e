"""Our ELECTRA (bertdist/model/electra.py) <-> Hugging Face directories.

Layout of an export ``OUT``:

    OUT/              the discriminator: an ``ElectraForPreTraining`` (config.json,
                      model.safetensors, vocab.txt and tokenizer files): what fine-tuning,
                      distillation and ``AutoModel`` read
    OUT/generator/    the generator: an ``ElectraForMaskedLM`` (written when the model has one)

Each holds the shared embeddings (transformers keeps one copy per model); the generator's
``generator_lm_head.weight`` is left out, tied to its word embeddings as transformers ties it.
Our keys are the HF keys with a ``discriminator.`` / ``generator.`` prefix, so the conversion is
a prefix and the tied key.

Reading takes such a directory (the generator optional), a bare ``ElectraModel`` or an
``ElectraFor<Task>`` (the task head is left out of the pretraining state dict, as for BERT, and
kept in ``raw_state_dict``); a discriminator without ``discriminator_predictions`` gets a freshly
initialised one, named in ``fresh_keys``. A generator directory alone (``ElectraForMaskedLM``) is
refused: it is not the model fine-tuning wants. The generator's embeddings must equal the
discriminator's, since ELECTRA shares them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping

import torch

from bertdist.export.hf import ExportError, HFCheckpoint, is_hf_dir, read_hf_state_dict
from bertdist.export.tokenizer import infer_do_lower_case, read_tokenizer_casing, write_tokenizer_files
from bertdist.model import ElectraConfig
from bertdist.model.config import GENERATOR_FIELDS

GENERATOR_DIR = "generator"
TIED_GENERATOR_KEY = "generator_lm_head.weight"  # HF drops it on save: the word embeddings
WORD_EMBEDDINGS = "electra.embeddings.word_embeddings.weight"
HF_EMBEDDING_SIZE = 128  # transformers' ElectraConfig default, for a config.json without embedding_size
# HF ElectraConfig fields beyond BERT's, with transformers' defaults (task models read them).
HF_EXTRA = dict(position_embedding_type="absolute", classifier_dropout=None, summary_type="first",
                summary_use_proj=True, summary_activation="gelu", summary_last_dropout=0.1)


def hf_config_dict(cfg: ElectraConfig, architectures: list[str], tower: str = "discriminator") -> dict:
    """config.json of the discriminator (or the generator) of ``cfg``."""
    d = (cfg.discriminator_config() if tower == "discriminator" else cfg.generator_config()).to_hf_dict()
    d.update(model_type="electra", architectures=list(architectures), embedding_size=cfg.embedding_width,
             tie_word_embeddings=True, torch_dtype="float32", **HF_EXTRA)
    return d


def _tower(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v.detach().to("cpu", torch.float32).contiguous().clone()
            for k, v in state_dict.items() if k.startswith(prefix)}


def _embeddings(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if k.startswith("electra.embeddings.")}


def _check_shared(disc: Mapping[str, torch.Tensor], gen: Mapping[str, torch.Tensor], where: str) -> None:
    a, b = _embeddings(disc), _embeddings(gen)
    differ = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))
    if differ:
        raise ExportError(f"{where}: the generator's embeddings differ from the discriminator's ({differ[:4]}); "
                          "ELECTRA shares them")


def to_hf_state_dicts(state_dict: Mapping[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(discriminator, generator or None) as HF state dicts: fp32 CPU copies, the tied head dropped
    after checking it is tied."""
    disc, gen = _tower(state_dict, "discriminator."), _tower(state_dict, "generator.")
    if not disc:
        raise ExportError(f"no ELECTRA discriminator in the state dict (keys: {sorted(state_dict)[:8]} ...)")
    if not gen:
        return disc, None
    head = gen.pop(TIED_GENERATOR_KEY, None)
    if head is not None and not torch.equal(head, gen[WORD_EMBEDDINGS]):
        raise ExportError(f"generator.{TIED_GENERATOR_KEY} is not tied to generator.{WORD_EMBEDDINGS}")
    _check_shared(disc, gen, "the state dict")
    return disc, gen


def _write_one(out: Path, tensors: dict[str, torch.Tensor], config: dict, vocab_file, do_lower_case: bool,
               max_positions: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(out, vocab_file, do_lower_case, max_positions)


def write_electra_hf_dir(out_dir: str | Path, cfg: ElectraConfig, state_dict: Mapping[str, torch.Tensor],
                         vocab_file: str | Path, do_lower_case: bool | None = None,
                         extra_config: Mapping | None = None) -> Path:
    """``OUT`` (the discriminator) and ``OUT/generator`` (when there is one); returns ``OUT``."""
    from bertdist.export.tokenizer import read_vocab

    n_vocab = len(read_vocab(vocab_file))
    if n_vocab != cfg.vocab_size:
        raise ExportError(f"vocab {vocab_file} has {n_vocab} tokens but the model's vocab_size is {cfg.vocab_size}")
    if do_lower_case is None:
        do_lower_case = infer_do_lower_case(vocab_file)
    disc, gen = to_hf_state_dicts(state_dict)
    if gen is not None and not cfg.has_generator:
        raise ExportError("the state dict holds a generator but the config has no generator sizes")
    out = Path(out_dir)
    config = hf_config_dict(cfg, ["ElectraForPreTraining"])
    config.update(extra_config or {})
    _write_one(out, disc, config, vocab_file, do_lower_case, cfg.max_position_embeddings)
    if gen is not None:
        _write_one(out / GENERATOR_DIR, gen, hf_config_dict(cfg, ["ElectraForMaskedLM"], "generator"), vocab_file,
                   do_lower_case, cfg.max_position_embeddings)
    return out


def _renamed(raw: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Old layer-norm names, the position_ids buffer, a bare ElectraModel's missing ``electra.``."""
    out = {}
    for k, v in raw.items():
        if k.endswith("position_ids") or k.endswith("embeddings.token_type_ids"):
            continue  # buffers, recomputed
        out[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = v
    if "embeddings.word_embeddings.weight" in out:  # a bare ElectraModel
        out = {f"electra.{k}": v for k, v in out.items()}
    return out


def _check_config(p: Path, hf: dict) -> None:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ExportError(f"{p}: position_embedding_type {hf['position_embedding_type']!r} is not supported")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ExportError(f"{p}: hidden_act {hf['hidden_act']!r} is not supported (only erf 'gelu')")


def _read_generator(gdir: Path, disc_cfg: ElectraConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """The generator directory's sizes (checked against the discriminator's) and its state dict in our keys."""
    ghf = json.loads((gdir / "config.json").read_text())
    if ghf.get("model_type") != "electra":
        raise ExportError(f"{gdir}: model_type {ghf.get('model_type')!r} is not 'electra'")
    _check_config(gdir, ghf)
    shared = {"vocab_size": disc_cfg.vocab_size, "embedding_size": disc_cfg.embedding_width,
              "max_position_embeddings": disc_cfg.max_position_embeddings,
              "type_vocab_size": disc_cfg.type_vocab_size, "layer_norm_eps": disc_cfg.layer_norm_eps}
    theirs = {k: ghf.get(k, HF_EMBEDDING_SIZE if k == "embedding_size" else None) for k in shared}
    if theirs != shared:
        raise ExportError(f"{gdir}: the generator does not fit the discriminator (generator {theirs}, "
                          f"discriminator {shared})")
    sizes = dict(generator_hidden_size=ghf["hidden_size"], generator_num_hidden_layers=ghf["num_hidden_layers"],
                 generator_num_attention_heads=ghf["num_attention_heads"],
                 generator_intermediate_size=ghf["intermediate_size"])
    gen = _renamed(read_hf_state_dict(gdir))
    if not any(k.startswith("generator_predictions.") for k in gen):
        raise ExportError(f"{gdir}: no generator_predictions weights: not an ElectraForMaskedLM")
    gen.setdefault(TIED_GENERATOR_KEY, gen[WORD_EMBEDDINGS])
    return sizes, gen


def read_electra_hf_dir(hf_dir: str | Path, hf_config: dict, kernels: str = "auto") -> HFCheckpoint:
    """An HF ELECTRA directory as an ``ElectraConfig`` + a state dict our ``ElectraForPreTraining``
    loads strictly (the generator's keys only when ``generator/`` is there)."""
    from bertdist.model.electra import ElectraForPreTraining

    p = Path(hf_dir)
    _check_config(p, hf_config)
    raw = read_hf_state_dict(p)
    disc = _renamed(raw)
    if any(k.startswith("generator_predictions.") for k in disc):
        raise ExportError(f"{p}: an ElectraForMaskedLM (a generator, architectures "
                          f"{hf_config.get('architectures')}); give the discriminator's directory "
                          f"(ElectraForPreTraining or ElectraModel), with the generator in {GENERATOR_DIR}/")
    # generator sizes come from generator/ only (some configs carry the original's ratio under these names)
    cfg = ElectraConfig.from_hf_dict({**{k: v for k, v in hf_config.items() if k not in GENERATOR_FIELDS},
                                      "embedding_size": hf_config.get("embedding_size", HF_EMBEDDING_SIZE)},
                                     kernels=kernels)
    sd = {f"discriminator.{k}": v for k, v in disc.items()
          if k.startswith("electra.") or k.startswith("discriminator_predictions.")}  # task heads stay in raw
    gdir = p / GENERATOR_DIR
    if is_hf_dir(gdir):
        sizes, gen = _read_generator(gdir, cfg)
        _check_shared(disc, gen, str(p))
        cfg = dataclasses.replace(cfg, **sizes)
        sd.update({f"generator.{k}": v for k, v in gen.items()})
    build = dataclasses.replace(cfg, kernels="reference")
    with torch.device("meta"):
        reference = ElectraForPreTraining(build, device_type="cpu").state_dict()
    unexpected = sorted(set(sd) - set(reference))
    if unexpected:
        raise ExportError(f"{p}: keys that are not in ELECTRA for pretraining: {unexpected[:10]}")
    missing = sorted(set(reference) - set(sd))
    fresh = [k for k in missing if k.startswith("discriminator.discriminator_predictions.")]
    hard = sorted(set(missing) - set(fresh))
    if hard:
        raise ExportError(f"{p}: the checkpoint lacks encoder weights: {hard[:10]}")
    if fresh:
        init = ElectraForPreTraining(build.without_generator(), device_type="cpu").state_dict()
        sd.update({k: init[k] for k in fresh})
    for k, v in sd.items():
        if tuple(v.shape) != tuple(reference[k].shape):
            raise ExportError(f"{p}: {k}: shape {tuple(v.shape)} in the checkpoint, {tuple(reference[k].shape)} "
                              f"in the config")
    vocab = p / "vocab.txt"
    if not vocab.is_file():
        raise ExportError(f"{p}: no vocab.txt beside the model")
    lower = read_tokenizer_casing(p)
    if lower is None:
        lower = infer_do_lower_case(vocab)
    return HFCheckpoint(cfg, {k: v.to(torch.float32) for k, v in sd.items()}, vocab, lower, hf_config, fresh, raw)
