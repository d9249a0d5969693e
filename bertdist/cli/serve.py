"""`bertdist serve DIR [DIR...]`: ONNX exports behind an HTTP server with dynamic batching."""
from __future__ import annotations

import sys

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def _is_local(host: str) -> bool:
    import ipaddress

    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int):
    """A listening socket, bound before the server starts so that ``--port 0`` can say its port."""
    import socket

    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def default_workers(threads: int, models: int) -> int:
    """Runs at once per model when ``--workers`` is not given: the cores this process may use,
    shared among the models, ``threads`` to a run; at least one."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (threads * models))


def run(args) -> int:
    from pathlib import Path

    from bertdist.serve.card import CARD

    names = list(args.name or [])
    if names and len(names) != len(args.dirs):
        print(f"bertdist serve: {len(names)} --name for {len(args.dirs)} directories; give one per directory, in order",
              file=sys.stderr)
        return 2
    if len(set(names)) != len(names):
        print(f"bertdist serve: a --name is given twice: {names}", file=sys.stderr)
        return 2
    for d in args.dirs:
        p = Path(d)
        if not p.is_dir():
            print(f"bertdist serve: {d}: no such directory", file=sys.stderr)
            return 2
        if not (p / CARD).is_file():
            print(f"bertdist serve: {d}: not an exported ONNX model (no {CARD}); write one with "
                  f"`bertdist export MODEL --format onnx --out DIR`", file=sys.stderr)
            return 2
    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
                             ("--max-wait-ms", args.max_wait_ms, 0), ("--port", args.port, 0),
                             ("--max-batch-tokens", args.max_batch_tokens, 0),
                             ("--max-connections", 1 if args.max_connections is None else args.max_connections, 1),
                             ("--grace", args.grace, 1), ("--head-timeout", args.head_timeout, 0.1),
                             ("--body-timeout", args.body_timeout, 0.1)):
        if value < low:
            print(f"bertdist serve: {flag} {value}: must be at least {low}", file=sys.stderr)
            return 2
    for flag, value in (("--threads", args.threads), ("--workers", args.workers)):
        if value is not None and value < 1:
            print(f"bertdist serve: {flag} {value}: must be at least 1", file=sys.stderr)
            return 2
    workers = args.workers or default_workers(args.threads, len(args.dirs))

    from bertdist.serve.card import ExportError
    from bertdist.serve.runtime import load_served_model

    models = []
    for i, d in enumerate(args.dirs):
        try:
            models.append(load_served_model(d, name=names[i] if names else None, variant=args.variant,
                                            threads=args.threads, truncate=not args.refuse_long))
        except (ExportError, OSError, ValueError, KeyError) as e:
            print(f"bertdist serve: {d}: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 - onnxruntime's load errors have no common base class
            print(f"bertdist serve: {d}: cannot load the model: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    taken = [m.name for m in models]
    if len(set(taken)) != len(taken):
        print(f"bertdist serve: two directories give the model name {sorted(n for n in taken if taken.count(n) > 1)[0]!r};"
              f" name them with --name", file=sys.stderr)
        return 2

    from bertdist.serve.app import ServeSettings, make_app

    settings = ServeSettings(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
                             max_queue=args.max_queue, batching=not args.no_batching,
                             body_timeout=args.body_timeout, grace_seconds=args.grace,
                             max_batch_tokens=args.max_batch_tokens or None, workers=workers)
    app = make_app(models, settings)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"bertdist serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    _announce(args, _url(args.host, sock.getsockname()[1]), models, settings)
    from bertdist.serve.connections import ConnectionLimits

    return _serve(app, sock, ConnectionLimits(head_timeout=args.head_timeout, max_connections=args.max_connections))


def _announce(args, url: str, models, settings) -> None:
    if not _is_local(args.host):
        print(f"bertdist serve: warning: listening on {args.host}, reachable from other machines; the server has "
              f"no authentication or TLS")
    for m in models:
        routes = ", ".join(f"POST /{r}" for r in m.routes)
        print(f"model {m.name}: {m.task}, {m.variant} ONNX, max length {m.max_length}: {routes} "
              f"(also POST /models/{m.name}/ROUTE)")
    runs = f"{settings.workers} run{'s' if settings.workers > 1 else ''} at once of {args.threads} thread" + \
        ("s" if args.threads > 1 else "")
    batching = (f"batches of up to {settings.max_batch_size} items, {settings.max_wait_ms:g} ms wait, {runs}"
                if settings.batching else f"batching off, {runs}")
    print(f"serving on {url} ({batching}, queue {settings.max_queue} items per model); GET /health /info /metrics")
    sys.stdout.flush()


def _serve(app, sock, limits) -> int:
    """Runs uvicorn on the listening socket until SIGINT/SIGTERM, then stops gracefully within the
    grace period, and says what became of the requests."""
    import signal
    import time

    import uvicorn

    from bertdist.serve.connections import guarded_protocol

    state = app.state.serve

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # uvicorn waits for the accepted requests before the app's own shutdown: their
            # queued items must not wait for batches to fill meanwhile, and bodies still arriving
            # are cut off at once.
            state.begin_stop()
            await super().shutdown(sockets)

    # httptools (C parser) with the head deadline, head size bound and connection cap uvicorn lacks;
    # uvicorn's own keep-alive timeout closes idle connections between requests.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            http=guarded_protocol(limits), loop="auto", proxy_headers=False,
                            timeout_graceful_shutdown=state.settings.grace_seconds, timeout_keep_alive=5)
    server = Server(config)
    stopped_by = []

    def note(sig, frame):
        stopped_by.append(signal.Signals(sig).name)

    # uvicorn re-raises the signal that stopped it once it has shut down; caught here, the
    # process can end with status 0 after a graceful stop.
    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
    if not server.started:
        print("bertdist serve: the server did not start", file=sys.stderr)
        return 1
    took = f" in {time.monotonic() - state.stop_began:.1f} s" if state.stop_began is not None else ""
    counts = f"{state.answered} request{'' if state.answered == 1 else 's'} answered, {state.cut_off} cut off"
    if server.force_exit:  # a second Ctrl-C: uvicorn dropped what was in flight
        print(f"bertdist serve: stopped at once by a second signal{took}; {counts}, and the requests in flight "
              f"were not answered")
        return 1
    why = (" (their bodies were still arriving, or the grace period ended before their answers)"
           if state.cut_off else "")
    print(f"bertdist serve: stopped{' by ' + stopped_by[0] if stopped_by else ''}{took}; {counts}{why}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve exported ONNX models over HTTP (TEI-compatible /predict, /embed, /rerank)")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="directories written by `bertdist export --format onnx`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free one; the URL is printed)")
    p.add_argument("--max-batch-size", type=int, default=32, help="items per model run")
    p.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="tokens per model run at most (at least one text; 0: no bound), so a batch of long texts "
                        "takes no longer than one of short texts")
    p.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="how long the first queued item waits for more to batch with (0: none; a batch is "
                        "what queued while the previous one ran)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="items waiting per model; a request that does not fit gets 503 with Retry-After")
    p.add_argument("--no-batching", action="store_true", help="run each request alone (for comparison)")
    p.add_argument("--variant", choices=["auto", "fp32", "optimized", "int8"], default="auto",
                   help="which exported ONNX file to load (auto: int8, else optimized, else fp32)")
    p.add_argument("--threads", type=int, default=1,
                   help="onnxruntime threads per model run (default 1: on CPU, one single-threaded run per core "
                        "serves more than one run over all cores)")
    p.add_argument("--workers", type=int, default=None,
                   help="batches of a model that run at once, each on its own thread (default: the available "
                        "cores, shared among the models, divided by --threads)")
    p.add_argument("--refuse-long", action="store_true",
                   help="answer 413 to texts over the model's max length (default: truncate them)")
    p.add_argument("--grace", type=float, default=25.0,
                   help="seconds from SIGTERM to exit: in-flight requests are answered within it, bodies still "
                        "arriving are cut off at once (default 25; Kubernetes waits 30)")
    p.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's head; silent ones are closed, partial "
                        "ones get 408")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request's body to arrive (408)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most (default: the file-descriptor limit less 64); past it the "
                        "oldest idle one is closed")
    p.add_argument("--name", action="append", default=None,
                   help="the model's name in /models/NAME/... (repeat, one per DIR; default: the directory name)")
    p.set_defaults(func=run)
