"""An exported ONNX directory as a served model: request bodies in, batched onnxruntime runs, answers out.

The request and answer bodies follow Hugging Face text-embeddings-inference (TEI), so its
clients work unchanged:

* ``predict`` (sequence classification and regression; token classification):
  ``{"inputs": "text" | ["text a", "text b"] | [...], "raw_scores": false, "truncate": ...}``
  -> ``[{"label": ..., "score": ...}, ...]`` sorted by score (a list of those for a batch).
  As in TEI, a list of exactly two strings is one text pair; a batch is any other list.
* ``embed`` (encoders, mean pooling in the graph): ``{"inputs": "text" | [...], "normalize": true}``
  -> ``[[float, ...], ...]``.
* ``rerank`` (single-score models, i.e. cross-encoders):
  ``{"query": "...", "texts": [...], "raw_scores": false, "return_text": false}``
  -> ``[{"index": i, "score": s}, ...]`` sorted by score.

``prepare`` validates and tokenizes one request (a ``Job`` of ``Encoded`` items); ``run`` is one
onnxruntime call over a batch of items from any requests; ``Job.finish`` turns the outputs back
into the answer. The server in between does the batching.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bertdist.serve.card import ExportError, pick_variant, read_card

ROUTES = {"classification": ("predict",), "regression": ("predict", "rerank"), "token": ("predict",),
          "encoder": ("embed",), "span": (), "choice": ()}
FIELDS = {
    "predict": {"inputs", "raw_scores", "truncate", "truncation_direction"},
    "embed": {"inputs", "normalize", "truncate", "truncation_direction"},
    "rerank": {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"},
}
MAX_ITEMS = 1024  # texts per request


class RequestError(ValueError):
    """A bad request; ``status`` is its HTTP code (400 bad value, 413 too long, 422 bad field)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Encoded:
    input_ids: np.ndarray
    token_type_ids: np.ndarray
    length: int
    offsets: list | None = None  # token classification: character spans and word ids


@dataclasses.dataclass
class Job:
    items: list[Encoded]
    finisher: Callable[[list[np.ndarray]], Any]

    def finish(self, outputs: list[np.ndarray]) -> Any:
        return self.finisher(outputs)


def make_session(path: str | os.PathLike, threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _tokenizer(model_dir: Path, max_length: int | None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()  # tokenizer.json may carry a fixed padding (all-MiniLM-L6-v2 pads to 128)
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length, strategy="longest_first")
    return tok


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _is_text(x) -> bool:
    return isinstance(x, str)


class ServedModel:
    def __init__(self, model_dir: str | os.PathLike, *, name: str | None = None, variant: str = "auto",
                 threads: int | None = None, truncate: bool = True):
        self.dir = Path(model_dir)
        self.card = read_card(self.dir)
        self.task = self.card["task"]
        self.routes = ROUTES[self.task]
        if not self.routes:
            raise ExportError(f"{self.dir}: a {self.task} model has no serving route (served: sequence "
                              f"classification/regression, token classification, encoders)")
        self.name = name or self.dir.resolve().name
        self.variant = pick_variant(self.card, variant)
        self.max_length = int(self.card["max_length"])
        self.labels = self.card.get("labels")
        # One-score models: regression scores are served raw; a cross-encoder's card names the
        # activation its training meant (sigmoid after BCE, identity after a listwise loss).
        self.activation = self.card.get("activation") or ("identity" if self.task == "regression" else "sigmoid")
        self.truncate_default = truncate
        self.session = make_session(self.dir / self.card["files"][self.variant], threads)
        self._tok = _tokenizer(self.dir, None)
        self._tok_trunc = _tokenizer(self.dir, self.max_length)
        self._outputs = [o.name for o in self.session.get_outputs()]

    def info(self) -> dict:
        return {"model_id": self.name, "task": self.task, "routes": list(self.routes), "variant": self.variant,
                "file": self.card["files"][self.variant], "max_input_length": self.max_length,
                "labels": self.labels, "parity": self.card.get("parity", {}).get(self.variant)}

    # ---------------------------------------------------------------- requests
    def prepare(self, route: str, body: object) -> Job:
        if route not in self.routes:
            raise RequestError(f"model {self.name!r} ({self.task}) does not answer /{route}; it answers "
                               f"{['/' + r for r in self.routes]}", 404)
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", 422)
        unknown = sorted(set(body) - FIELDS[route])
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(FIELDS[route]))})", 422)
        truncate = self._flag(body, "truncate", self.truncate_default)
        direction = body.get("truncation_direction", "right")
        if not isinstance(direction, str) or direction.lower() != "right":
            raise RequestError(f"truncation_direction {direction!r}: only 'right' is supported", 422)
        return getattr(self, f"_prepare_{route}")(body, truncate)

    def _flag(self, body: dict, key: str, default: bool) -> bool:
        v = body.get(key, default)
        if not isinstance(v, bool):
            raise RequestError(f"field {key!r} must be true or false, got {v!r}", 422)
        return v

    def _inputs(self, body: dict, pairs: bool) -> tuple[list, bool]:
        """TEI's ``inputs``: a text, a pair (a list of exactly two texts), or a batch of those."""
        if "inputs" not in body:
            raise RequestError("missing field 'inputs'", 422)
        x = body["inputs"]
        if _is_text(x):
            return [x], True
        if not isinstance(x, list) or not x:
            raise RequestError("'inputs' must be a text or a non-empty list of texts", 422)
        if pairs and len(x) == 2 and all(_is_text(t) for t in x):
            return [tuple(x)], True
        items = []
        for i, t in enumerate(x):
            if _is_text(t):
                items.append(t)
            elif pairs and isinstance(t, list) and len(t) in (1, 2) and all(_is_text(s) for s in t):
                items.append(tuple(t) if len(t) == 2 else t[0])
            else:
                raise RequestError(f"inputs[{i}] must be a text{' or a pair of texts' if pairs else ''}", 422)
        if len(items) > MAX_ITEMS:
            raise RequestError(f"{len(items)} inputs in one request; at most {MAX_ITEMS}", 413)
        return items, False

    def _encode(self, texts: list, truncate: bool) -> list[Encoded]:
        for t in texts:
            if (t if isinstance(t, str) else "".join(t)).strip() == "":
                raise RequestError("an input text is empty", 400)
        encs = self._tok.encode_batch([t if isinstance(t, str) else tuple(t) for t in texts])
        long = [i for i, e in enumerate(encs) if len(e.ids) > self.max_length]
        if long:
            if not truncate:
                i = long[0]
                raise RequestError(f"input {i} has {len(encs[i].ids)} tokens, over the model's limit of "
                                   f"{self.max_length} (send \"truncate\": true to cut it)", 413)
            for i in long:
                t = texts[i]
                encs[i] = self._tok_trunc.encode(t) if isinstance(t, str) else self._tok_trunc.encode(*t)
        out = []
        for e in encs:
            offsets = list(zip(e.offsets, e.word_ids)) if self.task == "token" else None
            out.append(Encoded(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64),
                               len(e.ids), offsets))
        return out

    def _prepare_predict(self, body: dict, truncate: bool) -> Job:
        raw = self._flag(body, "raw_scores", False)
        texts, single = self._inputs(body, pairs=self.task != "token")
        items = self._encode(texts, truncate)
        if self.task == "token":
            def finish(outputs):
                res = [self._token_labels(texts[i], items[i], o, raw) for i, o in enumerate(outputs)]
                return res[0] if single else res
        else:
            def finish(outputs):
                res = [self._label_scores(o, raw) for o in outputs]
                return res[0] if single else res
        return Job(items, finish)

    def _label_scores(self, logits: np.ndarray, raw: bool) -> list[dict]:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if logits.size == 1:
            score = float(logits[0]) if raw or self.activation == "identity" else float(_sigmoid(logits[0]))
            return [{"label": (self.labels or ["score"])[0], "score": score}]
        scores = logits if raw else _softmax(logits)
        names = self.labels or [f"LABEL_{i}" for i in range(logits.size)]
        order = np.argsort(-scores, kind="stable")
        return [{"label": names[i], "score": float(scores[i])} for i in order]

    def _token_labels(self, text: str, item: Encoded, logits: np.ndarray, raw: bool) -> list[dict]:
        """One label per word (its first token's), with the word's character span in the text."""
        probs = logits if raw else _softmax(np.asarray(logits, dtype=np.float64))
        names = self.labels or [f"LABEL_{i}" for i in range(probs.shape[-1])]
        words: dict[int, dict] = {}
        for j, ((start, end), w) in enumerate(item.offsets):
            if w is None:
                continue
            if w not in words:
                k = int(np.argmax(probs[j]))
                words[w] = {"word": None, "label": names[k], "score": float(probs[j][k]), "start": start, "end": end}
            words[w]["end"] = end
        for w in words.values():
            w["word"] = text[w["start"]:w["end"]]
        return list(words.values())

    def _prepare_embed(self, body: dict, truncate: bool) -> Job:
        normalize = self._flag(body, "normalize", True)
        texts, single = self._inputs(body, pairs=False)
        items = self._encode(texts, truncate)

        def finish(outputs):
            vecs = [np.asarray(o, dtype=np.float32) for o in outputs]
            if normalize:
                vecs = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vecs]
            return [v.tolist() for v in vecs]
        return Job(items, finish)

    def _prepare_rerank(self, body: dict, truncate: bool) -> Job:
        raw = self._flag(body, "raw_scores", False)
        ret_text = self._flag(body, "return_text", False)
        q, texts = body.get("query"), body.get("texts")
        if not _is_text(q):
            raise RequestError("'query' must be a text", 422)
        if not isinstance(texts, list) or not texts or not all(_is_text(t) for t in texts):
            raise RequestError("'texts' must be a non-empty list of texts", 422)
        if len(texts) > MAX_ITEMS:
            raise RequestError(f"{len(texts)} texts in one request; at most {MAX_ITEMS}", 413)
        items = self._encode([(q, t) for t in texts], truncate)

        def finish(outputs):
            logits = [float(np.asarray(o).reshape(-1)[0]) for o in outputs]
            scores = logits if raw or self.activation == "identity" else [float(_sigmoid(x)) for x in logits]
            order = sorted(range(len(texts)), key=lambda i: -scores[i])
            return [{"index": i, "score": scores[i], **({"text": texts[i]} if ret_text else {})} for i in order]
        return Job(items, finish)

    # ---------------------------------------------------------------- one batched run
    def run(self, items: list[Encoded]) -> list[np.ndarray]:
        width = max(it.length for it in items)
        ids = np.zeros((len(items), width), dtype=np.int64)
        types = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        for i, it in enumerate(items):
            ids[i, :it.length], types[i, :it.length], mask[i, :it.length] = it.input_ids, it.token_type_ids, 1
        res = dict(zip(self._outputs, self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                                               "token_type_ids": types})))
        if self.task == "encoder":
            return list(res["sentence_embedding"])
        logits = res["logits"]
        if self.task == "token":
            return [logits[i, :it.length] for i, it in enumerate(items)]
        return list(logits)


def load_served_model(model_dir: str | os.PathLike, *, name: str | None = None, variant: str = "auto",
                      threads: int | None = None, truncate: bool = True) -> ServedModel:
    return ServedModel(model_dir, name=name, variant=variant, threads=threads, truncate=truncate)
