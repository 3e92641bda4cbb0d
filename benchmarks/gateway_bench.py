"""What `servekit gateway` costs: server-sent events per second and per-request latency through the
gateway against the same local SSE upstream read directly.

    python -m servekit.benchmarks.gateway_bench --out gateway-bench.json

The upstream (its own process) streams small events, one write each, as TorchServe's LLM handler
sends tokens; the gateway runs as the command a pod runs (its own process); the client (this
process) reads whole streams. Events/s: `--streams` concurrent streams of `--events` events each,
the median of `--rounds` rounds. Latency: sequential one-event streams, median and p99 in ms.
Events/s is bounded by whichever process is busiest (on few cores, often the client; the gateway
can even raise it, by passing several small events on as one chunk), so the gateway's own CPU time
per event and per request is reported too: that is what it adds to a pod. The paced measurement
(`--paced-streams` streams, an event every `--pace-ms` each, as a server decoding that many
sequences sends tokens) gives every event a read and a write of its own, the case of a real server.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
from aiohttp import web

from servekit.benchmarks.host import cpu_model

EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": " token"}}], "object": "chat.completion.chunk"}\n\n'


def _upstream(port_out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pace = float(request.query.get("pace_ms", 0)) / 1000
        for _ in range(int(request.query["n"])):
            await resp.write(EVENT)
            if pace:
                await asyncio.sleep(pace)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/sse", sse)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port_out.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def start_gateway(upstream: str) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    proc = subprocess.Popen([sys.executable, "-m", "servekit.gateway", "--upstream", upstream, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()  # type: ignore[union-attr]
    m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"the gateway did not start: {line!r}")
    return proc, m.group(1)


async def read_stream(session: aiohttp.ClientSession, url: str) -> int:
    """Events of one whole stream (a stream that does not end with [DONE] is an error)."""
    body = b""
    async with session.get(url) as r:
        async for chunk in r.content.iter_any():
            body += chunk
    if not body.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"{url}: stream ended without [DONE]")
    return body.count(b"\n\n") - 1


async def events_per_s(base: str, events: int, streams: int, rounds: int, pace_ms: float) -> float:
    rates = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as session:
        await read_stream(session, f"{base}/sse?n=10")  # warm-up: connections, first-request paths
        url = f"{base}/sse?n={events}&pace_ms={pace_ms}"
        for _ in range(rounds):
            start = time.perf_counter()
            counts = await asyncio.gather(*(read_stream(session, url) for _ in range(streams)))
            rates.append(sum(counts) / (time.perf_counter() - start))
    return statistics.median(rates)


async def latency_ms(base: str, requests: int) -> dict[str, float]:
    times = []
    async with aiohttp.ClientSession() as session:
        await read_stream(session, f"{base}/sse?n=1")
        for _ in range(requests):
            start = time.perf_counter()
            await read_stream(session, f"{base}/sse?n=1")
            times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"median": round(statistics.median(times), 3), "p99": round(times[int(0.99 * (len(times) - 1))], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servekit.benchmarks.gateway_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5000, help="events per stream (default 5000)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16],
                        help="concurrent streams, one measurement each (default 1 16)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement, median kept (default 3)")
    parser.add_argument("--paced-streams", type=int, default=32, help="streams of the paced measurement (default 32)")
    parser.add_argument("--pace-ms", type=float, default=5.0,
                        help="ms between the events of a paced stream (default 5: 200 tokens/s a stream)")
    parser.add_argument("--requests", type=int, default=200, help="sequential one-event streams for latency")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)

    ports: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    upstream_proc = multiprocessing.Process(target=_upstream, args=(ports,), daemon=True)
    upstream_proc.start()
    upstream = f"http://127.0.0.1:{ports.get(timeout=30)}"
    gateway, via = start_gateway(upstream)
    try:
        result: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "command": shlex.join(["python", "-m", "servekit.benchmarks.gateway_bench", *(argv or sys.argv[1:])]),
                        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                                    # Other work on the machine shows in every figure: recorded with them.
                                    "load_average_1m": round(os.getloadavg()[0], 2),
                                    "python": platform.python_version(), "aiohttp": aiohttp.__version__},
                        "event_bytes": len(EVENT), "events_per_s": [], "latency_ms": {}}
        gw = psutil.Process(gateway.pid)
        runs = [(streams, args.events, 0.0) for streams in args.streams]
        runs.append((args.paced_streams, max(1, int(2000 / args.pace_ms)), args.pace_ms))  # ~2 s a round
        for streams, events, pace_ms in runs:
            row: dict[str, float] = {"streams": streams, "events": events, "pace_ms": pace_ms,
                                     "direct": round(asyncio.run(events_per_s(upstream, events, streams,
                                                                              args.rounds, pace_ms)))}
            before = cpu_s(gw)
            row["gateway"] = round(asyncio.run(events_per_s(via, events, streams, args.rounds, pace_ms)))
            row["gateway_cpu_us_per_event"] = round((cpu_s(gw) - before) * 1e6
                                                    / (events * streams * args.rounds + 10), 2)
            result["events_per_s"].append(row)
            print(f"{streams:>3} streams{f', an event every {pace_ms:g} ms' if pace_ms else ''}: direct "
                  f"{row['direct']:>9,} events/s, gateway {row['gateway']:>9,} events/s; "
                  f"gateway CPU {row['gateway_cpu_us_per_event']} us/event")
        result["latency_ms"]["direct"] = asyncio.run(latency_ms(upstream, args.requests))
        before = cpu_s(gw)
        result["latency_ms"]["gateway"] = asyncio.run(latency_ms(via, args.requests))
        result["gateway_cpu_us_per_request"] = round((cpu_s(gw) - before) * 1e6 / (args.requests + 1), 1)
        print(f"one-event stream: direct {result['latency_ms']['direct']['median']} ms, "
              f"gateway {result['latency_ms']['gateway']['median']} ms (medians of {args.requests}); "
              f"gateway CPU {result['gateway_cpu_us_per_request']} us/request")
    finally:
        gateway.terminate()
        gateway.wait(30)
        upstream_proc.terminate()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
