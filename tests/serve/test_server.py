"""The HTTP server over real sockets: a uvicorn server in a thread for the routes, errors and
metrics, and `bertdist serve` processes for overload, the length limit and a graceful stop.
Every answer is compared with the same model's answer computed offline (prepare, run, finish)."""
from __future__ import annotations

import asyncio
import http.client
import json
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

WORDS = ("the cat sat on a mat while rain fell over quiet town and old friends talked about books "
         "music rivers mountains history science letters gardens ships morning evening").split()


def text(tag: str, words: int) -> str:
    """A text that starts with its own tag, so every request's answer is its own."""
    rng = random.Random(tag)
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words))


# ---------------------------------------------------------------------------------------------
# Clients


def call(port: int, method: str, path: str, body=None, *, raw: bytes | None = None, headers=None,
         conn: http.client.HTTPConnection | None = None, timeout: float = 30):
    """(status, headers with lower-case names, parsed JSON or bytes)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        payload = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
    finally:
        if conn is None:
            c.close()
    if hdrs.get("content-type", "").startswith("application/json"):
        payload = json.loads(payload)
    return r.status, hdrs, payload


def metric_values(port: int) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, from GET /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, hdrs, body = call(port, "GET", "/metrics")
    assert status == 200 and hdrs["content-type"].startswith("text/plain"), (status, hdrs)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


# ---------------------------------------------------------------------------------------------
# Offline answers and their comparison


def canonical(answer):
    """Score lists keyed by label / index: two nearly equal scores may sort either way."""
    if isinstance(answer, list) and answer and all(isinstance(x, dict) for x in answer):
        key = "label" if "label" in answer[0] else "index" if "index" in answer[0] else None
        if key:
            return {x[key]: canonical(x) for x in answer}
    if isinstance(answer, list):
        return [canonical(x) for x in answer]
    if isinstance(answer, dict):
        return {k: canonical(v) for k, v in answer.items()}
    return answer


def assert_same(got, want, where: str, tol: float = 2e-6) -> None:
    got, want = canonical(got), canonical(want)

    def walk(a, b, path):
        if isinstance(b, float):
            assert isinstance(a, (int, float)) and abs(a - b) <= tol, f"{where}{path}: {a} != {b}"
        elif isinstance(b, dict):
            assert isinstance(a, dict) and set(a) == set(b), f"{where}{path}: keys {a} != {b}"
            for k in b:
                walk(a[k], b[k], f"{path}[{k!r}]")
        elif isinstance(b, list):
            assert isinstance(a, list) and len(a) == len(b), f"{where}{path}: {a} != {b}"
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        else:
            assert a == b, f"{where}{path}: {a!r} != {b!r}"
    walk(got, want, "")


class Offline:
    """The served models loaded in this process, answering without the server."""

    def __init__(self, dirs: dict):
        from bertdist.serve.runtime import load_served_model

        self.models = {name: load_served_model(d, name=name) for name, d in dirs.items()}

    def answer(self, name: str, route: str, body: dict):
        m = self.models[name]
        job = m.prepare(route, body)
        return json.loads(json.dumps(job.finish(m.run(job.items))))


# ---------------------------------------------------------------------------------------------
# Servers


def _listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    return sock


class ThreadServer:
    """uvicorn serving ``make_app(models, settings)`` from a thread of this process."""

    def __init__(self, models, settings, http="h11"):
        """``http``: uvicorn's protocol; ``"guarded"`` is the one `bertdist serve` runs."""
        import uvicorn

        from bertdist.serve.app import make_app
        from bertdist.serve.connections import ConnectionLimits, guarded_protocol

        self.app = make_app(models, settings)
        self.sock = _listening_socket()
        self.port = self.sock.getsockname()[1]
        protocol = guarded_protocol(ConnectionLimits()) if http == "guarded" else http
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on", http=protocol))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"


class CliServer:
    """A `bertdist serve ... --port 0` process; the port comes from the URL it prints."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "bertdist.cli.main", "serve", *args, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 60
        self.port = None
        while self.port is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                pytest.fail("bertdist serve did not start:\n" + "".join(self.output))
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
        # The socket listens before the app starts; ready once /health answers.
        while call(self.port, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "".join(self.output)
            time.sleep(0.05)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stop(self, sig=signal.SIGTERM, timeout: float = 15) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"bertdist serve did not exit within {timeout} s of {sig.name}:\n" + "".join(self.output))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def model_dirs(onnx_model):
    return {"cls": onnx_model("classification"), "enc": onnx_model("encoder"), "reg": onnx_model("regression")}


@pytest.fixture(scope="module")
def offline(model_dirs):
    return Offline(model_dirs)


@pytest.fixture(scope="module")
def server(model_dirs):
    """Three models: two answer /predict (so it must be named), one /embed, one /rerank."""
    from bertdist.serve.app import ServeSettings
    from bertdist.serve.runtime import load_served_model

    models = [load_served_model(d, name=name) for name, d in model_dirs.items()]
    s = ThreadServer(models, ServeSettings(max_batch_size=8, max_wait_ms=10, max_queue=512))
    yield s
    s.stop()


# ---------------------------------------------------------------------------------------------
# Tests


def test_concurrent_load_every_answer_is_the_offline_one(server, offline):
    """16 clients x 8 requests of mixed routes and lengths (some over the 128-token limit, so
    truncated): each answer equals that request's own offline answer."""
    clients, per_client = 16, 8

    def plan(c: int, r: int):
        tag, words = f"c{c}r{r}", (c * 7 + r * 13) % 150 + 1
        kind = (c + r) % 4
        if kind == 0:
            return "enc", "embed", "/embed", {"inputs": text(tag, words)}
        if kind == 1:
            texts = [text(f"{tag}-{i}", words + 9 * i) for i in range(3)]
            return "cls", "predict", "/models/cls/predict", {"inputs": texts}
        if kind == 2:
            return "reg", "rerank", "/rerank", {"query": text(tag, 4), "texts": [text(f"{tag}-{i}", words // (i + 1))
                                                                                for i in range(3)]}
        return "cls", "predict", "/models/cls/predict", {"inputs": text(tag, words), "raw_scores": r % 2 == 0}

    plans = {(c, r): plan(c, r) for c in range(clients) for r in range(per_client)}
    answers: dict = {}
    errors: list = []
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            barrier.wait(30)
            for r in range(per_client):
                _, _, path, body = plans[c, r]
                answers[c, r] = call(server.port, "POST", path, body, conn=conn)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"client {c}: {type(e).__name__}: {e}")
        finally:
            conn.close()

    before = metric_values(server.port)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(answers) == clients * per_client
    for key, (name, route, path, body) in plans.items():
        status, _, got = answers[key]
        assert status == 200, (key, path, got)
        assert_same(got, offline.answer(name, route, body), f"{path} {key}")
    after = metric_values(server.port)
    # Batching happened over HTTP: some model ran a batch of more than one item.
    def batches_over_one(values, m):
        return (metric(values, "bertdist_serve_batch_size_count", model=m)
                - metric(values, "bertdist_serve_batch_size_bucket", model=m, le="1.0"))

    multi = sum(batches_over_one(after, m) - batches_over_one(before, m) for m in ("cls", "enc", "reg"))
    assert multi > 0, "no batch held more than one item"
    for m in ("cls", "enc", "reg"):
        assert metric(after, "bertdist_serve_batch_size_bucket", model=m, le="8.0") == \
            metric(after, "bertdist_serve_batch_size_count", model=m), "a batch over max_batch_size"
        assert metric(after, "bertdist_serve_queue_depth", model=m) == 0
        assert metric(after, "bertdist_serve_requests_in_flight", model=m) == 0


BAD_REQUESTS = [
    # (path, raw body, status, words the error must contain)
    ("/embed", b'{"inputs": "a",}', 400,
     "malformed JSON: Expecting property name enclosed in double quotes at line 1 column 16"),
    ("/embed", b'{"inputs": NaN}', 400, "NaN is not JSON"),
    ("/embed", b"", 400, "empty body"),
    ("/embed", b'["a", "b"]', 400, "must be a JSON object, got an array"),
    ("/embed", b'"text"', 400, "must be a JSON object, got a string"),
    ("/embed", b"\xff\xfe{", 400, "not UTF-8"),
    ("/embed", b"[" * 100_000, 400, "nested too deeply"),
    ("/embed", b'{"inputs": "a", "foo": 1}', 422, "unknown field 'foo'"),
    ("/embed", b'{"input": "a"}', 422, "unknown field 'input'"),
    ("/embed", b'{"normalize": true}', 422, "missing field 'inputs'"),
    ("/embed", b'{"inputs": 5}', 422, "'inputs' must be a text"),
    ("/embed", b'{"inputs": []}', 422, "non-empty list"),
    ("/embed", b'{"inputs": ""}', 400, "empty"),
    ("/embed", b'{"inputs": "a", "normalize": "yes"}', 422, "'normalize' must be true or false"),
    ("/rerank", b'{"query": "q", "texts": "not a list"}', 422, "'texts' must be a non-empty list"),
    ("/models/cls/predict", b'{"inputs": ["a", 3, "c"]}', 422, "inputs[1]"),
    ("/predict", b'{"inputs": "a"}', 400, "several models answer /predict (cls, reg)"),
    ("/classify", b'{"inputs": "a"}', 404, "no route POST /classify"),
    ("/models/nobody/predict", b'{"inputs": "a"}', 404, "no model named 'nobody'; loaded: cls (/predict)"),
    ("/models/cls/embed", b'{"inputs": "a"}', 404, "model 'cls' does not answer /embed; it answers /predict"),
    ("/models/cls/classify", b'{"inputs": "a"}', 404, "model 'cls' does not answer /classify"),
]


@pytest.mark.parametrize("path,raw,status,words", BAD_REQUESTS,
                         ids=[f"{p}-{s}-{w[:24]}" for p, _, s, w in BAD_REQUESTS])
def test_a_bad_request_gets_its_4xx_and_says_why(server, path, raw, status, words):
    got, _, body = call(server.port, "POST", path, raw=raw)
    assert got == status, body
    assert set(body) == {"error", "error_type"} and words in body["error"], body
    assert body["error_type"] == ("NotFound" if status == 404 else "Validation")


def test_bodies_over_the_size_limit_get_413(server):
    limit = 1 << 20
    # Declared too big: refused before reading.
    got, _, body = call(server.port, "POST", "/embed", raw=b"{}", headers={"Content-Length": str(limit + 1)})
    assert got == 413 and f"over this server's limit of {limit} bytes" in body["error"], body
    # Really too big, without a Content-Length (chunked).
    big = json.dumps({"inputs": "word " * (limit // 5 + 10)}).encode()
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        c.request("POST", "/embed", body=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                  headers={"Content-Type": "application/json"}, encode_chunked=True)
        r = c.getresponse()
        assert r.status == 413 and "over this server's limit" in json.loads(r.read())["error"]
    finally:
        c.close()


def test_wrong_methods_and_unknown_paths_answer_json(server):
    got, hdrs, body = call(server.port, "GET", "/embed")
    assert got == 405 and "GET is not allowed on /embed" in body["error"] and "POST" in hdrs.get("allow", "")
    got, _, body = call(server.port, "GET", "/nothing/here")
    assert got == 404 and "models: cls (/predict); enc (/embed, /similarity); reg (/predict, /rerank)" in body["error"], body


def test_health_info_and_metrics_count_the_requests_sent(server, offline):
    assert call(server.port, "GET", "/health")[:3:2] == (200, {"status": "ok"})
    status, _, info = call(server.port, "GET", "/info")
    assert status == 200 and [m["name"] for m in info["models"]] == ["cls", "enc", "reg"]
    assert {m["name"]: m["routes"] for m in info["models"]} == {"cls": ["predict"], "enc": ["embed", "similarity"],
                                                               "reg": ["predict", "rerank"]}
    assert info["batching"] == {"enabled": True, "max_batch_size": 8, "max_batch_tokens": 2048, "max_wait_ms": 10,
                                "workers": 1, "max_queue": 512}

    before = metric_values(server.port)
    for i in range(5):
        body = {"inputs": text(f"m{i}", 5)}
        status, _, got = call(server.port, "POST", "/models/cls/predict", body)
        assert status == 200
        assert_same(got, offline.answer("cls", "predict", body), "metrics request")
    for _ in range(3):
        assert call(server.port, "POST", "/models/cls/predict", {"inputs": "a", "bad": 1})[0] == 422
    assert call(server.port, "POST", "/models/cls/predict", raw=b"{")[0] == 400
    assert call(server.port, "POST", "/models/ghost/predict", {"inputs": "a"})[0] == 404
    after = metric_values(server.port)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("bertdist_serve_requests_total", model="cls", route="predict", code="200") == 5
    assert delta("bertdist_serve_requests_total", model="cls", route="predict", code="422") == 3
    assert delta("bertdist_serve_requests_total", model="cls", route="predict", code="400") == 1
    assert delta("bertdist_serve_requests_total", model="", route="predict", code="404") == 1
    assert delta("bertdist_serve_request_duration_seconds_count", model="cls", route="predict") == 9
    # Only the 5 good requests reached the model: 5 items, in 5 batches (sent one at a time).
    assert delta("bertdist_serve_batch_size_sum", model="cls") == 5
    assert delta("bertdist_serve_batch_size_count", model="cls") == 5
    assert delta("bertdist_serve_queue_wait_seconds_count", model="cls") == 5
    assert delta("bertdist_serve_inference_duration_seconds_count", model="cls") == 5
    assert delta("bertdist_serve_requests_total", model="enc", route="embed", code="200") == 0


def test_two_apps_in_one_process_keep_their_own_metrics(model_dirs):
    from bertdist.serve.app import make_app
    from bertdist.serve.runtime import load_served_model

    a = make_app([load_served_model(model_dirs["cls"], name="cls")])
    b = make_app([load_served_model(model_dirs["cls"], name="cls")])
    a.state.serve.metrics.observe_request("cls", "predict", 200, 0.01)
    assert a.state.serve.metrics.requests.labels("cls", "predict", "200")._value.get() == 1
    assert b.state.serve.metrics.requests.labels("cls", "predict", "200")._value.get() == 0
    with pytest.raises(ValueError, match="two models are named 'cls'"):
        make_app([load_served_model(model_dirs["cls"], name="cls"), load_served_model(model_dirs["reg"], name="cls")])


def test_overload_gets_503_with_retry_after_and_long_texts_413(model_dirs, offline):
    srv = CliServer(str(model_dirs["cls"]), "--name", "cls", "--max-queue", "1", "--max-batch-size", "1",
                    "--max-wait-ms", "0", "--refuse-long")
    try:
        # The one model answers the plain route; over the limit is refused when asked to.
        body = {"inputs": text("plain", 6)}
        status, _, got = call(srv.port, "POST", "/predict", body)
        assert status == 200
        assert_same(got, offline.answer("cls", "predict", body), "/predict")
        status, _, got = call(srv.port, "POST", "/predict", {"inputs": text("long", 200)})
        assert status == 413 and "over the model's limit of 128" in got["error"], got
        # More items than the queue can ever hold: 413, not a 503 that retrying cannot cure.
        status, _, got = call(srv.port, "POST", "/predict", {"inputs": [text(f"three{i}", 3) for i in range(3)]})
        assert status == 413 and "queues at most 1" in got["error"], got

        results: dict = {}
        for burst in range(3):  # a burst almost always overloads a queue of one; retry if not
            n = 48
            conns = [http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30) for _ in range(n)]
            for c in conns:
                c.connect()
            barrier = threading.Barrier(n)

            def send(i: int) -> None:
                body = {"inputs": text(f"b{burst}-{i}", 30 + i // 2)}
                barrier.wait(30)
                results[burst, i] = (body, call(srv.port, "POST", "/predict", body, conn=conns[i]))

            threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for c in conns:
                c.close()
            assert len([k for k in results if k[0] == burst]) == n, "a request hung or was lost"
            if any(r[1][0] == 503 for r in results.values()):
                break
        statuses = [r[1][0] for r in results.values()]
        assert 503 in statuses, statuses
        assert set(statuses) <= {200, 503}, statuses
        for (body, (status, hdrs, got)) in results.values():
            if status == 503:
                assert int(hdrs["retry-after"]) >= 1 and got["error_type"] == "Overloaded", (hdrs, got)
                assert "overloaded" in got["error"]
            else:
                assert_same(got, offline.answer("cls", "predict", body), body["inputs"][:12])
        values = metric_values(srv.port)
        assert metric(values, "bertdist_serve_requests_total", model="cls", route="predict", code="503") == \
            statuses.count(503)
    finally:
        rc = srv.stop(signal.SIGINT)
    assert rc == 0, "".join(srv.output)
    assert "stopped by SIGINT" in "".join(srv.output)


def test_sigterm_answers_the_requests_in_flight_and_exits_0(model_dirs, offline):
    # A long batching wait holds the requests in the queue, so they are surely in flight when the
    # signal comes; the drain runs them at once.
    n = 12
    srv = CliServer(str(model_dirs["cls"]), "--name", "cls", "--max-batch-size", "64", "--max-wait-ms", "20000")
    results: dict = {}
    bodies = {i: {"inputs": text(f"t{i}", 5 + 3 * i)} for i in range(n)}

    def send(i: int) -> None:
        results[i] = call(srv.port, "POST", "/predict", bodies[i], timeout=60)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while metric(metric_values(srv.port), "bertdist_serve_requests_in_flight", model="cls") < n:
            assert time.monotonic() < deadline and not results, "the requests never all arrived"
            time.sleep(0.05)
        assert not results, "answered before the signal: the test proves nothing"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(15)
        stopped_in = time.monotonic() - t0
    finally:
        srv.kill()
        for t in threads:
            t.join(30)
    out = "".join(srv.output)
    assert rc == 0, out
    assert stopped_in < 10, f"took {stopped_in:.1f} s to stop"
    assert "stopped by SIGTERM" in out and f"{n} requests answered, 0 cut off" in out, out
    assert sorted(results) == list(range(n))
    for i, (status, _, got) in results.items():
        assert status == 200, got
        assert_same(got, offline.answer("cls", "predict", bodies[i]), f"request {i}")
    # The listening socket is closed: a new request is refused.
    with pytest.raises(OSError):
        call(srv.port, "GET", "/health", timeout=2)


def test_the_command_refuses_what_it_cannot_serve(tmp_path, model_dirs, capsys):
    from bertdist.cli.main import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["serve", str(tmp_path)]) == 2
    assert "not an exported ONNX model (no onnx_card.json)" in capsys.readouterr().err
    assert main(["serve", str(model_dirs["cls"]), str(model_dirs["reg"]), "--name", "one"]) == 2
    assert "1 --name for 2 directories" in capsys.readouterr().err
    assert main(["serve", str(model_dirs["cls"]), "--variant", "int8"]) == 2
    assert "variant 'int8' was not exported" in capsys.readouterr().err
    assert main(["serve", str(model_dirs["cls"]), "--max-batch-size", "0"]) == 2
    assert "--max-batch-size 0: must be at least 1" in capsys.readouterr().err
    assert main(["serve", str(model_dirs["cls"]), "--workers", "0"]) == 2
    assert "--workers 0: must be at least 1" in capsys.readouterr().err


def test_runs_at_once_default_to_the_cores_shared_among_the_models(monkeypatch, model_dirs, capsys):
    import os

    from bertdist.cli import serve
    from bertdist.cli.main import main

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert serve.default_workers(1, 1) == 8 and serve.default_workers(2, 1) == 4
    assert serve.default_workers(1, 3) == 2 and serve.default_workers(4, 3) == 1
    settings = []
    monkeypatch.setattr(serve, "_bind", lambda host, port: _listening_socket())
    monkeypatch.setattr(serve, "_serve", lambda app, sock, limits: settings.append(app) or sock.close() or 0)
    assert main(["serve", str(model_dirs["cls"]), "--threads", "2"]) == 0
    assert "4 runs at once of 2 threads" in capsys.readouterr().out
    assert main(["serve", str(model_dirs["cls"]), "--workers", "3"]) == 0
    assert "3 runs at once of 1 thread," in capsys.readouterr().out


def test_a_public_address_is_warned_about(monkeypatch, capsys, model_dirs):
    """Listening beyond localhost prints a warning (the socket and server are stand-ins here)."""
    from bertdist.cli import serve
    from bertdist.cli.main import main

    hosts = []
    monkeypatch.setattr(serve, "_bind", lambda host, port: hosts.append(host) or _listening_socket())
    monkeypatch.setattr(serve, "_serve", lambda app, sock, limits: sock.close() or 0)
    for host, warned in (("127.0.0.1", False), ("localhost", False), ("0.0.0.0", True), ("::", True)):
        assert main(["serve", str(model_dirs["cls"]), "--host", host]) == 0
        out = capsys.readouterr().out
        assert ("warning: listening on " + host + ", reachable from other machines" in out) == warned, out
        assert "classification, optimized ONNX, max length 128: POST /predict" in out and "serving on http://" in out
    assert hosts == ["127.0.0.1", "localhost", "0.0.0.0", "::"]


def test_small_bodies_are_prepared_on_the_loop_and_large_ones_on_the_preparing_thread(model_dirs):
    """A small body is parsed and tokenized where it was read (no hop to another thread and
    back); a larger one, whose work grows with it, goes to the preparing thread."""
    from bertdist.serve.app import ServeSettings, make_app
    from bertdist.serve.runtime import load_served_model

    state = make_app([load_served_model(model_dirs["cls"])], ServeSettings(inline_body_bytes=64)).state.serve
    where = []

    def note():
        where.append(threading.current_thread().name)
        return "ok"

    async def main():
        try:
            return [await state.prepare(note, b"x" * 64), await state.prepare(note, b"x" * 65)]
        finally:
            state.preparing.shutdown()

    assert asyncio.run(main()) == ["ok", "ok"]
    assert where[0] == threading.current_thread().name and where[1].startswith("serve-prepare"), where
