"""Connection limits uvicorn does not have: a deadline for a request's head, a bound on its size,
and room for new connections when idle ones would use up the process's file descriptors.

uvicorn times out a keep-alive connection only after a response; a connection that opens and
sends nothing, or trickles its headers, would be held forever, and enough of them exhaust the
descriptors so that no request (``/health`` included) is accepted. Here:

* a connection waiting for a request's head (new, or between keep-alive requests) has
  ``head_timeout`` seconds to deliver it: silent ones are closed, partial ones get 408;
* a head over ``max_head_bytes`` gets 431;
* past ``max_connections`` the oldest connection that has not sent a byte of its request is
  closed to make room, and a new one with no such connection to displace gets 503.

Every refusal is a JSON body of the server's error shape, with ``Connection: close``.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import resource

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)
# The ASGI scope extension through which a request's handler learns that its client has gone:
# ``scope["extensions"][ON_DISCONNECT](callback)`` (None to stop watching).
ON_DISCONNECT = "bertdist.on_disconnect"
# File descriptors kept free of connections: model files, the listening socket, log and pipe ends.
RESERVED_FDS = 64


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    head_timeout: float = 10.0
    max_head_bytes: int = 64 << 10
    max_connections: int | None = None  # None: the descriptor limit less RESERVED_FDS

    def connection_cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        by_fds = max(1, soft - RESERVED_FDS) if soft != resource.RLIM_INFINITY else 1 << 20
        return min(self.max_connections, by_fds) if self.max_connections else by_fds


def refusal(status: int, message: str, error_type: str) -> bytes:
    body = json.dumps({"error": message, "error_type": error_type}).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: ", str(len(body)).encode(), b"\r\n", b"connection: close\r\n\r\n", body])


class CoalescingTransport:
    """A connection's transport whose writes in one turn of the loop go out as one: uvicorn writes
    a response's head and its body separately, and each write to a socket is a system call (and,
    on loopback, a wake-up of the reader), which under load costs more than building the answer."""

    __slots__ = ("_transport", "_loop", "_pending")

    def __init__(self, transport, loop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def guarded_protocol(limits: ConnectionLimits) -> type:
    """An httptools protocol class (uvicorn's ``http=``) enforcing ``limits``."""
    cap = limits.connection_cap()
    waiting: collections.OrderedDict = collections.OrderedDict()  # connections with no byte of a request yet

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(CoalescingTransport(transport, self.loop))
            self._head_timer = None
            self._on_lost = None  # the answering request's callback, should the client go
            if len(self.connections) > cap and not self._displace_one():
                self._refuse(503, f"the server holds its limit of {cap} connections; retry later", "Overloaded")
                return
            self._await_head()

        def _displace_one(self) -> bool:
            for other in waiting:
                if other is not self:
                    other._close_idle()
                    return True
            return False

        def _await_head(self) -> None:
            self._head_bytes = 0
            waiting[self] = None
            self._cancel_timer()
            self._head_timer = self.loop.call_later(limits.head_timeout, self._head_timed_out)

        def _cancel_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _close_idle(self) -> None:
            waiting.pop(self, None)
            self._cancel_timer()
            if not self.transport.is_closing():
                self.transport.close()

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._head_bytes == 0:
                self._close_idle()
            else:
                self._refuse(408, f"the request's head did not arrive within {limits.head_timeout:g} s", "Validation")

        def _refuse(self, status: int, message: str, error_type: str) -> None:
            waiting.pop(self, None)
            self._cancel_timer()
            if not self.transport.is_closing():
                self.transport.write(refusal(status, message, error_type))
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["extensions"] = {ON_DISCONNECT: self._watch}

        def _watch(self, callback) -> None:
            self._on_lost = callback

        def data_received(self, data: bytes) -> None:
            reading_head = self._head_timer is not None
            if reading_head:
                waiting.pop(self, None)
                self._head_bytes += len(data)
            super().data_received(data)
            # The head is still incomplete after this chunk (a body in the same chunk does not count).
            if reading_head and self._head_timer is not None and self._head_bytes > limits.max_head_bytes:
                self._refuse(431, f"the request's head is over this server's limit of {limits.max_head_bytes} "
                                  f"bytes", "Validation")

        def on_headers_complete(self) -> None:
            self._cancel_timer()
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > limits.max_head_bytes:  # a large head that arrived in one chunk
                self._refuse(431, f"the request's head is {size} bytes, over this server's limit of "
                                  f"{limits.max_head_bytes} bytes", "Validation")
                return
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._await_head()

        def connection_lost(self, exc) -> None:
            waiting.pop(self, None)
            self._cancel_timer()
            super().connection_lost(exc)
            lost, self._on_lost = self._on_lost, None
            if lost is not None:
                lost()

    return GuardedProtocol
