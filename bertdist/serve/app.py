"""The HTTP server around served models: Starlette routes, one dynamic batcher per model, metrics.

Routes (bodies as in Hugging Face text-embeddings-inference; see bertdist.serve.runtime):
``POST /predict``, ``/embed``, ``/similarity``, ``/rerank`` go to the one loaded model that answers
them; ``POST /models/{name}/{route}`` names the model (needed once several models answer a route);
``POST /`` is the one loaded model's own task; ``POST /v1/embeddings`` and ``GET /v1/models`` are
OpenAI's (bertdist.serve.openai_api); ``GET /health``, ``/info``, ``/metrics``. Errors are
``{"error": "...", "error_type": "..."}`` (OpenAI's shape on its routes).

Parsing and tokenizing run on one preparing thread, a request's texts in chunks so that requests
take turns; the event loop only moves bytes.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import time
from typing import Any, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bertdist.serve import openai_api
from bertdist.serve.batcher import Batcher, BatchFailed, Refused, TooManyItems
from bertdist.serve.connections import ON_DISCONNECT
from bertdist.serve.metrics import ServeMetrics
from bertdist.serve.preparing import PreparingThread
from bertdist.serve.runtime import RequestError

log = logging.getLogger(__name__)

ROUTES = ("predict", "embed", "rerank", "similarity")
# Texts tokenized in one turn of the preparing thread; requests take turns between chunks.
ENCODE_CHUNK = 32
# TEI's error types, by the HTTP status of a bad request.
ERROR_TYPES = {400: "Validation", 404: "NotFound", 405: "Validation", 413: "Validation", 422: "Validation",
               500: "Backend", 503: "Overloaded"}


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    max_batch_size: int = 32
    # 0: continuous batching, what queued while the previous batch ran; measured on the SST-2
    # student at 32 clients: as fast as a 2 ms wait, and at 1 client 2.2x faster (no idle wait).
    max_wait_ms: float = 0.0
    max_queue: int = 256  # items waiting, per model
    # Tokens per batch at most (with at least one item): a batch of long texts then takes no longer
    # than a batch of short ones, so small requests never wait behind a long one for long.
    max_batch_tokens: int | None = 2048
    batching: bool = True
    # Batches of one model running at once, each on its own thread. One single-threaded run per
    # core beats one run over all cores: the runs' threads never meet at an operator's end.
    workers: int = 1
    max_body_bytes: int = 1 << 20
    # Bodies up to this size are parsed and tokenized on the event loop: bounded work (about a
    # thousand tokens at most; more than 32 texts still go out in chunks), cheaper than the hop to
    # the preparing thread and back.
    inline_body_bytes: int = 4096
    body_timeout: float = 30.0  # seconds for a request's body to arrive once its head has
    grace_seconds: float = 25.0  # from a stop signal to exit; Kubernetes' default grace period is 30 s


class HTTPError(Exception):
    def __init__(self, status: int, message: str, error_type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type or ERROR_TYPES.get(status, "Validation")
        self.headers = headers or {}


def _json_default(x: Any):
    # Answers are built from numpy outputs; a numpy scalar or array left in one is still JSON.
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


class Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_json_default).encode("utf-8")


def error_response(status: int, message: str, error_type: str | None = None, headers: dict | None = None) -> Json:
    return Json({"error": message, "error_type": error_type or ERROR_TYPES.get(status, "Validation")}, status,
                headers=headers)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class CutOff(HTTPError):
    """The server stopped before the request could be answered (its body was still arriving, or
    the grace period ended first)."""

    def __init__(self, message: str):
        super().__init__(503, message, "Unhealthy", {"Connection": "close"})


def _arrived(request: Request, chunks: list) -> str:
    return f"{sum(map(len, chunks))} of {request.headers.get('content-length', 'an unknown number of')} bytes arrived"


async def _read_body(request: Request, limit: int, chunks: list) -> bytes:
    """The raw body, gathered in ``chunks`` as it arrives, at most ``limit`` bytes far."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise HTTPError(400, f"bad Content-Length header {declared!r}") from None
        if size > limit:
            raise HTTPError(413, f"the body is {size} bytes, over this server's limit of {limit} bytes")
    size, more = 0, True
    while more:  # receive() itself: request.stream() is an async generator, costly per request
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:  # a chunked body or a lying Content-Length
            raise HTTPError(413, f"the body is over this server's limit of {limit} bytes")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or an HTTPError that says what is wrong with it."""
    if not raw.strip():
        raise HTTPError(400, "empty body: expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise HTTPError(400, f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})") from None
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # NaN, Infinity
        raise HTTPError(400, f"malformed JSON: {e}") from None
    except RecursionError:
        raise HTTPError(400, "malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(body), "a number")
        raise HTTPError(400, f"the body must be a JSON object, got {kind}")
    return body


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body is already read: the next ASGI message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ServeState:
    """The models, their batchers and the metrics of one app."""

    def __init__(self, models: Sequence, settings: ServeSettings):
        names = [m.name for m in models]
        if not models:
            raise ValueError("no model to serve")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"two models are named {dupes[0]!r}; give each its own name")
        self.settings = settings
        self.models = {m.name: m for m in models}
        self.metrics = ServeMetrics()
        self.batchers = {}
        for m in models:
            self.metrics.add_model(m.name)
            self.batchers[m.name] = Batcher(m.run, name=m.name, max_batch_size=settings.max_batch_size,
                                            max_wait_ms=settings.max_wait_ms, max_queue=settings.max_queue,
                                            batching=settings.batching, max_batch_tokens=settings.max_batch_tokens,
                                            workers=settings.workers, observer=self.metrics)
        self.preparing = PreparingThread()
        # Requests still receiving their bodies, and requests waiting for their answers: the stop
        # cuts off the first at once and the second when the grace period ends.
        self.receiving: set[asyncio.Task] = set()
        self.answering: set[asyncio.Task] = set()
        self.grace_over = False
        self.answered = 0
        self.cut_off = 0
        self.stop_began: float | None = None
        self.serving = False  # after startup
        self.stopping = False  # once shutdown begins: /health answers 503; accepted requests are still answered

    def begin_stop(self) -> None:
        """Shutdown has begun: /health answers 503, and queued items stop waiting for batches to
        fill; accepted requests are still answered."""
        if self.stopping:
            return
        self.stopping = True
        self.stop_began = time.monotonic()
        for task in self.receiving:
            task.cancel()
        grace = self.settings.grace_seconds
        # The answers still pending get a second less than the grace period, to be written.
        asyncio.get_running_loop().call_later(max(grace - 1.0, grace / 2), self._end_grace)
        for b in self.batchers.values():
            b.stop_waiting()

    def _end_grace(self) -> None:
        self.grace_over = True
        for task in self.answering:
            task.cancel()

    async def read_body(self, request: Request) -> bytes:
        """The raw body, at most ``max_body_bytes``, within ``body_timeout`` seconds; cut off
        (CutOff) once the server begins to stop."""
        limit, timeout = self.settings.max_body_bytes, self.settings.body_timeout
        task, got = asyncio.current_task(), []
        self.receiving.add(task)
        try:
            async with asyncio.timeout(timeout):
                return await _read_body(request, limit, got)
        except TimeoutError:
            raise HTTPError(408, f"the request's body did not arrive within {timeout:g} s ({_arrived(request, got)})",
                            None, {"Connection": "close"}) from None
        except asyncio.CancelledError:
            if self.stopping and task.uncancel() == 0:  # cancelled by begin_stop, not by the server
                raise CutOff(f"the server is stopping, and this request's body was still arriving "
                             f"({_arrived(request, got)})") from None
            raise
        finally:
            self.receiving.discard(task)

    def served(self) -> str:
        """Which model answers which route, for messages."""
        return "; ".join(f"{name} ({', '.join('/' + r for r in m.routes) or 'no route'})"
                         for name, m in self.models.items())

    def model_for(self, route: str, name: str | None):
        if name is not None:
            model = self.models.get(name)
            if model is None:
                raise HTTPError(404, f"no model named {name!r}; loaded: {self.served()}")
            if route not in ROUTES or route not in model.routes:
                raise HTTPError(404, f"model {name!r} does not answer /{route}; it answers "
                                     f"{', '.join('/' + r for r in model.routes)}")
            return model
        answering = [m for m in self.models.values() if route in m.routes]
        if not answering:
            raise HTTPError(404, f"no loaded model answers /{route}; served: {self.served()}")
        if len(answering) > 1:
            raise HTTPError(400, f"several models answer /{route} ({', '.join(m.name for m in answering)}); "
                                 f"name one: POST /models/NAME/{route}")
        return answering[0]

    def only_model(self):
        """The model ``POST /`` answers with: the one loaded."""
        if len(self.models) > 1:
            raise HTTPError(400, f"POST / answers with the one loaded model, and {len(self.models)} are loaded: "
                                 f"{self.served()}; use their routes or POST /models/NAME/ROUTE")
        return next(iter(self.models.values()))

    async def prepare(self, fn, raw: bytes, *args):
        """``fn(*args)``, which parses ``raw`` and tokenizes what it holds: on the event loop for a
        small body, else on the preparing thread."""
        if len(raw) <= self.settings.inline_body_bytes:
            return fn(*args)
        return await self.offload(fn, *args)

    async def offload(self, fn, *args):
        """Runs ``fn`` on the request-preparing thread: parsing and tokenizing stay off the event loop."""
        return await self.preparing.run(fn, *args)

    async def encode(self, model, job) -> None:
        """Tokenizes the job's texts in chunks, so that a large request takes turns with small ones."""
        for first in range(0, len(job.texts), ENCODE_CHUNK):
            job.items += await self.offload(model.encode, job.texts[first:first + ENCODE_CHUNK], job.truncate,
                                            job.direction, first)

    async def run_job(self, request: Request, model, job):
        """The job's answer; ClientGone (and the job taken off the queue) if the client leaves first."""
        batcher = self.batchers[model.name]
        if not job.encoded:
            batcher.check_fits(len(job.texts))  # before any tokenizing
            await self.encode(model, job)
        ticket = batcher.enqueue(job)
        # Our connection protocol calls back when the client goes; under another server, a task
        # waits for the ASGI disconnect message instead.
        watch = request.scope.get("extensions", {}).get(ON_DISCONNECT)
        gone = None
        if watch is not None:
            watch(lambda: batcher.abandon(ticket))
        else:
            gone = asyncio.ensure_future(wait_for_disconnect(request))
            gone.add_done_callback(lambda g: g.cancelled() or batcher.abandon(ticket))
        task = asyncio.current_task()
        self.answering.add(task)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            batcher.abandon(ticket)
            if self.grace_over and task.uncancel() == 0:  # cancelled by _end_grace
                raise CutOff(f"the server stopped: its grace period of {self.settings.grace_seconds:g} s ended "
                             f"before this answer was ready") from None
            if task.cancelling() == 0:  # the ticket was abandoned: its client has gone
                raise ClientGone() from None
            raise
        finally:
            if watch is not None:
                watch(None)
            else:
                gone.cancel()
            self.answering.discard(task)

    async def answer(self, request: Request, route: str | None, name: str | None, *, api: str = "tei") -> Response:
        """One request to a model route: ``route`` None is ``POST /``, ``api`` "openai" is
        ``/v1/embeddings`` (OpenAI's bodies and errors)."""
        start = time.perf_counter()
        label_model, label_route = "", route or "root"  # only names of loaded models become label values
        model, cut = None, False
        try:
            model = (self.only_model() if route is None else
                     None if api == "openai" else self.model_for(route, name))
            label_model = model.name if model is not None else ""
            raw = await self.read_body(request)
            if api == "openai":
                model, job = await self.prepare(plan_openai, raw, list(self.models.values()), raw,
                                                self.settings.max_queue)
                label_model = model.name
            else:
                job = await self.prepare(plan_request, raw, model, route or "root", raw, self.settings.max_queue)
            in_flight = self.metrics.child(self.metrics.in_flight, model.name)
            in_flight.inc()
            try:
                response = Json(await self.run_job(request, model, job))
            finally:
                in_flight.dec()
        except ClientGone:
            response = Response(status_code=499)  # nobody reads it; counted as such
        except ClientDisconnect:
            response = Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - any failure is this request's 4xx/5xx, never the server's
            response = self.error(e, api, label_model, label_route)
            cut = isinstance(e, CutOff)
        if cut:
            self.cut_off += 1
        elif response.status_code != 499:
            self.answered += 1
        self.metrics.observe_request(label_model, label_route if label_route in ROUTES + ("root", "v1_embeddings")
                                     else "other", response.status_code, time.perf_counter() - start)
        return response

    def error(self, e: Exception, api: str, model: str, route: str) -> Response:
        """Our JSON error for a failed request (OpenAI's shape on its routes)."""
        headers = {}
        if isinstance(e, HTTPError):
            status, error_type, headers = e.status, e.error_type, e.headers
        elif isinstance(e, RequestError):
            status, error_type = e.status, getattr(e, "error_type", None)
        elif isinstance(e, Refused):
            status, error_type, headers = 503, e.error_type, {"Retry-After": str(e.retry_after)}
        elif isinstance(e, TooManyItems):
            status, error_type = 413, None
        elif isinstance(e, BatchFailed):
            status, error_type = 500, "Backend"
        else:
            log.exception("%s /%s failed", model or "?", route)
            status, error_type, e = 500, "Backend", f"internal error: {type(e).__name__}: {e}"
        if api == "openai":
            return Json(openai_api.error_body(status, str(e), getattr(e, "param", None)), status, headers=headers)
        return error_response(status, str(e), error_type, headers)


def plan_request(model, route: str, raw: bytes, max_queue: int):
    """Parses a TEI-shaped body and validates it into the model's Job (a small one tokenized too)."""
    body = parse_json_object(raw)
    return encode_if_small(model, model.plan(root_route(model, body) if route == "root" else route, body), max_queue)


def plan_openai(models: list, raw: bytes, max_queue: int):
    """(the encoder it names, its Job) for an OpenAI embeddings body."""
    body = parse_json_object(raw)
    model = openai_api.pick_encoder(models, body.get("model"))
    return model, encode_if_small(model, openai_api.plan_embeddings(model, body), max_queue)


def encode_if_small(model, job, max_queue: int):
    """A job of one chunk is tokenized on the turn that planned it: one hop to the preparing
    thread per ordinary request."""
    if len(job.texts) <= min(ENCODE_CHUNK, max_queue):
        job.items = model.encode(job.texts, job.truncate, job.direction)
    return job


def root_route(model, body: dict | None) -> str:
    """Which of the model's routes ``POST /`` means, by the body's shape (as TEI decides): a query
    with texts is a re-ranking, inputs with a source sentence a similarity; else the model's task."""
    if body is None:
        return "root"
    if "rerank" in model.routes and ("query" in body or "texts" in body):
        return "rerank"
    if "similarity" in model.routes and isinstance(body.get("inputs"), dict):
        return "similarity"
    return model.routes[0]


def make_app(models: Sequence, settings: ServeSettings | None = None) -> Starlette:
    """A Starlette app serving ``models`` (bertdist.serve.runtime.ServedModel objects). Its
    lifespan starts one batcher per model and, at shutdown, drains them."""
    state = ServeState(models, settings or ServeSettings())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        for b in state.batchers.values():
            await b.start()
        # What is loaded by now (models, tokenizers, libraries) lives as long as the process: out
        # of the collector's sight, a full collection no longer walks it between requests.
        gc.freeze()
        state.serving = True
        try:
            yield
        finally:
            state.begin_stop()
            await asyncio.gather(*(b.drain() for b in state.batchers.values()))
            state.preparing.shutdown()
            state.serving = False

    def unprefixed(route: str):
        async def endpoint(request: Request) -> Response:
            return await state.answer(request, route, None)
        endpoint.__name__ = route
        return endpoint

    async def root(request: Request) -> Response:
        return await state.answer(request, None, None)

    async def openai_embeddings(request: Request) -> Response:
        return await state.answer(request, "v1_embeddings", None, api="openai")

    async def openai_models(request: Request) -> Response:
        return Json(openai_api.models_list(list(state.models.values())))

    async def named(request: Request) -> Response:
        return await state.answer(request, request.path_params["route"], request.path_params["name"])

    async def health(request: Request) -> Response:
        if state.serving and not state.stopping:
            return Json({"status": "ok"})
        return Json({"status": "draining" if state.stopping else "starting"}, 503)

    async def info(request: Request) -> Response:
        s = state.settings
        return Json({"models": [{"name": m.name, **m.info()} for m in state.models.values()],
                     "batching": {"enabled": s.batching, "max_batch_size": s.max_batch_size,
                                  "max_batch_tokens": s.max_batch_tokens, "max_wait_ms": s.max_wait_ms,
                                  "workers": s.workers,
                                  "max_queue": s.max_queue},
                     "max_body_bytes": s.max_body_bytes})

    async def metrics(request: Request) -> Response:
        data, content_type = state.metrics.render()
        return Response(data, headers={"Content-Type": content_type})

    async def http_exception(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}; this server answers POST "
                                       f"/, /predict, /embed, /similarity, /rerank, /models/NAME/ROUTE, "
                                       f"/v1/embeddings and GET /health, /info, /metrics, /v1/models; models: "
                                       f"{state.served()}")
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}",
                                  headers=dict(exc.headers or {}))
        return error_response(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))

    routes = [Route("/", root, methods=["POST"])]
    routes += [Route(f"/{r}", unprefixed(r), methods=["POST"]) for r in ROUTES]
    routes += [Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
               Route("/v1/models", openai_models, methods=["GET"]),
               Route("/models/{name}/{route}", named, methods=["POST"]),
               Route("/health", health, methods=["GET"]),
               Route("/info", info, methods=["GET"]),
               Route("/metrics", metrics, methods=["GET"])]
    fast = {"/": (None, None), **{f"/{r}": (r, None) for r in ROUTES}}
    app = ServeApp(fast, state.answer, routes=routes, lifespan=lifespan,
                   exception_handlers={HTTPException: http_exception})
    app.state.serve = state
    return app


class ServeApp(Starlette):
    """Starlette, with the POSTs to the unprefixed model routes answered without its router and
    middleware: ``answer`` turns every failure into its JSON response itself, and under load the
    routing and middleware layers took about a tenth of the event loop's time."""

    def __init__(self, fast: dict[str, tuple], answer, **kwargs):
        super().__init__(**kwargs)
        self._fast = fast
        self._answer = answer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            target = self._fast.get(scope["path"])
            if target is not None:
                scope["app"] = self
                response = await self._answer(Request(scope, receive), *target)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
