"""Load BERT weights from anything we hand around: a training run or DeepSpeed
checkpoint, a Hugging Face directory, or a bertdist torch-format directory
(``bertdist export --format torch`` / ``bertdist import-hf``).

Everything ends up as one ``PretrainedWeights``: our ``BertConfig``, a state
dict that loads strictly into our ``BertForPreTraining``, and the vocab and
casing the weights were trained with. ELECTRA (a run with an ``electra`` section, or an HF
ELECTRA directory): an ``ElectraConfig`` and a state dict for our ``ElectraForPreTraining``.
ModernBERT (an HF ``ModernBertForMaskedLM`` directory, or a torch-format directory made from
one): a ``ModernBertConfig``, a state dict for our ``ModernBertForMaskedLM``, and its tokenizer
as the files it came in (``tokenizer_files``; no WordPiece vocab).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from bertdist.export.hf import ExportError, is_hf_dir, read_hf_dir
from bertdist.export.modernbert_hf import TOKENIZER_FILES, is_modernbert_dir, read_modernbert_hf_dir
from bertdist.export.tokenizer import infer_do_lower_case, read_tokenizer_casing
from bertdist.model import BertConfig, ElectraConfig
from bertdist.model.config import model_config_from_mapping
from bertdist.model.modernbert_config import ModernBertConfig

TORCH_WEIGHTS = "bertdist_model.pt"
TORCH_CONFIG = "bertdist_model.yaml"
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


@dataclasses.dataclass
class PretrainedWeights:
    config: BertConfig
    state_dict: dict[str, torch.Tensor]
    vocab_file: Path | None
    do_lower_case: bool | None
    origin: dict[str, Any]  # what was read: kind, path, tag, zero stage, ...
    tokenizer_files: list[Path] = dataclasses.field(default_factory=list)  # carried as they are (ModernBERT)

    @property
    def tokenizer_json(self) -> Path | None:
        """The checkpoint's own fast tokenizer (ModernBERT's BPE), which replaces a WordPiece vocab."""
        return next((f for f in self.tokenizer_files if f.name == "tokenizer.json"), None)


def is_torch_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / TORCH_WEIGHTS).is_file() and (Path(path) / TORCH_CONFIG).is_file()


def load_pretrained(
    path: str | os.PathLike,
    *,
    kernels: str | None = None,
    vocab_file: str | os.PathLike | None = None,
    do_lower_case: bool | None = None,
    tag: str | None = None,
) -> PretrainedWeights:
    """Weights, config, vocab and casing from a run/checkpoint, an HF dir or a torch-format dir."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint path does not exist: {p}")
    if is_torch_dir(p):
        w = _load_torch_dir(p)
    elif is_modernbert_dir(p):
        ck = read_modernbert_hf_dir(p)
        origin = {"kind": "hf", "path": str(p)}
        if ck.fresh_keys:
            origin["newly_initialised"] = ck.fresh_keys
        w = PretrainedWeights(ck.config, ck.state_dict, None, None, origin, ck.tokenizer_files)
        if w.tokenizer_json is None and (p / "vocab.txt").is_file():  # a ModernBERT on a WordPiece vocab
            w.vocab_file, w.do_lower_case = p / "vocab.txt", read_tokenizer_casing(p)
    elif is_hf_dir(p):
        ck = read_hf_dir(p)
        origin = {"kind": "hf", "path": str(p)}
        if ck.fresh_keys:
            origin["newly_initialised"] = ck.fresh_keys
        w = PretrainedWeights(ck.config, ck.state_dict, ck.vocab_file, ck.do_lower_case, origin)
    else:
        w = _load_deepspeed(p, tag)
    if kernels is not None:
        from bertdist.export.encoders import family_of

        w.config = family_of(w.config).with_kernels(w.config, kernels)
    if vocab_file is not None:
        w.vocab_file = Path(vocab_file)
    if isinstance(w.config, ModernBertConfig) and w.vocab_file is not None and w.vocab_file.suffix == ".json":
        w.tokenizer_files = own_tokenizer_files(w.vocab_file)  # a run's data tokenized with a tokenizer.json
        w.vocab_file = None
    if do_lower_case is not None:
        w.do_lower_case = do_lower_case
    if w.vocab_file is not None and w.do_lower_case is None:
        w.do_lower_case = infer_do_lower_case(w.vocab_file)
    return w


def read_task_dir(path: str | os.PathLike, kernels: str | None = None
                  ) -> tuple[PretrainedWeights, dict[str, torch.Tensor], dict]:
    """An HF task-model directory (a fine-tuned ``<Family>For<Task>``): its backbone as
    ``PretrainedWeights``, the state dict as read (the task head is there) and its config.json."""
    p = Path(path)
    origin = {"kind": "hf", "path": str(p)}
    if is_modernbert_dir(p):
        ck = read_modernbert_hf_dir(p)
        return PretrainedWeights(ck.config, ck.state_dict, None, None, origin, ck.tokenizer_files), \
            ck.raw_state_dict, ck.hf_config
    ck = read_hf_dir(p, kernels=kernels or "auto")
    return PretrainedWeights(ck.config, ck.state_dict, ck.vocab_file, ck.do_lower_case, origin), \
        ck.raw_state_dict, ck.hf_config


def _load_torch_dir(p: Path) -> PretrainedWeights:
    import yaml

    cfg = model_config_from_mapping(yaml.safe_load((p / TORCH_CONFIG).read_text()))
    from bertdist.export.safe_load import load_file

    sd = load_file(p / TORCH_WEIGHTS)
    origin = {"kind": "torch", "path": str(p)}
    own = [p / n for n in TOKENIZER_FILES if (p / n).is_file()]
    if isinstance(cfg, ModernBertConfig) and ((p / "tokenizer.json").is_file() or not (p / "vocab.txt").is_file()):
        return PretrainedWeights(cfg, sd, None, None, origin, own)
    vocab = p / "vocab.txt"  # a BERT, or a ModernBERT pretrained on a WordPiece vocab
    lower = read_tokenizer_casing(p)
    return PretrainedWeights(cfg, sd, vocab if vocab.is_file() else None, lower, origin)


def write_torch_dir(out_dir: str | os.PathLike, w: PretrainedWeights) -> Path:
    """Our own format: the full state dict (tied keys included), the BertConfig as YAML, the vocab."""
    import shutil

    from bertdist.config import save_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in w.state_dict.items()}
    torch.save(sd, out / TORCH_WEIGHTS)
    save_config(w.config, out / TORCH_CONFIG)
    if w.vocab_file is not None:
        shutil.copyfile(w.vocab_file, out / "vocab.txt")
        lower = w.do_lower_case if w.do_lower_case is not None else infer_do_lower_case(w.vocab_file)
        (out / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lower}, indent=2) + "\n")
    for f in w.tokenizer_files:
        shutil.copyfile(f, out / f.name)
    (out / "origin.json").write_text(json.dumps(w.origin, indent=2, default=str) + "\n")
    return out


def _load_deepspeed(p: Path, tag: str | None) -> PretrainedWeights:
    from bertdist.export.deepspeed_ckpt import consolidate, find_resolved_config

    ck = consolidate(p, tag)
    found = find_resolved_config(ck.ref)
    if found is None:
        raise ExportError(
            f"{ck.ref.path}: no resolved config (config.yaml) beside the checkpoint, so the model shape is unknown"
        )
    run_cfg, cfg_path = found
    cfg = _model_config(run_cfg, cfg_path, ck.state_dict)
    vocab, lower = _vocab_and_casing(run_cfg, cfg_path)
    origin = {"kind": "deepspeed", "path": str(ck.ref.path), "tag": ck.ref.tag, "zero_stage": ck.zero_stage,
              "world_size": ck.world_size, "fp32_master_weights": ck.master_weights, "config": str(cfg_path),
              "data_tokenizer": _data_tokenizer(run_cfg, cfg_path)}
    return PretrainedWeights(cfg, ck.state_dict, vocab, lower, origin)


def _find_key(tree: Any, names: tuple[str, ...]) -> list[Any]:
    """Values of every key in ``names`` anywhere in a nested dict/list, depth-first."""
    hits = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in names:
                hits.append(v)
            hits.extend(_find_key(v, names))
    elif isinstance(tree, list):
        for v in tree:
            hits.extend(_find_key(v, names))
    return hits


def _model_config(run_cfg: dict, cfg_path: Path, sd: dict[str, torch.Tensor]) -> BertConfig:
    """The run's model: its ``model`` section, an ELECTRA model with an ``electra`` section."""
    from bertdist.config import ConfigError
    from bertdist.train.config import model_config_of

    try:
        cfg = model_config_of(run_cfg)
    except ConfigError as e:
        raise ExportError(f"{cfg_path}: {e}") from None
    electra = isinstance(cfg, ElectraConfig)
    emb = sd.get("discriminator.electra.embeddings.word_embeddings.weight" if electra
                 else "bert.embeddings.word_embeddings.weight")
    width = cfg.embedding_width if electra else cfg.hidden_size
    if emb is not None and tuple(emb.shape) != (cfg.vocab_size, width):
        raise ExportError(
            f"{cfg_path}: model config says vocab {cfg.vocab_size} x {'embedding' if electra else 'hidden'} {width}, "
            f"but the checkpoint's embeddings are {tuple(emb.shape)}"
        )
    if electra and cfg.has_generator and not any(k.startswith("generator.") for k in sd):
        cfg = cfg.without_generator()
    return cfg


def _resolve(value: Any, base: Path) -> Path | None:
    if not isinstance(value, str) or not value:
        return None
    for cand in (Path(value), base / value, base.parent / value):
        if cand.is_file():
            return cand
    return None


def own_tokenizer_files(tokenizer_json: Path) -> list[Path]:
    """A tokenizer.json and the files beside it that go with it (its tokenizer_config.json names the
    special tokens, as the data pipeline read them)."""
    beside = [tokenizer_json.parent / n for n in TOKENIZER_COMPANIONS]
    return [tokenizer_json] + [f for f in beside if f.is_file()]


def _manifest_path(value: Any, base: Path) -> Path | None:
    mp = _resolve(value, base)
    if mp is None and isinstance(value, str) and Path(value).is_dir() and (Path(value) / "manifest.json").is_file():
        mp = Path(value) / "manifest.json"
    return mp


def _data_tokenizer(run_cfg: dict, cfg_path: Path) -> dict:
    """What the run's config and its data manifest say of the tokenizer the records were built with:
    the file the config names (``named``), and the manifest's fingerprint of it (``sha256``, the
    sha256 of the file's bytes, checked when the run opened its records)."""
    named = next((v for v in _find_key(run_cfg.get("data", run_cfg), ("vocab_file",)) if isinstance(v, str) and v),
                 None)
    found: dict[str, Any] = {"named": named}
    for m in _find_key(run_cfg, ("train_manifest", "manifest", "manifest_path", "data_manifest")):
        mp = _manifest_path(m, cfg_path.parent)
        if mp is None:
            continue
        vocab = json.loads(mp.read_text()).get("vocab")
        if isinstance(vocab, dict) and vocab.get("sha256"):
            found.update(manifest=str(mp), sha256=vocab["sha256"], manifest_path=vocab.get("path"))
            break
    return found


def data_tokenizer_problem(w: PretrainedWeights) -> str | None:
    """Why ``w``'s tokenizer is not the one its run's data was tokenized with, or None: the file is
    not there, or its bytes are not the ones the data manifest fingerprinted."""
    from bertdist.data.vocab import vocab_sha256 as file_sha256

    data = w.origin.get("data_tokenizer") or {}
    have = w.vocab_file or w.tokenizer_json
    if have is None:
        if not data.get("named") and not data.get("sha256"):
            return None  # the run says nothing of its tokenizer (an imported checkpoint without one)
        return (f"the run's data was tokenized with {data.get('named') or data.get('manifest_path')} "
                f"(data.vocab_file in {w.origin.get('config')}), which is not there; pass --vocab FILE "
                "with that file (a vocab.txt or a tokenizer.json)")
    if not Path(have).is_file():
        return f"the tokenizer file {have} is not there; pass --vocab FILE with the one the run's data used"
    if data.get("sha256") and file_sha256(have) != data["sha256"]:
        return (f"{have} has sha256 {file_sha256(have)}, but the run's data ({data['manifest']}) was tokenized "
                f"with a file of sha256 {data['sha256']} ({data.get('manifest_path')}); an export with another "
                "tokenizer would encode other ids than the model was trained on. Pass --vocab FILE with that file")
    return None


def _vocab_and_casing(run_cfg: dict, cfg_path: Path) -> tuple[Path | None, bool | None]:
    """The vocab file and casing the run trained with: named in its config or in its data manifest."""
    vocab = None
    for v in _find_key(run_cfg, ("vocab_file", "vocab_path", "vocab")):
        vocab = vocab or _resolve(v, cfg_path.parent)
    lower = next((bool(v) for v in _find_key(run_cfg, ("do_lower_case", "lower_case", "lowercase")) if v is not None), None)
    if vocab is None:
        for m in _find_key(run_cfg, ("manifest", "manifest_path", "train_manifest", "data_manifest")):
            mp = _manifest_path(m, cfg_path.parent)
            if mp is None:
                continue
            manifest = json.loads(mp.read_text())
            for v in _find_key(manifest, ("vocab_file", "vocab_path", "vocab")):
                vocab = vocab or _resolve(v, mp.parent)
            if lower is None:
                lower = next((bool(v) for v in _find_key(manifest, ("do_lower_case", "lower_case", "lowercase"))
                              if v is not None), None)
    return vocab, lower
