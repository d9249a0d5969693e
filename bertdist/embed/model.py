"""Bi-encoders (sentence embeddings) and cross-encoders (pair scores) on our BERT.

* ``BiEncoder``: ``BertModel`` + pooling (``EmbeddingHead``: mean | cls | max, optional L2
  normalisation and truncation), with an optional linear projection between pooling and
  normalisation (a sentence-transformers ``Dense`` module: a student distilled from a teacher of
  another width keeps the projection that maps it into the teacher's space).
  ``encode(texts)`` returns float32 numpy embeddings.
* ``CrossEncoder``: ``BertModel`` + dropout + one linear output over the pooled ``[CLS]`` state:
  ``BertForSequenceClassification`` with ``num_labels=1``, so it exports as a plain Hugging Face
  directory. ``score(pairs)`` returns its raw logits; ``activation`` (identity or sigmoid) is what
  sentence-transformers' ``CrossEncoder.predict`` applies on top, recorded in the exported config.

``load_bi_encoder`` reads a sentence-transformers directory (``modules.json``: Transformer,
Pooling, an optional Dense, an optional Normalize; ours or anyone's), or any checkpoint
``bertdist.export.sources.load_pretrained`` reads (mean pooling and normalisation unless told
otherwise). ``load_cross_encoder`` reads an HF ``BertForSequenceClassification`` directory with one
output, or a plain checkpoint (the head is then newly initialised: the start of training).

Both sort texts by token count before batching (less padding) and return rows in input order.

The backbone is the checkpoint's family's (bertdist/export/encoders.py): BERT, or ModernBERT, whose
bi-encoder pools ``ModernBertModel``'s states and whose cross-encoder is transformers'
``ModernBertForSequenceClassification`` with one label; a ModernBERT checkpoint's texts are
tokenized with its own ``tokenizer.json``.
"""
from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from bertdist.embed.pooling import POOLING_MODES, EmbeddingHead, pool
from bertdist.export.encoders import family_of
from bertdist.export.hf import ExportError, is_hf_dir
from bertdist.model import BertConfig

ST_MODULES = "modules.json"
ST_CONFIG = "sentence_bert_config.json"
# sentence-transformers writes the activation CrossEncoder.predict applies as a dotted torch path.
ACTIVATIONS = {"identity": "torch.nn.modules.linear.Identity", "sigmoid": "torch.nn.modules.activation.Sigmoid"}
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


# ---------------------------------------------------------------- tokenization
def _tokenize(tokenizer, texts: Sequence[str], pairs: Sequence[str] | None, max_len: int) -> list[dict]:
    if not texts:
        return []
    enc = tokenizer(list(texts), list(pairs) if pairs is not None else None, truncation=True, max_length=max_len)
    return [{k: enc[k][i] for k in ("input_ids", "token_type_ids", "attention_mask")} for i in range(len(texts))]


def pad_batch(features: Sequence[dict], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-pad unpadded features (lists of ids) to the longest in the batch."""
    width = max(len(f["input_ids"]) for f in features)
    out = {}
    for k in ("input_ids", "token_type_ids", "attention_mask"):
        out[k] = torch.tensor([list(f[k]) + [0] * (width - len(f[k])) for f in features], dtype=torch.long,
                              device=device)
    return out


# A group holds at least this many real tokens: below it, one more forward costs more than the
# padding it saves (MiniLM on 2 CPU cores: 32 STS-B sentences, about 450 tokens, took 0.34 s a step
# as one group and 0.41 s as four; 32 SQuAD paragraphs, about 4,900 tokens, 5.8 s as one and 3.2 s
# as four).
MIN_GROUP_TOKENS = 1024


def length_groups(features: Sequence[dict], groups: int, min_tokens: int = MIN_GROUP_TOKENS) -> list[list[int]]:
    """The indices of ``features`` sorted by length and cut into up to ``groups`` runs of near-equal
    count, each holding about ``min_tokens`` real tokens or more: padded one run at a time, a
    training batch of mixed lengths wastes far less compute on padding than padded as one."""
    order = sorted(range(len(features)), key=lambda i: len(features[i]["input_ids"]))
    tokens = sum(len(f["input_ids"]) for f in features)
    n = max(1, min(groups, len(order), tokens // max(1, min_tokens)))
    bounds = [round(i * len(order) / n) for i in range(n + 1)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def forward_by_length(forward, features: Sequence[dict], groups: int, device: torch.device | str,
                      min_tokens: int = MIN_GROUP_TOKENS) -> torch.Tensor:
    """``forward(padded_batch)`` over ``length_groups(features, groups)``, rows back in input order
    (gradients flow through every group; attention masks make each row's output independent of
    how much its group pads)."""
    runs = length_groups(features, groups, min_tokens)
    if len(runs) == 1:
        return forward(pad_batch(features, device))
    outs = [forward(pad_batch([features[i] for i in idx], device)) for idx in runs]
    order = torch.tensor([i for idx in runs for i in idx], device=outs[0].device)
    return torch.cat(outs)[torch.argsort(order)]


def _length_sorted_batches(features: list[dict], batch_size: int):
    """Index batches, longest texts first: similar lengths share a batch and pad little."""
    order = sorted(range(len(features)), key=lambda i: -len(features[i]["input_ids"]))
    for i in range(0, len(order), batch_size):
        yield order[i:i + batch_size]


# ---------------------------------------------------------------- bi-encoder
class BiEncoder(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids)`` -> ``[B, dim]`` float32 embeddings."""

    def __init__(self, config: BertConfig, pooling: str = "mean", normalize: bool = True,
                 truncate_dim: int | None = None, projection_dim: int | None = None,
                 projection_activation: str = "identity", device_type: str | None = None):
        super().__init__()
        self.config = config
        # The backbone family's bare encoder (BertModel, ModernBERT's), called as BertModel is; the
        # attribute keeps BERT's name.
        self.bert = family_of(config).embedding_encoder(config, device_type=device_type)
        # BERT's pooler is not used by a bi-encoder; it is kept (frozen) so the exported weights are a
        # complete BertModel that loads without newly initialised keys.
        for p in (self.bert.pooler.parameters() if getattr(self.bert, "pooler", None) is not None else ()):
            p.requires_grad_(False)
        self.head = EmbeddingHead(pooling, normalize, truncate_dim)
        self.projection = nn.Linear(config.hidden_size, projection_dim) if projection_dim else None
        if projection_activation not in ("identity", "tanh"):
            raise ValueError(f"projection activation {projection_activation!r} is not identity or tanh")
        self.projection_activation = projection_activation
        width = projection_dim or config.hidden_size
        if truncate_dim is not None and truncate_dim > width:
            raise ValueError(f"truncate_dim {truncate_dim} is wider than the embeddings ({width})")
        self.tokenizer = None  # set by the loaders: a BertTokenizerFast over vocab_file, or the checkpoint's own
        self.vocab_file: Path | None = None
        self.tokenizer_files: list[Path] = []  # the checkpoint's own tokenizer (ModernBERT's), exported as is
        self.do_lower_case: bool | None = None
        self.lowercase_input = False  # a sentence-transformers Transformer module with do_lower_case
        self.max_seq_length = 128

    @property
    def pooling(self) -> str:
        return self.head.pooling

    @property
    def normalize(self) -> bool:
        return self.head.normalize

    @property
    def truncate_dim(self) -> int | None:
        return self.head.truncate_dim

    @property
    def full_dim(self) -> int:
        return self.projection.out_features if self.projection is not None else self.config.hidden_size

    @property
    def dim(self) -> int:
        return self.truncate_dim or self.full_dim

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                *, full_width: bool = False, normalize: bool | None = None) -> torch.Tensor:
        """Embeddings; ``full_width`` skips ``truncate_dim`` (training: Matryoshka uses the full width);
        ``normalize`` overrides the head's setting."""
        hidden, _ = self.bert(input_ids, attention_mask, token_type_ids)
        norm = self.normalize if normalize is None else normalize
        if self.projection is None and not full_width and normalize is None:
            return self.head(hidden, attention_mask)
        e = pool(hidden, attention_mask, self.pooling)
        if self.projection is not None:
            e = self.projection(e.to(self.projection.weight.dtype)).float()
            if self.projection_activation == "tanh":
                e = torch.tanh(e)
        if self.truncate_dim is not None and not full_width:
            e = e[:, :self.truncate_dim]
        return F.normalize(e, p=2, dim=-1) if norm else e

    def features(self, texts: Sequence[str], max_seq_length: int | None = None) -> list[dict]:
        if self.tokenizer is None:
            raise RuntimeError("this BiEncoder has no tokenizer: build it with load_bi_encoder")
        texts = [t.lower() for t in texts] if self.lowercase_input else list(texts)
        return _tokenize(self.tokenizer, texts, None, max_seq_length or self.max_seq_length)

    @torch.no_grad()
    def encode(self, texts: Sequence[str], batch_size: int = 64, max_seq_length: int | None = None,
               precision: str = "fp32") -> np.ndarray:
        """``[len(texts), dim]`` float32 embeddings, in the order of ``texts``."""
        feats = self.features(texts, max_seq_length)
        out = np.zeros((len(feats), self.dim), dtype=np.float32)
        if not feats:
            return out
        device = next(self.parameters()).device
        was_training = self.training
        self.eval()
        try:
            for idx in _length_sorted_batches(feats, batch_size):
                batch = pad_batch([feats[i] for i in idx], device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    emb = self(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
                out[idx] = emb.float().cpu().numpy()
        finally:
            self.train(was_training)
        return out


# ---------------------------------------------------------------- cross-encoder
class CrossEncoder(nn.Module):
    """A task model of the backbone's family with one output over the pooled sequence: HF's
    ``<Family>ForSequenceClassification`` layout with one label (BERT: dropout + ``classifier``
    over the pooled [CLS] state). ``forward(batch)`` -> (logits [B], None). Build one with
    ``make_cross_encoder``; this class is what every such model is an instance of."""

    def _setup(self, config: BertConfig, activation: str) -> None:
        self.config = config
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {list(ACTIVATIONS)}")
        self.activation = activation
        self.tokenizer = None
        self.vocab_file: Path | None = None
        self.tokenizer_files: list[Path] = []
        self.do_lower_case: bool | None = None
        self.max_seq_length = 512

    def features(self, pairs: Sequence[tuple[str, str]], max_seq_length: int | None = None) -> list[dict]:
        if self.tokenizer is None:
            raise RuntimeError("this CrossEncoder has no tokenizer: build it with load_cross_encoder")
        return _tokenize(self.tokenizer, [a for a, _ in pairs], [b for _, b in pairs],
                         max_seq_length or self.max_seq_length)

    @torch.no_grad()
    def score(self, pairs: Sequence[tuple[str, str]], batch_size: int = 64, max_seq_length: int | None = None,
              apply_activation: bool = False, precision: str = "fp32") -> np.ndarray:
        """``[len(pairs)]`` float32 scores: raw logits, or after ``activation`` when asked (what
        sentence-transformers' ``CrossEncoder.predict`` returns by default for an exported model)."""
        feats = self.features(pairs, max_seq_length)
        out = np.zeros(len(feats), dtype=np.float32)
        if not feats:
            return out
        device = next(self.parameters()).device
        was_training = self.training
        self.eval()
        try:
            for idx in _length_sorted_batches(feats, batch_size):
                batch = pad_batch([feats[i] for i in idx], device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    logits, _ = self(batch)
                out[idx] = logits.float().reshape(-1).cpu().numpy()
        finally:
            self.train(was_training)
        if apply_activation and self.activation == "sigmoid":
            out = (1.0 / (1.0 + np.exp(-out.astype(np.float64)))).astype(np.float32)
        return out


_CROSS_ENCODER_CLASSES: dict[type, type] = {}


def make_cross_encoder(config: BertConfig, device_type: str | None = None, activation: str = "identity",
                       **head) -> CrossEncoder:
    """The cross-encoder on ``config``'s family: its task model of one regression output, with
    ``CrossEncoder``'s scoring; ``head``: that family's head options (ModernBERT's ``pooling``)."""
    task_class = family_of(config).task_class()
    cls = _CROSS_ENCODER_CLASSES.get(task_class)
    if cls is None:
        name = task_class.__name__.replace("ForTask", "") + "CrossEncoder"
        cls = _CROSS_ENCODER_CLASSES[task_class] = type(name, (CrossEncoder, task_class), {"__module__": __name__})
    model = cls(config, "regression", 1, device_type=device_type, **head)
    model._setup(config, activation)
    return model


# ---------------------------------------------------------------- directories
def is_sentence_transformers_dir(path: str | Path) -> bool:
    return (Path(path) / ST_MODULES).is_file()


def _hf_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def is_cross_encoder_dir(path: str | Path) -> bool:
    """An HF sequence-classification directory with one output (a cross-encoder's layout)."""
    p = Path(path)
    if not is_hf_dir(p) or is_sentence_transformers_dir(p):
        return False
    conf = _hf_config(p)
    archs = conf.get("architectures") or []
    labels = conf.get("num_labels", len(conf.get("id2label") or {}) or None)
    return any(a.endswith("ForSequenceClassification") for a in archs) and labels == 1


@dataclasses.dataclass
class STLayout:
    """What a sentence-transformers directory's modules say, in the terms BiEncoder takes."""
    transformer_dir: Path
    pooling: str
    normalize: bool
    max_seq_length: int | None
    lowercase_input: bool
    dense: dict | None  # {"weight", "bias", "activation"} of a Dense module


def _line_of(path: Path, text: str) -> int:
    try:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if text in line:
                return i
    except OSError:
        pass
    return 1


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (the sentence-transformers modules.json names this module)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, (dict, list)):
        raise ExportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _pooling_mode(conf: dict, where: str) -> str:
    """One of mean/cls/max from a Pooling config (sentence-transformers' legacy boolean keys or
    its newer ``pooling_mode``); anything else is refused, naming the file."""
    if "pooling_mode" in conf:
        modes = conf["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        legacy = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
        modes = [m for k, m in legacy.items() if conf.get(k)] or ["mean"]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ExportError(f"{where}: pooling {modes} is not supported; bertdist pools with exactly one of "
                          f"{list(POOLING_MODES)}")
    if conf.get("include_prompt") is False:
        raise ExportError(f"{where}: include_prompt=false (prompt tokens left out of pooling) is not supported")
    return modes[0]


def read_st_layout(path: str | Path) -> STLayout:
    """Parse ``modules.json`` and the module configs: Transformer, Pooling, an optional Dense, an
    optional Normalize, in that order. Any other module is refused, naming it."""
    from safetensors.torch import load_file

    p = Path(path)
    mpath = p / ST_MODULES
    modules = _read_json(mpath)
    if not isinstance(modules, list) or not modules:
        raise ExportError(f"{mpath}: expected a non-empty list of modules")
    kinds = []
    for i, m in enumerate(modules):
        if not isinstance(m, dict) or "type" not in m:
            raise ExportError(f"{mpath}: module {i} has no type")
        kinds.append(str(m["type"]).rsplit(".", 1)[-1])
    # The first module that breaks the order Transformer, Pooling, [Dense], [Normalize], if any.
    bad = next((i for i, want in enumerate(("Transformer", "Pooling")) if i >= len(kinds) or kinds[i] != want), None)
    if bad is None:
        i = 2 + (kinds[2:3] == ["Dense"])
        i += kinds[i:i + 1] == ["Normalize"]
        bad = i if i < len(kinds) else None
    if bad is not None:
        line = _line_of(mpath, str(modules[min(bad, len(modules) - 1)]["type"]))
        raise ExportError(f"{mpath}:{line}: modules {kinds} are not supported; bertdist loads Transformer, Pooling, "
                          "[Dense], [Normalize]")

    def folder(m: dict) -> Path:
        from bertdist.data.manifest import path_inside

        rel = str(m.get("path", ""))
        return p if rel in ("", ".") else path_inside(p, rel, mpath, ExportError)  # never a folder elsewhere

    tdir = folder(modules[0])
    max_len, lower = None, False
    for name in (ST_CONFIG, "sentence_roberta_config.json", "sentence_distilbert_config.json"):
        if (tdir / name).is_file():
            sb = _read_json(tdir / name)
            max_len = sb.get("max_seq_length")
            lower = bool(sb.get("do_lower_case", False))
            break
    pconf_path = folder(modules[1]) / "config.json"
    pooling = _pooling_mode(_read_json(pconf_path), str(pconf_path))
    dense = None
    if "Dense" in kinds:
        m = modules[kinds.index("Dense")]
        ddir = folder(m)
        dconf = _read_json(ddir / "config.json")
        act = dconf.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in DENSE_ACTIVATIONS:
            raise ExportError(f"{ddir / 'config.json'}: Dense activation {act!r} is not supported "
                              f"({sorted(DENSE_ACTIVATIONS)})")
        wfile = ddir / "model.safetensors"
        if wfile.is_file():
            sd = load_file(str(wfile))
        elif (ddir / "pytorch_model.bin").is_file():
            from bertdist.export.safe_load import load_file as safe_torch_load

            sd = safe_torch_load(ddir / "pytorch_model.bin")
        else:
            raise ExportError(f"{ddir}: a Dense module without weights (model.safetensors or pytorch_model.bin)")
        if "linear.weight" not in sd:
            raise ExportError(f"{ddir}: the Dense weights lack linear.weight (keys {sorted(sd)})")
        dense = {"weight": sd["linear.weight"].float(), "bias": sd.get("linear.bias"),
                 "activation": DENSE_ACTIVATIONS[act]}
    return STLayout(tdir, pooling, "Normalize" in kinds, max_len, lower, dense)


def _tokenizer_for(w, vocab_file=None, do_lower_case=None, checkpoint: str = ""):
    """The tokenizer over the checkpoint's vocab (or its own tokenizer.json), checked as fine-tuning
    checks it: (tokenizer, vocab file or None, casing)."""
    from bertdist.finetune.train import resolve_tokenizer

    ns = types.SimpleNamespace(vocab_file=vocab_file, do_lower_case=do_lower_case, checkpoint=checkpoint)
    tok = resolve_tokenizer(ns, w)
    if w.tokenizer_json is not None:
        return tok, None, False
    vocab = Path(vocab_file or w.vocab_file)
    lower = do_lower_case if do_lower_case is not None else w.do_lower_case
    return tok, vocab, bool(lower)


def _weights(path: Path, kernels: str, hidden_dropout_prob: float | None = None):
    from bertdist.export.sources import load_pretrained

    w = load_pretrained(path, kernels=kernels)
    w.config = family_of(w.config).with_dropout(w.config, hidden_dropout_prob)
    return w


def _tokenizer_max_length(path: Path, config: BertConfig) -> int | None:
    try:
        n = json.loads((path / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError):
        return None
    return min(int(n), config.max_position_embeddings) if isinstance(n, (int, float)) and n > 0 else None


def load_bi_encoder(path: str | Path, *, pooling: str | None = None, normalize: bool | None = None,
                    truncate_dim: int | None = None, max_seq_length: int | None = None, kernels: str = "auto",
                    hidden_dropout_prob: float | None = None, vocab_file: str | None = None,
                    do_lower_case: bool | None = None, device: str | torch.device = "cpu") -> BiEncoder:
    """A bi-encoder from a sentence-transformers directory or any checkpoint ``load_pretrained``
    reads; explicit arguments override what the directory says (a plain checkpoint: mean pooling,
    normalised, max_seq_length 128)."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint path does not exist: {p}")
    layout = read_st_layout(p) if is_sentence_transformers_dir(p) else None
    if is_cross_encoder_dir(p):
        raise ExportError(f"{p}: a cross-encoder directory (BertForSequenceClassification with one output), not a "
                          "bi-encoder; train task=rerank from it, or give an encoder checkpoint")
    w = _weights(layout.transformer_dir if layout else p, kernels, hidden_dropout_prob)
    tok, vocab, lower = _tokenizer_for(w, vocab_file, do_lower_case, str(p))
    dense = layout.dense if layout else None
    if dense is not None and dense["weight"].shape[1] != w.config.hidden_size:
        raise ExportError(f"{p}: the Dense module takes {dense['weight'].shape[1]} inputs but the encoder's "
                          f"hidden size is {w.config.hidden_size}")
    model = BiEncoder(
        w.config,
        pooling=pooling or (layout.pooling if layout else "mean"),
        normalize=normalize if normalize is not None else (layout.normalize if layout else True),
        truncate_dim=truncate_dim,
        projection_dim=int(dense["weight"].shape[0]) if dense else None,
        projection_activation=dense["activation"] if dense else "identity",
        device_type=torch.device(device).type,
    )
    model.bert.load_state_dict(family_of(w.config).encoder_state(w.state_dict, model.bert), strict=True)
    if dense is not None:
        with torch.no_grad():
            model.projection.weight.copy_(dense["weight"])
            if dense["bias"] is not None:
                model.projection.bias.copy_(dense["bias"].float())
            else:
                model.projection.bias.zero_()
    model.tokenizer, model.vocab_file, model.do_lower_case = tok, vocab, lower
    model.tokenizer_files = list(w.tokenizer_files)
    model.lowercase_input = bool(layout and layout.lowercase_input)
    model.max_seq_length = max_seq_length or (layout.max_seq_length if layout and layout.max_seq_length else None) \
        or 128
    model.origin = {**w.origin, "format": "sentence-transformers" if layout else w.origin.get("kind")}
    return model.to(device)


def load_cross_encoder(path: str | Path, *, max_seq_length: int | None = None, kernels: str = "auto",
                       hidden_dropout_prob: float | None = None, vocab_file: str | None = None,
                       do_lower_case: bool | None = None, activation: str | None = None,
                       device: str | torch.device = "cpu") -> CrossEncoder:
    """A cross-encoder directory (its head loaded), or any encoder checkpoint (a new head, seeded
    by the caller's torch seed)."""
    from bertdist.export.sources import read_task_dir

    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint path does not exist: {p}")
    head, head_opts = None, {}
    act = "identity"
    if is_cross_encoder_dir(p):
        w, raw, hf_config = read_task_dir(p, kernels=kernels)
        w.config = family_of(w.config).with_dropout(w.config, hidden_dropout_prob)
        keys = family_of(w.config).head_keys("regression")
        missing = [k for k in keys if k not in raw]
        if missing:
            raise ExportError(f"{p}: config.json names a sequence-classification model but the weights lack {missing}")
        head = {k: raw[k].float() for k in keys}
        head_opts = family_of(w.config).head_options_of(hf_config)
        st = (hf_config.get("sentence_transformers") or {}).get("activation_fn") \
            or hf_config.get("sbert_ce_default_activation_function")
        if st and st not in ACTIVATIONS.values():
            raise ExportError(f"{p / 'config.json'}: activation {st!r} is not one of {sorted(ACTIVATIONS.values())}")
        # without one named, sentence-transformers applies a sigmoid to a one-output model
        act = {path: name for name, path in ACTIVATIONS.items()}[st] if st else "sigmoid"
    else:
        if is_sentence_transformers_dir(p):
            layout = read_st_layout(p)
            w = _weights(layout.transformer_dir, kernels, hidden_dropout_prob)
        else:
            w = _weights(p, kernels, hidden_dropout_prob)
    tok, vocab, lower = _tokenizer_for(w, vocab_file, do_lower_case, str(p))
    model = make_cross_encoder(w.config, device_type=torch.device(device).type, activation=activation or act,
                               **head_opts)
    model.load_backbone(w.state_dict)
    if head is not None:
        model.load_state_dict({**model.state_dict(), **head})
    model.tokenizer, model.vocab_file, model.do_lower_case = tok, vocab, lower
    model.tokenizer_files = list(w.tokenizer_files)
    model.max_seq_length = max_seq_length or (_tokenizer_max_length(p, w.config) if head is not None else None) or 512
    model.origin = {**w.origin, "format": "cross-encoder" if head is not None else w.origin.get("kind")}
    return model.to(device)
