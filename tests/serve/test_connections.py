"""The connection's transport wrapper: a turn's writes leave as one, in order, and nothing written
is lost to a close."""
from __future__ import annotations

import asyncio

from bertdist.serve.connections import CoalescingTransport


class FakeTransport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name):
        return ("127.0.0.1", 1) if name == "peername" else None


def test_writes_of_one_turn_leave_as_one_in_order():
    async def main():
        raw = FakeTransport()
        t = CoalescingTransport(raw, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        t.write(b"{}")
        assert raw.writes == []  # not yet: the turn is not over
        await asyncio.sleep(0)
        first = list(raw.writes)
        t.write(b"next")
        await asyncio.sleep(0)
        return first, raw.writes, t

    first, writes, t = asyncio.run(main())
    assert first == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    assert writes == first + [b"next"]
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)  # everything else is the transport's


def test_close_sends_what_was_written_first():
    async def main():
        raw = FakeTransport()
        t = CoalescingTransport(raw, asyncio.get_running_loop())
        t.write(b"refused")
        t.close()
        await asyncio.sleep(0)  # the scheduled flush finds nothing left and writes nothing
        return raw

    raw = asyncio.run(main())
    assert raw.writes == [b"refused"] and raw.closed
