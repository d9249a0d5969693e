"""Our ModernBERT (bertdist/model/modernbert.py) <-> a Hugging Face ``ModernBertForMaskedLM`` directory.

Our parameter names are transformers', so the state dict is a straight copy; the edges are the
tied ``decoder.weight`` (the token embeddings; transformers leaves it out of ``model.safetensors``)
and the config: transformers 5 describes the layer pattern as ``layer_types`` and the two RoPE
bases under ``rope_parameters``, older releases and the published checkpoints as
``global_attn_every_n_layers``, ``global_rope_theta`` and ``local_rope_theta``. We write both and
read either.

Reading also takes a bare ``ModernBertModel`` (a bi-encoder's) or a ``ModernBertFor<Task>``
directory (a fine-tuned model): the encoder is read, the MLM head freshly initialised and named
in ``fresh_keys``, the task head kept in ``raw_state_dict``.

The tokenizer is whatever the source directory had (ModernBERT's is a BPE ``tokenizer.json``):
its files are carried along unchanged. Nothing already in the output directory is overwritten
unless asked.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Mapping

import torch

from bertdist.config import ConfigError
from bertdist.export.hf import ExportError, read_hf_state_dict
from bertdist.model.modernbert_config import ModernBertConfig

TIED = {"decoder.weight": "model.embeddings.tok_embeddings.weight"}  # key transformers drops -> its tensor
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Tokenizer files carried from the imported directory to the export, as they were.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "added_tokens.json")
GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer types
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
# ModernBertConfig fields copied to and from config.json under the same name.
SAME_NAME = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "global_attn_every_n_layers", "local_attention", "global_rope_theta",
             "local_rope_theta", "norm_eps", "embedding_dropout", "attention_dropout", "mlp_dropout",
             "initializer_range", "initializer_cutoff_factor") + TOKEN_IDS
# transformers' fields that must hold these values for its model to be ours.
FIXED = dict(hidden_activation="gelu", classifier_activation="gelu", norm_bias=False, attention_bias=False,
             mlp_bias=False, decoder_bias=True, tie_word_embeddings=True)


def hf_config_dict(cfg: ModernBertConfig) -> dict:
    """config.json of a ``ModernBertForMaskedLM`` with ``cfg``'s architecture."""
    d = {name: getattr(cfg, name) for name in SAME_NAME}
    d.update(FIXED)
    d.update(
        model_type="modernbert", architectures=["ModernBertForMaskedLM"], dtype="float32",
        layer_types=[GLOBAL if cfg.is_global(i) else LOCAL for i in range(cfg.num_hidden_layers)],
        rope_parameters={GLOBAL: {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
                         LOCAL: {"rope_type": "default", "rope_theta": cfg.local_rope_theta}},
        classifier_pooling="cls", classifier_dropout=0.0, classifier_bias=False, sparse_prediction=False,
        sparse_pred_ignore_index=-100, deterministic_flash_attn=False,
    )
    return d


def _every_n(layer_types: list, where: Path) -> int:
    """``global_attn_every_n_layers`` of a ``layer_types`` list; an error for any other pattern."""
    globals_at = [i for i, t in enumerate(layer_types) if t == GLOBAL]
    unknown = sorted({t for t in layer_types} - {GLOBAL, LOCAL})
    if unknown:
        raise ExportError(f"{where}: layer_types holds {unknown}; ModernBERT has only {GLOBAL!r} and {LOCAL!r}")
    n = globals_at[1] if len(globals_at) > 1 else len(layer_types)
    if not globals_at or globals_at[0] != 0 or globals_at != list(range(0, len(layer_types), n)):
        raise ExportError(f"{where}: the global layers {globals_at} of {len(layer_types)} are not every n-th "
                          "layer from layer 0, the one pattern our ModernBERT has")
    return n


def config_from_hf(hf: Mapping, where: Path) -> ModernBertConfig:
    """Our config from a ``ModernBertConfig`` config.json (transformers 4 or 5 form)."""
    if hf.get("model_type") != "modernbert":
        raise ExportError(f"{where}: model_type {hf.get('model_type')!r} is not 'modernbert'")
    differ = {k: hf[k] for k, v in FIXED.items() if k in hf and hf[k] != v}
    if differ:
        raise ExportError(f"{where}: {differ} differ from what our ModernBERT has, {dict((k, FIXED[k]) for k in differ)}")
    kept = {k: hf[k] for k in SAME_NAME if hf.get(k) is not None}
    if hf.get("layer_types"):
        kept["global_attn_every_n_layers"] = _every_n(list(hf["layer_types"]), where)
    rope = hf.get("rope_parameters") or {}
    for layer_type, name in ((GLOBAL, "global_rope_theta"), (LOCAL, "local_rope_theta")):
        params = rope.get(layer_type) or {}
        if params.get("rope_type", "default") != "default":
            raise ExportError(f"{where}: rope_type {params['rope_type']!r} of {layer_type} layers is not supported "
                              "(only the default RoPE)")
        if "rope_theta" in params:
            kept[name] = float(params["rope_theta"])
    try:
        return ModernBertConfig(preset="custom", **kept)
    except ConfigError as e:
        raise ExportError(f"{where}: {e}") from None


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32, contiguous CPU copies; the tied decoder weight dropped after checking it is tied."""
    out = {}
    for k, v in state_dict.items():
        if k in TIED:
            src = state_dict.get(TIED[k])
            if src is None or not torch.equal(v, src):
                raise ExportError(f"{k} is not tied to {TIED[k]}; the checkpoint breaks ModernBERT's weight tying")
            continue
        out[k] = v.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def from_hf_state_dict(raw: Mapping[str, torch.Tensor], cfg: ModernBertConfig, where: Path) -> dict[str, torch.Tensor]:
    """An HF ``ModernBertForMaskedLM`` state dict -> one our model loads strictly (the tied key added)."""
    from bertdist.model.modernbert import ModernBertForMaskedLM

    with torch.device("meta"):
        expected = ModernBertForMaskedLM(cfg).state_dict()
    sd = {k: v for k, v in raw.items() if k not in TIED}
    missing, unexpected = sorted(set(expected) - set(sd) - set(TIED)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ExportError(f"{where}: not a ModernBertForMaskedLM state dict: missing {missing[:8]}, "
                          f"unexpected {unexpected[:8]}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ExportError(f"{where}: {k} has shape {tuple(v.shape)}, the config says {tuple(expected[k].shape)}")
    for k, src in TIED.items():
        if k in raw and not torch.equal(raw[k], sd[src]):
            raise ExportError(f"{where}: {k} differs from {src}; ModernBertForMaskedLM ties them")
        sd[k] = sd[src]
    return {k: v.to(torch.float32) for k, v in sd.items()}


@dataclasses.dataclass
class ModernBertCheckpoint:
    config: ModernBertConfig
    state_dict: dict[str, torch.Tensor]  # loads strictly into our ModernBertForMaskedLM
    hf_config: dict
    tokenizer_files: list[Path]  # beside the weights, carried on export
    raw_state_dict: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # as read (task heads)
    fresh_keys: list[str] = dataclasses.field(default_factory=list)  # MLM head keys initialised here


def encoder_only(raw: Mapping[str, torch.Tensor], cfg: ModernBertConfig, where: Path
                 ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A bare ``ModernBertModel`` or a ``ModernBertFor<Task>`` state dict -> a ModernBertForMaskedLM
    one: the encoder's tensors, the MLM head freshly initialised (its keys returned); a task head
    (``head.*`` and ``classifier.*`` there are the task's) is left out."""
    from bertdist.model.modernbert import ModernBertForMaskedLM

    if not any(k.startswith("model.") for k in raw):  # a bare ModernBertModel: no prefix
        raw = {f"model.{k}": v for k, v in raw.items()}
    fresh = ModernBertForMaskedLM(cfg).state_dict()
    encoder = {k: v for k, v in raw.items() if k.startswith("model.")}
    fresh_keys = sorted(k for k in fresh if not k.startswith("model.") and k not in TIED)  # head.*, decoder.bias
    sd = dict(encoder)
    sd.update({k: fresh[k] for k in fresh_keys})
    return from_hf_state_dict(sd, cfg, where), fresh_keys


def is_modernbert_dir(path: str | Path) -> bool:
    p = Path(path) / CONFIG_FILE
    return p.is_file() and json.loads(p.read_text()).get("model_type") == "modernbert"


def read_modernbert_hf_dir(hf_dir: str | Path) -> ModernBertCheckpoint:
    p = Path(hf_dir)
    if not (p / CONFIG_FILE).is_file():
        raise ExportError(f"{p}: not a Hugging Face model directory (no {CONFIG_FILE})")
    hf = json.loads((p / CONFIG_FILE).read_text())
    cfg = config_from_hf(hf, p / CONFIG_FILE)
    raw = read_hf_state_dict(p)
    tokenizer = [p / name for name in TOKENIZER_FILES if (p / name).is_file()]
    if "decoder.bias" in raw:  # a ModernBertForMaskedLM
        return ModernBertCheckpoint(cfg, from_hf_state_dict(raw, cfg, p), hf, tokenizer, raw)
    sd, fresh = encoder_only(raw, cfg, p)
    return ModernBertCheckpoint(cfg, sd, hf, tokenizer, raw, fresh)


def write_modernbert_hf_dir(out_dir: str | Path, cfg: ModernBertConfig, state_dict: Mapping[str, torch.Tensor],
                            tokenizer_files: list[Path] = (), overwrite: bool = False) -> Path:
    """config.json + model.safetensors (+ the tokenizer files) that ``from_pretrained`` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    written = [out / WEIGHTS_FILE, out / CONFIG_FILE] + [out / Path(f).name for f in tokenizer_files]
    present = [str(f) for f in written if f.exists()]
    if present and not overwrite:
        raise ExportError(f"{out} already holds {present}; choose another directory, or overwrite=True")
    tensors = to_hf_state_dict(state_dict)
    emb = tensors[TIED["decoder.weight"]]
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ExportError(f"the token embeddings are {tuple(emb.shape)}, the config says "
                          f"vocab_size {cfg.vocab_size} x hidden_size {cfg.hidden_size}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(hf_config_dict(cfg), indent=2, sort_keys=True) + "\n")
    for f in tokenizer_files:
        shutil.copyfile(f, out / Path(f).name)
    return out
