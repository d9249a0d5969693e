"""An exported ONNX directory as a served model: request bodies in, batched onnxruntime runs, answers out.

The request and answer bodies follow Hugging Face text-embeddings-inference (TEI), so its
clients work unchanged:

* ``predict`` (sequence classification and regression; token classification):
  ``{"inputs": "text" | ["text a", "text b"] | [...], "raw_scores": false, "truncate": ...}``
  -> ``[{"label": ..., "score": ...}, ...]`` sorted by score (a list of those for a batch).
  As in TEI, a list of exactly two strings is one text pair; a batch is any other list.
* ``embed`` (encoders, mean pooling in the graph): ``{"inputs": "text" | [...], "normalize": true}``
  -> ``[[float, ...], ...]``.
* ``similarity`` (encoders): ``{"inputs": {"source_sentence": "...", "sentences": [...]}}`` ->
  ``[cosine, ...]``.
* ``rerank`` (single-score models, i.e. cross-encoders):
  ``{"query": "...", "texts": [...], "raw_scores": false, "return_text": false}``
  -> ``[{"index": i, "score": s}, ...]`` sorted by score.

Options may also come in a ``parameters`` object (Hugging Face's Inference API shape, which
``InferenceClient`` sends); a ``/predict`` body with one is answered in that API's shape.

``plan`` validates one request into a ``Job``; ``encode`` tokenizes its texts, each cut first to a
length bounded by the model's limit; ``run`` is one onnxruntime call over a batch of items from
any requests; ``Job.finish`` turns the outputs back into the answer. The server in between does
the batching.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bertdist.serve.card import ExportError, pick_variant, read_card

ROUTES = {"classification": ("predict",), "regression": ("predict", "rerank"), "token": ("predict",),
          "encoder": ("embed", "similarity"), "span": (), "choice": ()}
FIELDS = {
    "predict": {"inputs", "parameters", "raw_scores", "truncate", "truncation_direction"},
    "embed": {"inputs", "parameters", "normalize", "truncate", "truncation_direction"},
    "similarity": {"inputs", "parameters", "truncate", "truncation_direction"},
    "rerank": {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"},
}
# What Hugging Face's `InferenceClient` (and the Inference API) send in ``parameters``, per route;
# other keys there are ignored with a warning, as that API does.
PARAMETERS = {
    "predict": {"top_k", "function_to_apply", "truncate", "truncation_direction"},
    "embed": {"normalize", "truncate", "truncation_direction"},
    "similarity": {"truncate", "truncation_direction"},
}
FUNCTIONS = ("softmax", "sigmoid", "none")
DIRECTIONS = ("right", "left")
MAX_ITEMS = 1024  # texts per request
# A text is cut to this many characters per token of the model's limit before it is tokenized,
# so a request's work is bounded by the limit, not by the body; a cut that gives fewer tokens than
# the limit (long runs of whitespace or of characters the normalizer drops) is cut again, 4x longer.
CHARS_PER_TOKEN = 8
# How far back (or forward) from the cut a whitespace is looked for, so no word is split.
WORD_CHARS = 128

log = logging.getLogger(__name__)


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
    """One request, validated: ``texts`` (texts or text pairs) still to encode into ``items``,
    and how its outputs become the answer."""

    texts: list
    finisher: Callable[[list[np.ndarray]], Any]
    truncate: bool = True
    direction: str = "right"
    items: list[Encoded] = dataclasses.field(default_factory=list)

    @property
    def encoded(self) -> bool:
        return len(self.items) == len(self.texts)

    def finish(self, outputs: list[np.ndarray]) -> Any:
        return self.finisher(outputs)


def make_session(path: str | os.PathLike, threads: int | None = None, spin: bool = False):
    """An ONNX Runtime CPU session. ``spin``: idle pool threads spin instead of sleeping: a little
    faster for a process that only runs the model, and a thief of the cores in a server, which
    shares them with its event loop and the preparing thread."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _tokenizer(model_dir: Path, max_length: int | None, direction: str):
    from tokenizers import Tokenizer

    from bertdist.export.tokenizer import trim_byte_level_offsets

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()  # tokenizer.json may carry a fixed padding (all-MiniLM-L6-v2 pads to 128)
    trim_byte_level_offsets(tok)  # a word's span without the space before it (ModernBERT's byte-level BPE)
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length, strategy="longest_first", direction=direction)
    return tok


def cut_text(text: str, limit: int, direction: str) -> tuple[str, int]:
    """``text`` cut to at most ``limit`` characters, keeping its start (``right``) or its end
    (``left``), at a whitespace when one is near the cut; and the offset of the kept part."""
    if len(text) <= limit:
        return text, 0
    if direction == "right":
        end = limit
        for i in range(limit, max(limit - WORD_CHARS, 0), -1):
            if text[i].isspace():
                end = i
                break
        return text[:end], 0
    start = len(text) - limit
    for i in range(start, min(start + WORD_CHARS, len(text))):
        if text[i - 1].isspace():
            start = i
            break
    return text[start:], start


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# Up to this many labels, an answer's scores are computed in plain Python.
FEW_LABELS = 32


def _softmax_few(x: list[float]) -> list[float]:
    top = max(x)
    e = [math.exp(v - top) for v in x]
    total = sum(e)
    return [v / total for v in e]


def _sigmoid_few(x: list[float]) -> list[float]:
    return [1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v)) for v in x]


def _is_text(x) -> bool:
    return isinstance(x, str)


def _check_unicode(text: str, where: str) -> None:
    """JSON can carry lone surrogates (``"\\ud800"``), which are not text: refused here, not by the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where} is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                           f"{e.start}", 422) from None


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
        # One tokenizer per truncation side, never reconfigured: safe to share across threads.
        self._tok = {d: _tokenizer(self.dir, self.max_length, d) for d in DIRECTIONS}
        self._tok_plain = _tokenizer(self.dir, None, "right")  # counts a pair's tokens
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._token_types = "token_type_ids" in {i.name for i in self.session.get_inputs()}  # not ModernBERT's
        self._warned: set = set()

    def info(self) -> dict:
        return {"model_id": self.name, "task": self.task, "routes": list(self.routes), "variant": self.variant,
                "file": self.card["files"][self.variant], "max_input_length": self.max_length,
                "labels": self.labels, "parity": self.card.get("parity", {}).get(self.variant)}

    @property
    def dimension(self) -> int | None:
        """An encoder's embedding width (from the graph), else None."""
        if self.task != "encoder":
            return None
        out = next(o for o in self.session.get_outputs() if o.name == "sentence_embedding")
        return out.shape[-1] if isinstance(out.shape[-1], int) else None

    # ---------------------------------------------------------------- requests
    def prepare(self, route: str, body: object) -> Job:
        """Validates and tokenizes one request (the server does the same in two steps, ``plan``
        and ``encode``, off its event loop)."""
        job = self.plan(route, body)
        job.items = self.encode(job.texts, job.truncate, job.direction)
        return job

    def plan(self, route: str, body: object) -> Job:
        """Validates one request into a Job whose texts are not yet tokenized. Its cost is the
        size of the body, whatever the texts hold."""
        if route not in self.routes:
            raise RequestError(f"model {self.name!r} ({self.task}) does not answer /{route}; it answers "
                               f"{['/' + r for r in self.routes]}", 404)
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", 422)
        unknown = sorted(set(body) - FIELDS[route])
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(FIELDS[route]))})", 422)
        opts = self._options(route, body)
        truncate = self._flag(opts, "truncate", self.truncate_default)
        direction = opts.get("truncation_direction", "right")
        if not isinstance(direction, str) or direction.lower() not in DIRECTIONS:
            raise RequestError(f"truncation_direction {direction!r}: must be 'right' or 'left'", 422)
        job = getattr(self, f"_plan_{route}")(body, opts)
        job.truncate, job.direction = truncate, direction.lower()
        return job

    def _options(self, route: str, body: dict) -> dict:
        """The request's options: its top-level fields merged with its ``parameters`` object
        (Hugging Face's Inference API shape); the same option given both ways must agree."""
        params = body.get("parameters")
        opts = {k: v for k, v in body.items() if k not in ("inputs", "parameters")}
        if params is None:
            return opts
        if not isinstance(params, dict):
            raise RequestError(f"'parameters' must be a JSON object, got {type(params).__name__}", 422)
        ignored = sorted(set(params) - PARAMETERS[route])
        if ignored and (route, tuple(ignored)) not in self._warned:
            self._warned.add((route, tuple(ignored)))
            log.warning("model %s: ignoring parameters %s of a /%s request (understood: %s)", self.name,
                        ", ".join(ignored), route, ", ".join(sorted(PARAMETERS[route])))
        for k in PARAMETERS[route] & set(params):
            if params[k] is None:  # an unset option, as clients send it
                continue
            if k in opts and opts[k] != params[k]:
                raise RequestError(f"{k!r} is {opts[k]!r} at the top level but {params[k]!r} in 'parameters'", 422)
            opts[k] = params[k]
        return opts

    def _flag(self, opts: dict, key: str, default: bool) -> bool:
        v = opts.get(key, default)
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
        if len(x) > MAX_ITEMS:
            raise RequestError(f"{len(x)} inputs in one request; at most {MAX_ITEMS}", 413)
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
        return items, False

    # ---------------------------------------------------------------- tokenizing
    def encode(self, texts: list, truncate: bool, direction: str = "right", first: int = 0) -> list[Encoded]:
        """Tokenizes texts (or pairs), each cut first to a length bounded by the model's limit;
        the tokens equal those of the whole text truncated to the limit. ``first`` is the index
        of ``texts[0]`` in its request, for messages."""
        for i, t in enumerate(texts, first):
            sides = (t,) if isinstance(t, str) else t
            if "".join(sides).strip() == "":
                raise RequestError("an input text is empty", 400)
            for s in sides:
                _check_unicode(s, f"input {i}")
        tok = self._tok[direction]
        limit = (self.max_length + 1) * CHARS_PER_TOKEN
        sides = [(t,) if isinstance(t, str) else tuple(t) for t in texts]
        cuts = [[cut_text(x, limit, direction) for x in side] for side in sides]
        # One batched call for the request; the rare text whose cut was too short is cut again alone.
        encs = tok.encode_batch([c[0][0] if len(c) == 1 else (c[0][0], c[1][0]) for c in cuts])
        out = []
        for i, (side, cut, enc) in enumerate(zip(sides, cuts, encs), first):
            shift = cut[0][1]
            if not self._settled(side, cut, enc):
                enc, shift = self._encode_one(tok, side, limit * 4, direction)
            if enc.overflowing and not truncate:
                raise RequestError(f"input {i} is over the model's limit of {self.max_length} tokens (send "
                                   f"\"truncate\": true to cut it)", 413)
            offsets = None
            if self.task == "token":
                offsets = [((a + shift, b + shift), w) for (a, b), w in zip(enc.offsets, enc.word_ids)]
            out.append(Encoded(np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.type_ids, dtype=np.int64),
                               len(enc.ids), offsets))
        return out

    def _encode_one(self, tok, sides: tuple, limit: int, direction: str):
        """(encoding, character offset of the kept part) of one text or pair, cut ever longer until settled."""
        while True:
            cuts = [cut_text(x, limit, direction) for x in sides]
            enc = tok.encode(*(c for c, _ in cuts))
            if self._settled(sides, cuts, enc):
                return enc, cuts[0][1]
            limit *= 4

    def _settled(self, sides: tuple, cuts: list, enc) -> bool:
        """Whether the cut cannot change the tokens: nothing was cut; a single text the tokenizer
        still had to truncate; a pair whose cut side also outnumbers the whole other side, since
        longest-first truncation gives the odd token to the longer side."""
        was_cut = [len(c) < len(x) for (c, _), x in zip(cuts, sides)]
        if not any(was_cut):
            return True
        if len(sides) == 1:
            return bool(enc.overflowing)
        return self._pair_settled([c for c, _ in cuts], was_cut)

    def _pair_settled(self, cuts: list[str], was_cut: list[bool]) -> bool:
        if all(was_cut):
            return False
        counts = [len(self._tok_plain.encode(c, add_special_tokens=False).ids) for c in cuts]
        j = was_cut.index(True)
        return counts[j] >= self.max_length and counts[j] > counts[1 - j]

    # ---------------------------------------------------------------- routes
    def _scores(self, opts: dict) -> str:
        """How logits become scores: ``raw_scores`` or ``function_to_apply`` (softmax, sigmoid,
        none), else the model's own (softmax over labels; a one-score model's card activation)."""
        raw = self._flag(opts, "raw_scores", False)
        fn = opts.get("function_to_apply")
        if fn is None:
            return "none" if raw else "default"
        if not isinstance(fn, str) or fn.lower() not in FUNCTIONS:
            raise RequestError(f"function_to_apply {fn!r}: must be one of {', '.join(FUNCTIONS)}", 422)
        if raw and fn.lower() != "none":
            raise RequestError(f"raw_scores is true but function_to_apply is {fn!r}", 422)
        return fn.lower()

    def _plan_predict(self, body: dict, opts: dict) -> Job:
        scores = self._scores(opts)
        top_k = opts.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise RequestError(f"top_k {top_k!r}: must be a whole number of at least 1", 422)
        texts, single = self._inputs(body, pairs=self.task != "token")
        # The Inference API's shape (what a body with ``parameters`` asks for): a list of labels
        # per input, a single text included.
        nested = "parameters" in body and self.task != "token"
        job = Job(texts, None)
        if self.task == "token":
            def finish(outputs):
                res = [self._token_labels(texts[i], job.items[i], o, scores == "none") for i, o in enumerate(outputs)]
                return res[0] if single else res
        else:
            def finish(outputs):
                res = [self._label_scores(o, scores)[:top_k] for o in outputs]
                return res[0] if single and not nested else res
        job.finisher = finish
        return job

    def _label_scores(self, logits: np.ndarray, how: str) -> list[dict]:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if how == "default":
            how = ("softmax" if logits.size > 1 else
                   "none" if self.activation == "identity" else "sigmoid")
        names = self.labels or ([f"LABEL_{i}" for i in range(logits.size)] if logits.size > 1 else ["score"])
        if logits.size <= FEW_LABELS:  # per answer, on the event loop: numpy's per-call cost dominates
            scores = {"softmax": _softmax_few, "sigmoid": _sigmoid_few, "none": list}[how](logits.tolist())
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            return [{"label": names[i], "score": scores[i]} for i in order]
        scores = {"softmax": _softmax, "sigmoid": _sigmoid, "none": lambda x: x}[how](logits)
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
        # a byte-level BPE (ModernBERT's) makes a run of spaces a pre-token of its own: not a word
        return [w for w in words.values() if w["word"].strip()]

    def _plan_embed(self, body: dict, opts: dict) -> Job:
        normalize = self._flag(opts, "normalize", True)
        texts, single = self._inputs(body, pairs=False)

        def finish(outputs):
            vecs = [np.asarray(o, dtype=np.float32) for o in outputs]
            if normalize:
                vecs = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vecs]
            return [v.tolist() for v in vecs]
        return Job(texts, finish)

    def _plan_similarity(self, body: dict, opts: dict) -> Job:
        """TEI's and the Inference API's sentence similarity: the cosine of each sentence's
        embedding with the source sentence's."""
        x = body.get("inputs")
        if not isinstance(x, dict) or set(x) != {"source_sentence", "sentences"}:
            raise RequestError("'inputs' must be an object with 'source_sentence' (a text) and 'sentences' "
                               "(a list of texts)", 422)
        source, others = x["source_sentence"], x["sentences"]
        if not _is_text(source):
            raise RequestError("'source_sentence' must be a text", 422)
        if not isinstance(others, list) or not others or not all(_is_text(t) for t in others):
            raise RequestError("'sentences' must be a non-empty list of texts", 422)
        if len(others) + 1 > MAX_ITEMS:
            raise RequestError(f"{len(others)} sentences in one request; at most {MAX_ITEMS - 1}", 413)

        def finish(outputs):
            vecs = np.stack([np.asarray(o, dtype=np.float64) for o in outputs])
            vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
            return [float(v) for v in vecs[1:] @ vecs[0]]
        return Job([source, *others], finish)

    def _plan_rerank(self, body: dict, opts: dict) -> Job:
        raw = self._flag(opts, "raw_scores", False)
        ret_text = self._flag(opts, "return_text", False)
        q, texts = body.get("query"), body.get("texts")
        if not _is_text(q):
            raise RequestError("'query' must be a text", 422)
        if not isinstance(texts, list) or not texts or not all(_is_text(t) for t in texts):
            raise RequestError("'texts' must be a non-empty list of texts", 422)
        if len(texts) > MAX_ITEMS:
            raise RequestError(f"{len(texts)} texts in one request; at most {MAX_ITEMS}", 413)

        def finish(outputs):
            logits = [float(np.asarray(o).reshape(-1)[0]) for o in outputs]
            scores = logits if raw or self.activation == "identity" else [float(_sigmoid(x)) for x in logits]
            order = sorted(range(len(texts)), key=lambda i: -scores[i])
            return [{"index": i, "score": scores[i], **({"text": texts[i]} if ret_text else {})} for i in order]
        return Job([(q, t) for t in texts], finish)

    # ---------------------------------------------------------------- one batched run
    def run(self, items: list[Encoded]) -> list[np.ndarray]:
        width = max(it.length for it in items)
        ids = np.zeros((len(items), width), dtype=np.int64)
        types = np.zeros_like(ids)
        mask = np.zeros_like(ids)
        for i, it in enumerate(items):
            ids[i, :it.length], types[i, :it.length], mask[i, :it.length] = it.input_ids, it.token_type_ids, 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._token_types:
            feeds["token_type_ids"] = types
        res = dict(zip(self._outputs, self.session.run(None, feeds)))
        if self.task == "encoder":
            return list(res["sentence_embedding"])
        logits = res["logits"]
        if self.task == "token":
            return [logits[i, :it.length] for i, it in enumerate(items)]
        return list(logits)


def load_served_model(model_dir: str | os.PathLike, *, name: str | None = None, variant: str = "auto",
                      threads: int | None = None, truncate: bool = True) -> ServedModel:
    return ServedModel(model_dir, name=name, variant=variant, threads=threads, truncate=truncate)
