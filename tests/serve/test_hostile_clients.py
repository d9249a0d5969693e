"""`bertdist serve` against clients that stall, trickle, hoard connections, send huge heads or
leave: every one gets a JSON refusal or is dropped, others keep being answered, and a stop ends
within its grace period with an honest count."""
from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time

import pytest

from tests.serve.test_server import CliServer, Offline, ThreadServer, assert_same, call, metric, metric_values, text


@pytest.fixture(scope="module")
def cls_dir(onnx_model):
    return onnx_model("classification")


def raw_request(port: int, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the one response the server sends before closing."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, "the server closed the connection without a response"
    return int(head.split()[1]), json.loads(body)


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_sigterm_with_a_stalled_upload_exits_within_the_grace_period(cls_dir):
    srv = CliServer(str(cls_dir), "--name", "cls", "--grace", "4", "--body-timeout", "120")
    try:
        assert call(srv.port, "POST", "/predict", {"inputs": "fine"})[0] == 200
        stalled = raw_request(srv.port, post_head("/predict", 1000), b'{"inputs": "the start of')
        time.sleep(0.5)  # the stalled request reaches the app, which waits for its body
        start = time.monotonic()
        rc = srv.stop(timeout=15)
        took = time.monotonic() - start
        status, body = read_response(stalled)
    finally:
        srv.kill()
    assert rc == 0, "".join(srv.output)
    assert took < 4 + 1.5, f"exit took {took:.1f} s, grace 4 s"
    assert status == 503 and body["error_type"] == "Unhealthy", body
    assert "stopping, and this request's body was still arriving (24 of 1000 bytes arrived)" in body["error"], body
    last = srv.output[-1]
    assert "stopped by SIGTERM in" in last and "; 1 request answered, 1 cut off (their bodies were still" in last, \
        "".join(srv.output)
    assert "Traceback" not in "".join(srv.output)


def test_idle_sockets_beyond_the_descriptor_limit_leave_health_answering(cls_dir):
    def low_fd_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    proc = subprocess.Popen([sys.executable, "-m", "bertdist.cli.main", "serve", str(cls_dir), "--port", "0",
                             "--head-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=low_fd_limit)
    idle: list[socket.socket] = []
    try:
        port = _port_of(proc)
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.5)
        start = time.monotonic()
        status, _, body = call(port, "GET", "/health", timeout=10)
        assert status == 200 and body == {"status": "ok"}, body
        assert time.monotonic() - start < 5
        status, _, got = call(port, "POST", "/predict", {"inputs": "still answered"}, timeout=10)
        assert status == 200, got
        # The connections displaced to make room were the oldest idle ones: they are closed.
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out


def _port_of(proc) -> int:
    import re

    for line in proc.stdout:
        m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            deadline = time.monotonic() + 30
            while True:
                try:
                    if call(port, "GET", "/health", timeout=5)[0] == 200:
                        return port
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the server did not become healthy"
                time.sleep(0.05)
    raise AssertionError("bertdist serve did not start")


def test_heads_are_bounded_in_size_and_time_and_bodies_in_time(cls_dir):
    srv = CliServer(str(cls_dir), "--name", "cls", "--head-timeout", "1", "--body-timeout", "1")
    try:
        # A 32 MB header: refused once the head passes 64 KiB, before the rest is read.
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, chunk = 0, b"a" * (1 << 20)
        with pytest.raises(OSError):  # the server closes the connection long before 32 MB
            while sent < 32 << 20:
                sock.sendall(chunk)
                sent += len(chunk)
        assert sent < 32 << 20
        sock.close()
        sock = raw_request(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 << 10))
        status, body = read_response(sock)
        assert status == 431 and "head is over this server's limit of 65536 bytes" in body["error"], body
        # A head that trickles: 408 after the head timeout.
        sock = raw_request(srv.port, b"GET /hea")
        start = time.monotonic()
        status, body = read_response(sock)
        assert status == 408 and "head did not arrive within 1 s" in body["error"] and time.monotonic() - start < 5
        # A silent connection is closed.
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        assert sock.recv(1) == b""
        sock.close()
        # A body that stalls: 408, our JSON.
        sock = raw_request(srv.port, post_head("/predict", 100), b'{"inputs"')
        status, body = read_response(sock)
        assert status == 408 and "body did not arrive within 1 s (9 of 100 bytes arrived)" in body["error"], body
        # Meanwhile, and after, ordinary requests are answered.
        assert call(srv.port, "POST", "/predict", {"inputs": "fine"})[0] == 200
    finally:
        rc = srv.stop()
    assert rc == 0 and "Traceback" not in "".join(srv.output), "".join(srv.output)


@pytest.mark.parametrize("http", ["guarded", "h11"])
def test_a_disconnected_clients_queued_request_is_not_run(cls_dir, http):
    """Under our protocol the connection calls back; under another server a task waits for the
    ASGI disconnect message."""
    from bertdist.serve.app import ServeSettings
    from bertdist.serve.runtime import load_served_model

    # A long batching wait holds the request in the queue until its client has gone.
    server = ThreadServer([load_served_model(cls_dir, name="cls")], ServeSettings(max_batch_size=64, max_wait_ms=1500),
                          http=http)
    try:
        body = json.dumps({"inputs": text("leaving", 8)}).encode()
        sock = raw_request(server.port, post_head("/predict", len(body)), body)
        deadline = time.monotonic() + 10
        while metric(metric_values(server.port), "bertdist_serve_queue_depth", model="cls") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sock.close()
        while metric(metric_values(server.port), "bertdist_serve_queue_depth", model="cls") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(1.7)  # past the batching wait: had it stayed queued, it would have run
        values = metric_values(server.port)
        assert metric(values, "bertdist_serve_batch_size_count", model="cls") == 0
        assert metric(values, "bertdist_serve_abandoned_items_total", model="cls") == 1
        assert metric(values, "bertdist_serve_requests_total", model="cls", route="predict", code="499") == 1
        assert metric(values, "bertdist_serve_requests_total", model="cls", route="predict", code="200") == 0
        # The server goes on answering.
        offline = Offline({"cls": cls_dir})
        good = {"inputs": text("staying", 5)}
        status, _, got = call(server.port, "POST", "/predict", good)
        assert status == 200
        assert_same(got, offline.answer("cls", "predict", good), "after an abandoned request")
    finally:
        server.stop()


def test_bad_unicode_gets_422_without_a_traceback(cls_dir, caplog):
    from bertdist.serve.app import ServeSettings
    from bertdist.serve.runtime import load_served_model

    server = ThreadServer([load_served_model(cls_dir, name="cls")], ServeSettings())
    try:
        status, _, got = call(server.port, "POST", "/predict", raw=b'{"inputs": "\\ud800 hello"}')
        assert status == 422 and "not valid Unicode: a lone surrogate '\\ud800' at character 0" in got["error"], got
    finally:
        server.stop()
    assert "Traceback" not in caplog.text


def test_answers_not_ready_when_the_grace_period_ends_are_cut_off_with_json(cls_dir):
    """A stop whose grace period ends while a batch still runs: its request gets our 503, is
    counted as cut off, and the stop does not wait for the batch."""
    import asyncio

    from starlette.requests import Request

    from bertdist.serve.app import ServeSettings, make_app
    from bertdist.serve.runtime import load_served_model

    class Slow:
        def __init__(self, model):
            self.model = model

        def __getattr__(self, name):
            return getattr(self.model, name)

        def run(self, items):
            time.sleep(2.5)
            return self.model.run(items)

    app = make_app([Slow(load_served_model(cls_dir, name="cls"))], ServeSettings(grace_seconds=1.0))
    state = app.state.serve
    body = json.dumps({"inputs": "a slow one"}).encode()

    async def main():
        for b in state.batchers.values():
            await b.start()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # the client stays

        scope = {"type": "http", "method": "POST", "path": "/predict", "headers": [(b"content-length",
                                                                                    str(len(body)).encode())]}
        answer = asyncio.ensure_future(state.answer(Request(scope, receive), "predict", None))
        while not state.batchers["cls"].in_flight:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        state.begin_stop()
        response = await answer
        took = time.monotonic() - start
        await asyncio.gather(*(b.drain() for b in state.batchers.values()))
        return response, took

    response, took = asyncio.run(main())
    assert response.status_code == 503 and took < 1.0, (response.status_code, took)
    got = json.loads(response.body)
    assert got["error_type"] == "Unhealthy" and "grace period of 1 s ended before this answer was ready" in got["error"]
    assert (state.answered, state.cut_off) == (0, 1)
