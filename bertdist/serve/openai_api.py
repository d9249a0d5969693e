"""OpenAI's embeddings API over the served encoders: ``POST /v1/embeddings`` and ``GET /v1/models``.

Retrieval stacks (LangChain, LlamaIndex, Haystack, vector databases' embedders, the ``openai``
package) call embedding servers this way; text-embeddings-inference serves the same routes.

Request: ``{"input": "text" | ["text", ...], "model": "NAME", "encoding_format": "float" | "base64",
"dimensions": N, "user": "..."}``. Answer: ``{"object": "list", "data": [{"object": "embedding",
"index": i, "embedding": [...] | "base64"}], "model": NAME, "usage": {"prompt_tokens": n,
"total_tokens": n}}``. Embeddings are L2-normalised, as OpenAI's are. Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, which its clients parse.
"""
from __future__ import annotations

import base64
from typing import Sequence

import numpy as np

from bertdist.serve.runtime import MAX_ITEMS, Job, RequestError

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
ENCODINGS = ("float", "base64")


class OpenAIRequestError(RequestError):
    """A bad request, with the request field it concerns (OpenAI's ``param``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message, status)
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ("invalid_request_error" if status < 500 and status != 429 else
            "rate_limit_error" if status == 429 else "server_error")
    code = {404: "model_not_found", 413: "context_length_exceeded"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def pick_encoder(models: Sequence, requested) -> object:
    """The encoder named by the request's ``model``; any name but another loaded model's when only
    one encoder is loaded (clients must send one, and it is often the name the model had elsewhere)."""
    encoders = [m for m in models if "embed" in m.routes]
    if not encoders:
        raise OpenAIRequestError(f"no loaded model serves embeddings; loaded: "
                                 f"{', '.join(f'{m.name} ({m.task})' for m in models)}", 404, "model")
    if requested is not None and not isinstance(requested, str):
        raise OpenAIRequestError(f"'model' must be a string, got {type(requested).__name__}", 400, "model")
    named = [m for m in models if m.name == requested]
    if named and named[0] in encoders:
        return named[0]
    if named:
        raise OpenAIRequestError(f"model {requested!r} is a {named[0].task} model, not an encoder; embeddings come "
                                 f"from: {', '.join(m.name for m in encoders)}", 404, "model")
    if len(encoders) == 1:
        return encoders[0]
    raise OpenAIRequestError(f"no embedding model named {requested!r}; loaded: "
                             f"{', '.join(m.name for m in encoders)}", 404, "model")


def _inputs(x) -> list[str]:
    if isinstance(x, str):
        return [x]
    if not isinstance(x, list) or not x:
        raise OpenAIRequestError("'input' must be a string or a non-empty array of strings", 400, "input")
    if len(x) > MAX_ITEMS:
        raise OpenAIRequestError(f"{len(x)} inputs in one request; at most {MAX_ITEMS}", 413, "input")
    for i, t in enumerate(x):
        if isinstance(t, (int, list)) and not isinstance(t, bool):
            raise OpenAIRequestError(
                "token arrays are not accepted: send text (token ids from another tokenizer mean other words "
                "here; LangChain's OpenAIEmbeddings sends them unless check_embedding_ctx_length=False)",
                400, "input")
        if not isinstance(t, str):
            raise OpenAIRequestError(f"input[{i}] must be a string", 400, "input")
    return list(x)


def plan_embeddings(model, body: dict) -> Job:
    """The request as a Job of ``model`` whose answer is OpenAI's embeddings list."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise OpenAIRequestError(f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(FIELDS))})", 400,
                                 unknown[0])
    if "input" not in body:
        raise OpenAIRequestError("missing field 'input'", 400, "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODINGS:
        raise OpenAIRequestError(f"encoding_format {fmt!r}: must be 'float' or 'base64'", 400, "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and dims != model.dimension:
        raise OpenAIRequestError(f"dimensions {dims!r}: model {model.name!r} gives {model.dimension}-dimensional "
                                 f"embeddings and is not trained to be cut shorter", 400, "dimensions")
    job = model.plan("embed", {"inputs": _inputs(body["input"]), "normalize": True})
    vectors = job.finisher

    def finish(outputs):
        data = []
        for i, v in enumerate(vectors(outputs)):
            emb = (base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii") if fmt == "base64"
                   else v)
            data.append({"object": "embedding", "index": i, "embedding": emb})
        tokens = sum(it.length for it in job.items)
        return {"object": "list", "data": data, "model": model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    job.finisher = finish
    return job


def models_list(models: Sequence) -> dict:
    """``GET /v1/models``: the loaded models, as OpenAI lists them."""
    return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "bertdist"}
                                       for m in models]}
