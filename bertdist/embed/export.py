"""Bi-encoders as sentence-transformers directories, cross-encoders as Hugging Face directories.

A bi-encoder directory (``write_bi_encoder``) is the layout sentence-transformers has read since
its 2.x releases, with the module types and config keys those releases know (newer releases read
it unchanged; a key an older release does not know would make it refuse the file):

* at the root, a Hugging Face ``BertModel`` (``config.json``, ``model.safetensors`` with the keys
  of a bare ``BertModel``) and the tokenizer files, so ``AutoModel`` and ``AutoTokenizer`` load it;
* ``modules.json``: Transformer (the root), Pooling (``1_Pooling``), a Dense when the model has a
  projection or a truncation width (``2_Dense``), Normalize when it normalises;
* ``sentence_bert_config.json``: ``max_seq_length`` (the truncation length the model was trained
  with) and ``do_lower_case: false`` (casing is the tokenizer's business);
* ``1_Pooling/config.json``: the mode as the legacy ``pooling_mode_*`` booleans;
* ``config_sentence_transformers.json``: cosine similarity, no prompts.

A truncation width (``truncate_dim``, for a Matryoshka-trained model) is exported as a Dense module
whose weight is the first d rows of the identity (or of the projection): an exact slice, taken
before Normalize, as bertdist serves it; sentence-transformers' own ``truncate_dim`` cuts after
Normalize and would return vectors that are not unit length.

On a ModernBERT backbone the root is a ``ModernBertModel`` and the cross-encoder a
``ModernBertForSequenceClassification``, each with the tokenizer files the checkpoint came with.

A cross-encoder directory (``write_cross_encoder``) is ``BertForSequenceClassification`` with
``num_labels: 1``, the tokenizer files with ``model_max_length`` = the training length, and under
``config.json``'s ``sentence_transformers.activation_fn`` the function that sentence-transformers'
``CrossEncoder.predict`` applies to the logit: ``Identity`` for a listwise-trained model (its
logits are only meaningful relative to each other), ``Sigmoid`` for a BCE-trained one (a
probability). Without that key, sentence-transformers would apply a sigmoid to any one-output model.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bertdist.embed.model import ACTIVATIONS, DENSE_ACTIVATIONS, BiEncoder, CrossEncoder
from bertdist.export.encoders import family_of
from bertdist.export.tokenizer import write_tokenizer_files

ST_TYPES = {  # the names sentence-transformers 2.x-6.x all resolve
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Dense": "sentence_transformers.models.Dense",
    "Normalize": "sentence_transformers.models.Normalize",
}
DENSE_ACTIVATION_PATHS = {name: path for path, name in DENSE_ACTIVATIONS.items()}


def _json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _versions() -> dict:
    import importlib.metadata

    out = {"pytorch": torch.__version__}
    for dist in ("bertdist", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _dense_weights(model: BiEncoder) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Dense module's (weight, bias): the projection, cut to truncate_dim rows; or the first
    truncate_dim rows of the identity; None when neither applies."""
    d = model.truncate_dim
    if model.projection is not None:
        w, b = model.projection.weight.detach().float().cpu(), model.projection.bias.detach().float().cpu()
        return (w[:d].clone(), b[:d].clone()) if d is not None else (w.clone(), b.clone())
    if d is not None and d < model.config.hidden_size:
        return torch.eye(model.config.hidden_size)[:d].clone(), torch.zeros(d)
    return None


def _write_tokenizer(out: Path, model, length: int) -> None:
    """The model's own tokenizer files as they came (ModernBERT's), else the WordPiece vocab's."""
    if any(Path(f).name == "tokenizer.json" for f in model.tokenizer_files):
        for f in model.tokenizer_files:
            shutil.copyfile(f, out / Path(f).name)
        return
    write_tokenizer_files(out, model.vocab_file, bool(model.do_lower_case), length)


def write_bi_encoder(out_dir: str | Path, model: BiEncoder, max_seq_length: int | None = None) -> Path:
    """The sentence-transformers directory of ``model`` (see the module doc)."""
    from safetensors.torch import save_file

    if model.vocab_file is None and not model.tokenizer_files:
        raise ValueError("the bi-encoder has no vocab file to export its tokenizer with")
    if model.projection is not None and model.projection_activation == "tanh" and model.truncate_dim is not None:
        raise ValueError("truncate_dim with a tanh Dense cannot be exported exactly (the cut must come after tanh)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    length = max_seq_length or model.max_seq_length
    sd = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in model.bert.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    family = family_of(model.config)
    _json(out / "config.json", family.hf_config(model.config, [family.hf_architecture("encoder")]))
    _write_tokenizer(out, model, length)
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST_TYPES["Transformer"]},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_TYPES["Pooling"]}]
    _json(out / "sentence_bert_config.json", {"max_seq_length": length, "do_lower_case": bool(model.lowercase_input)})
    _json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": model.config.hidden_size,
        "pooling_mode_cls_token": model.pooling == "cls",
        "pooling_mode_mean_tokens": model.pooling == "mean",
        "pooling_mode_max_tokens": model.pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    })
    dense = _dense_weights(model)
    if dense is not None:
        w, b = dense
        n = len(modules)
        path = f"{n}_Dense"
        act = DENSE_ACTIVATION_PATHS[model.projection_activation if model.projection is not None else "identity"]
        _json(out / path / "config.json", {"in_features": int(w.shape[1]), "out_features": int(w.shape[0]),
                                           "bias": True, "activation_function": act})
        save_file({"linear.weight": w.contiguous(), "linear.bias": b.contiguous()},
                  str(out / path / "model.safetensors"), metadata={"format": "pt"})
        modules.append({"idx": n, "name": str(n), "path": path, "type": ST_TYPES["Dense"]})
    if model.normalize:
        n = len(modules)
        (out / f"{n}_Normalize").mkdir(exist_ok=True)
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize", "type": ST_TYPES["Normalize"]})
    _json(out / "modules.json", modules)
    _json(out / "config_sentence_transformers.json", {"__version__": _versions(), "prompts": {},
                                                      "default_prompt_name": None, "similarity_fn_name": "cosine"})
    return out


def write_cross_encoder(out_dir: str | Path, model: CrossEncoder, max_seq_length: int | None = None) -> Path:
    """The Hugging Face ``BertForSequenceClassification`` directory of ``model`` (one label)."""
    from safetensors.torch import save_file

    if model.vocab_file is None and not model.tokenizer_files:
        raise ValueError("the cross-encoder has no vocab file to export its tokenizer with")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    length = max_seq_length or model.max_seq_length
    sd = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    family = family_of(model.config)
    conf = {**family.hf_config(model.config, [family.hf_architecture("regression")]), **family.task_config(model)}
    conf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                sentence_transformers={"activation_fn": ACTIVATIONS[model.activation]})
    _json(out / "config.json", conf)
    _write_tokenizer(out, model, length)
    return out
