"""A bounded load on `bertdist serve`: N keep-alive connections send `POST /predict` for a fixed time.

With ``--hostile H``, H more connections send maximum-size bodies (just under the server's 1 MiB
limit) in turn: one text of a megabyte, 256 texts of 4 KiB (as many as the default queue takes),
and 1,000 texts of a kilobyte (more than it takes). Their answers are counted apart; the
latencies are the well-behaved clients' only.

Every answer is checked against the label the offline model gave the same sentence (``--expected``,
written by benchmarks/serving.py). Prints one JSON object: throughput, p50/p99 latency, and the
counts of answered, wrong, shed (503) and failed requests, and of requests sent but never answered.
Asyncio (uvloop where installed) with plain HTTP/1.1 on protocol-level connections and the requests
built once, so the client costs little of the CPU it shares with the server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


def predict_request(text: str) -> bytes:
    body = json.dumps({"inputs": text}).encode()
    return (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection answering one request at a time, parsed by hand: a
    protocol, not asyncio's streams, so that the client takes little of the CPU it shares."""

    def __init__(self):
        self.transport = None
        self.buffer = bytearray()
        self.answer: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.answer is None:
            return
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length")
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        answer, self.answer = self.answer, None
        answer.set_result((int(lines[0].split()[1]), body))

    def connection_lost(self, exc) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError("the server closed the connection"))

    async def request(self, data: bytes) -> tuple[int, bytes]:
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.answer


async def one_client(i: int, n: int, args, requests, labels, stats) -> None:
    _, conn = await asyncio.get_running_loop().create_connection(Connection, "127.0.0.1", args.port)
    k = i
    try:
        while time.perf_counter() < stats["deadline"]:
            j = k % len(requests)
            k += n
            t0 = time.perf_counter()
            stats["sent"] += 1
            status, payload = await conn.request(requests[j])
            dt = time.perf_counter() - t0
            if status == 200:
                stats["answered"] += 1
                stats["lat"].append(dt)
                if json.loads(payload)[0]["label"] != labels[j]:
                    stats["wrong"] += 1
            elif status == 503:
                stats["shed"] += 1
            else:
                stats["errors"] += 1
    except ConnectionError:
        stats["errors"] += 1
    finally:
        conn.transport.close()


def hostile_bodies(texts: list[str], limit: int = (1 << 20) - 4096) -> list[bytes]:
    """Bodies within the limits that cost a naive server the most: a megabyte of one text, and
    megabytes of many texts."""
    words = " ".join(texts).split()

    def text_of(chars: int, start: int) -> str:
        out, n, i = [], 0, start
        while n < chars:
            w = words[i % len(words)]
            out.append(w)
            n += len(w) + 1
            i += 1
        return " ".join(out)[:chars]

    bodies = [{"inputs": text_of(limit - 32, 0)},
              {"inputs": [text_of(4000, 97 * i) for i in range(256)]},
              {"inputs": [text_of(1000, 31 * i) for i in range(1000)]}]
    return [json.dumps(b).encode() for b in bodies]


async def one_hostile(i: int, bodies: list[bytes], args, stats) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
    k = i
    try:
        while time.perf_counter() < stats["deadline"]:
            body = bodies[k % len(bodies)]
            k += 1
            writer.write((f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
            await writer.drain()
            status, _ = await read_response(reader)
            stats["hostile"][str(status)] = stats["hostile"].get(str(status), 0) + 1
    except (ConnectionError, asyncio.IncompleteReadError):
        stats["hostile"]["dropped"] = stats["hostile"].get("dropped", 0) + 1
    finally:
        writer.close()


async def read_response(reader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(ln.split(":", 1)[1]) for ln in lines[1:] if ln.lower().startswith("content-length:"))
    return status, await reader.readexactly(length)


async def run(args) -> dict:
    exp = json.loads(open(args.expected).read())
    stats = {"sent": 0, "answered": 0, "wrong": 0, "shed": 0, "errors": 0, "lat": [], "hostile": {},
             "deadline": time.perf_counter() + args.seconds}
    bodies = hostile_bodies(exp["texts"]) if args.hostile else []
    t0 = time.perf_counter()
    requests = [predict_request(t) for t in exp["texts"]]  # built once: the client's CPU is the server's too
    await asyncio.gather(*(one_client(i, args.clients, args, requests, exp["labels"], stats)
                           for i in range(args.clients)),
                         *(one_hostile(i, bodies, args, stats) for i in range(args.hostile)))
    wall = time.perf_counter() - t0
    lat = np.asarray(stats["lat"]) * 1000 if stats["lat"] else np.asarray([float("nan")])
    return {"throughput_rps": stats["answered"] / wall, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "sent": stats["sent"], "answered": stats["answered"],
            "wrong": stats["wrong"], "shed": stats["shed"], "errors": stats["errors"],
            "lost": stats["sent"] - stats["answered"] - stats["shed"] - stats["errors"], "seconds": wall,
            "hostile": stats["hostile"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--expected", required=True)
    p.add_argument("--hostile", type=int, default=0, help="connections sending maximum-size bodies beside them")
    try:  # uvloop, as the server runs: less of the shared CPU goes to the client
        import uvloop
    except ImportError:
        uvloop = None
    args = p.parse_args()
    result = uvloop.run(run(args)) if uvloop is not None else asyncio.run(run(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
