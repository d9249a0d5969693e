"""Our BERT state dict <-> a Hugging Face model directory.

Our parameter names equal ``transformers.BertForPreTraining``'s, so the
conversion is about the edges: HF leaves the two tied keys
(``cls.predictions.decoder.weight`` = word embeddings,
``cls.predictions.decoder.bias`` = ``cls.predictions.bias``) out of
``model.safetensors``; old checkpoints use ``gamma``/``beta`` for layer norms
and carry a ``position_ids`` buffer; a bare ``BertModel`` has no ``bert.``
prefix; a masked-LM-only checkpoint has no NSP head or pooler. Big models come
sharded: an index (``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``)
whose ``weight_map`` names the shard file of every key. ELECTRA models (an ``ElectraConfig``;
``model_type: electra``) go through ``electra_hf.py``: the same entry points dispatch to it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Mapping

import torch

from bertdist.data.manifest import path_inside
from bertdist.export.tokenizer import infer_do_lower_case, read_tokenizer_casing, write_tokenizer_files
from bertdist.model import BertConfig, ElectraConfig

TIED = {  # key HF drops on save -> the key holding the same tensor
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # sharded checkpoints


class ExportError(ValueError):
    """A checkpoint or directory that cannot be exported or imported; the message says why."""


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32, contiguous, CPU copies; the tied keys dropped after checking they really are tied."""
    out = {}
    for k, v in state_dict.items():
        if k in TIED:
            src = state_dict.get(TIED[k])
            if src is None or not torch.equal(v.float().cpu(), src.float().cpu()):
                raise ExportError(f"{k} is not tied to {TIED[k]}; the checkpoint breaks BERT's weight tying")
            continue
        out[k] = v.detach().to("cpu", torch.float32).contiguous().clone()
    return out


# The word embeddings' key in our BertForPreTraining, ElectraForPreTraining and ModernBertForMaskedLM state dicts.
ANCHORS = ("bert.embeddings.word_embeddings.weight", "discriminator.electra.embeddings.word_embeddings.weight",
           "model.embeddings.tok_embeddings.weight")


def strip_wrapper_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove a wrapper's prefix (``module.``, ``model.``) so keys start at ``bert.``/``cls.``
    (ELECTRA: ``discriminator.``/``generator.``; ModernBERT: ``model.``/``head.``/``decoder.``)."""
    hits = [(k, anchor) for anchor in ANCHORS for k in state_dict if k.endswith(anchor)]
    if not hits:
        if "embeddings.word_embeddings.weight" in state_dict:  # a bare BertModel
            return {f"bert.{k}": v for k, v in state_dict.items()}
        raise ExportError(f"no BERT word embeddings in the state dict (keys: {sorted(state_dict)[:8]} ...)")
    key, anchor = min(hits, key=lambda hit: len(hit[0]))
    prefix = key[: -len(anchor)]
    if not prefix:
        return dict(state_dict)
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def from_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    fresh_init: Callable[[], Mapping[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """An HF state dict -> one our ``BertForPreTraining`` loads strictly.

    ``reference`` gives the expected keys and shapes (meta tensors are fine).
    Heads the HF checkpoint lacks (e.g. NSP in a masked-LM model) come from
    ``fresh_init()`` (a newly initialised model's state dict) and are named in
    the returned list; anything else missing, or extra, is an error.
    """
    renamed = {}
    for k, v in state_dict.items():
        if k.endswith("position_ids"):
            continue  # a buffer, recomputed
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        renamed[k] = v
    renamed = strip_wrapper_prefix(renamed)
    for k, src in TIED.items():
        if src in renamed:
            renamed[k] = renamed[src]
    task_heads = [k for k in renamed if not (k.startswith("bert.") or k.startswith("cls."))]
    for k in task_heads:  # e.g. classifier.* from a fine-tuned model: not part of pretraining
        renamed.pop(k)
    unexpected = sorted(set(renamed) - set(reference))
    if unexpected:
        raise ExportError(f"keys that are not in BERT for pretraining: {unexpected[:10]}")
    missing = sorted(set(reference) - set(renamed))
    fresh = [k for k in missing if k.startswith("cls.") or k.startswith("bert.pooler.")]
    hard = sorted(set(missing) - set(fresh))
    if hard:
        raise ExportError(f"the checkpoint lacks encoder weights: {hard[:10]}")
    if fresh:
        if fresh_init is None:
            raise ExportError(f"the checkpoint lacks {fresh} and no initialiser was given")
        init = fresh_init()
        for k in fresh:
            renamed[k] = init[k]
    for k, v in renamed.items():
        if tuple(v.shape) != tuple(reference[k].shape):
            raise ExportError(f"{k}: shape {tuple(v.shape)} in the checkpoint, {tuple(reference[k].shape)} in the config")
    return {k: v.to(torch.float32) for k, v in renamed.items()}, fresh


def hf_config_dict(cfg: BertConfig, architectures: list[str]) -> dict:
    if isinstance(cfg, ElectraConfig):  # the discriminator's (the encoder task models build on)
        from bertdist.export.electra_hf import hf_config_dict as electra_config

        return electra_config(cfg, architectures)
    d = cfg.to_hf_dict()
    d.update(model_type="bert", architectures=architectures, tie_word_embeddings=True,
             position_embedding_type="absolute", classifier_dropout=None, torch_dtype="float32")
    return d


def write_hf_dir(
    out_dir: str | Path,
    cfg: BertConfig,
    state_dict: Mapping[str, torch.Tensor],
    vocab_file: str | Path,
    do_lower_case: bool | None = None,
    extra_config: Mapping | None = None,
    architectures: tuple[str, ...] | None = None,
) -> Path:
    """config.json + model.safetensors (+ tokenizer files) that ``from_pretrained`` loads cleanly.
    ``architectures``: None is the pretraining model's (``BertForPreTraining``). An ELECTRA model
    writes its discriminator here and its generator in ``generator/`` (electra_hf.py)."""
    from safetensors.torch import save_file

    from bertdist.export.tokenizer import read_vocab

    if isinstance(cfg, ElectraConfig):
        from bertdist.export.electra_hf import write_electra_hf_dir

        return write_electra_hf_dir(out_dir, cfg, state_dict, vocab_file, do_lower_case, extra_config)
    architectures = ("BertForPreTraining",) if architectures is None else architectures
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = len(read_vocab(vocab_file))
    if n_vocab != cfg.vocab_size:
        raise ExportError(f"vocab {vocab_file} has {n_vocab} tokens but the model's vocab_size is {cfg.vocab_size}")
    if do_lower_case is None:
        do_lower_case = infer_do_lower_case(vocab_file)
    tensors = to_hf_state_dict(state_dict)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config_dict(cfg, list(architectures))
    config.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer_files(out, vocab_file, do_lower_case, cfg.max_position_embeddings)
    return out


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any((p / f).is_file() for f in HF_WEIGHT_FILES + HF_INDEX_FILES)


@dataclasses.dataclass
class HFCheckpoint:
    config: BertConfig
    state_dict: dict[str, torch.Tensor]  # loads strictly into our BertForPreTraining
    vocab_file: Path
    do_lower_case: bool
    hf_config: dict
    fresh_keys: list[str]  # pretraining-head keys the checkpoint lacked (newly initialised)
    raw_state_dict: dict[str, torch.Tensor]  # as stored, incl. any task head


def _read_weight_file(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` or ``torch.save`` file (only ``keys``, when given)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            present = set(f.keys())
            wanted = present if keys is None else [k for k in keys if k in present]
            return {k: f.get_tensor(k) for k in wanted}
    from bertdist.export.safe_load import load_file

    sd = load_file(path)
    return sd if keys is None else {k: sd[k] for k in keys if k in sd}


def read_sharded_state_dict(index_path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor an HF shard index maps, read from its shard; a missing shard or key is an error."""
    index_path = Path(index_path)
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{index_path}: not a shard index with a weight_map ({type(e).__name__}: {e})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(f"{index_path}: the weight_map is empty or not a mapping")
    by_shard: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        path_inside(index_path.parent, shard, index_path, ExportError)  # never a file elsewhere
        by_shard.setdefault(shard, []).append(key)
    absent = sorted(s for s in by_shard if not (index_path.parent / s).is_file())
    if absent:
        raise ExportError(f"{index_path.name} maps weights to shard file(s) missing from {index_path.parent}: {absent}")
    out: dict[str, torch.Tensor] = {}
    for shard, keys in sorted(by_shard.items()):
        tensors = _read_weight_file(index_path.parent / shard, keys)
        lacking = [k for k in keys if k not in tensors]
        if lacking:
            raise ExportError(f"{index_path.parent / shard} lacks {len(lacking)} key(s) that {index_path.name} "
                              f"maps to it: {lacking[:5]}")
        out.update(tensors)
    return out


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """The stored tensors of an HF directory: one weights file or a sharded checkpoint's index."""
    p = Path(hf_dir)
    for name in HF_WEIGHT_FILES:
        if (p / name).is_file():
            return _read_weight_file(p / name)
    for name in HF_INDEX_FILES:
        if (p / name).is_file():
            return read_sharded_state_dict(p / name)
    raise ExportError(f"{p}: no weights (looked for {', '.join(HF_WEIGHT_FILES + HF_INDEX_FILES)})")


def read_hf_dir(hf_dir: str | Path, kernels: str = "auto") -> HFCheckpoint:
    """Load an HF BERT directory as our config + a state dict for our ``BertForPreTraining`` (an
    ELECTRA directory: an ``ElectraConfig`` and a state dict for our ``ElectraForPreTraining``)."""
    from bertdist.model import BertForPreTraining

    p = Path(hf_dir)
    if not (p / "config.json").is_file():
        raise ExportError(f"{p}: not a Hugging Face model directory (no config.json)")
    hf_config = json.loads((p / "config.json").read_text())
    if hf_config.get("model_type") == "electra":
        from bertdist.export.electra_hf import read_electra_hf_dir

        return read_electra_hf_dir(p, hf_config, kernels)
    if hf_config.get("model_type", "bert") != "bert":
        raise ExportError(f"{p}: model_type {hf_config.get('model_type')!r} is not 'bert'")
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise ExportError(f"{p}: position_embedding_type {hf_config['position_embedding_type']!r} is not supported")
    if hf_config.get("hidden_act", "gelu") != "gelu":
        raise ExportError(f"{p}: hidden_act {hf_config['hidden_act']!r} is not supported (only erf 'gelu')")
    cfg = BertConfig.from_hf_dict(hf_config, kernels=kernels)
    vocab = p / "vocab.txt"
    if not vocab.is_file():
        raise ExportError(f"{p}: no vocab.txt beside the model")
    lower = read_tokenizer_casing(p)
    if lower is None:
        lower = infer_do_lower_case(vocab)
    raw = read_hf_state_dict(p)
    with torch.device("meta"):
        shapes = BertForPreTraining(dataclasses.replace(cfg, kernels="reference"), device_type="cpu").state_dict()

    def fresh_init():
        return BertForPreTraining(dataclasses.replace(cfg, kernels="reference"), device_type="cpu").state_dict()

    sd, fresh = from_hf_state_dict(raw, shapes, fresh_init)
    return HFCheckpoint(cfg, sd, vocab, lower, hf_config, fresh, raw)
