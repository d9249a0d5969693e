"""A bounded load on `bertdist serve`: N keep-alive connections send `POST /predict` for a fixed time.

Every answer is checked against the label the offline model gave the same sentence (``--expected``,
written by benchmarks/serving.py). Prints one JSON object: throughput, p50/p99 latency, and the
counts of answered, wrong, shed (503) and failed requests, and of requests sent but never answered.
Asyncio with plain HTTP/1.1 on sockets, so the client costs little of the CPU it shares with the server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np


async def one_client(i: int, n: int, args, texts, labels, stats) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", args.port)
    k = i
    try:
        while time.perf_counter() < stats["deadline"]:
            j = k % len(texts)
            k += n
            body = json.dumps({"inputs": texts[j]}).encode()
            req = (f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            t0 = time.perf_counter()
            stats["sent"] += 1
            writer.write(req)
            await writer.drain()
            status, payload = await read_response(reader)
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
    except (ConnectionError, asyncio.IncompleteReadError):
        stats["errors"] += 1
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
    stats = {"sent": 0, "answered": 0, "wrong": 0, "shed": 0, "errors": 0, "lat": [],
             "deadline": time.perf_counter() + args.seconds}
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(i, args.clients, args, exp["texts"], exp["labels"], stats)
                           for i in range(args.clients)))
    wall = time.perf_counter() - t0
    lat = np.asarray(stats["lat"]) * 1000 if stats["lat"] else np.asarray([float("nan")])
    return {"throughput_rps": stats["answered"] / wall, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "sent": stats["sent"], "answered": stats["answered"],
            "wrong": stats["wrong"], "shed": stats["shed"], "errors": stats["errors"],
            "lost": stats["sent"] - stats["answered"] - stats["shed"] - stats["errors"], "seconds": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--expected", required=True)
    print(json.dumps(asyncio.run(run(p.parse_args()))))


if __name__ == "__main__":
    main()
