"""The streaming gateway (servekit/gateway.py) against a real aiohttp upstream standing in for
TorchServe: streams that end well pass byte for byte and as they arrive; a stream whose connection
upstream resets gets one final SSE error event and a clean end; TorchServe's `ts_stream_next` never
reaches clients; JSON answers keep their status; an unreachable upstream is a 502 JSON error."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import requests
from aiohttp import web

from servekit import cli
from servekit.gateway import make_app

EVENTS = [f'data: {{"i": {i}, "text": "tok{i}"}}\n\n'.encode() for i in range(3)]
# What TorchServe 0.12 puts in the head of every response its worker sends in parts.
TS_HEADERS = {"ts_stream_next": "true"}


async def _sse_head(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={**TS_HEADERS, "Content-Type": "text/event-stream", "X-Upstream": "yes"})
    await resp.prepare(request)
    return resp


async def stream_ok(request: web.Request) -> web.StreamResponse:
    """Three events, a pause (to see whether the first ones arrive before the rest), then [DONE]."""
    resp = await _sse_head(request)
    for event in EVENTS:
        await resp.write(event)
    await asyncio.sleep(0.6)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def stream_abort(request: web.Request) -> web.StreamResponse:
    """Like a worker death in TorchServe 0.12: events, then the connection reset after the head.
    With ?partial=1 the reset comes in the middle of an event, with ?done=1 after `data: [DONE]`."""
    resp = await _sse_head(request)
    for event in EVENTS:
        await resp.write(event)
    if request.query.get("partial"):
        await resp.write(b'data: {"i": 3, "te')
    if request.query.get("done"):
        await resp.write(b"data: [DONE]\n\n")
    await asyncio.sleep(0.05)  # the bytes leave before the reset
    assert request.transport is not None
    request.transport.abort()
    return resp


async def stall(request: web.Request) -> web.StreamResponse:
    """One event, then silence longer than the slow gateway's read timeout (?head=1: before the head)."""
    if request.query.get("head"):
        await asyncio.sleep(1.5)
    resp = await _sse_head(request)
    await resp.write(EVENTS[0])
    await asyncio.sleep(1.5)
    await resp.write_eof()
    return resp


async def json_cut(request: web.Request) -> web.StreamResponse:
    """A chunked JSON body cut off by a reset."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    await resp.write(b'{"choices": [{"text": "half')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.abort()
    return resp


async def echo(request: web.Request) -> web.Response:
    """What reached upstream, answered with an unusual status and a header of its own."""
    seen = {"method": request.method, "path_qs": request.raw_path, "body": (await request.text()),
            "x_client": request.headers.get("X-Client"), "connection_named": request.headers.get("X-Hop"),
            "host": request.headers.get("Host")}
    return web.json_response(seen, status=422, headers={"X-Upstream": "yes"})


def upstream_app(disconnects: list[float]) -> web.Application:
    async def stream_forever(request: web.Request) -> web.StreamResponse:
        resp = await _sse_head(request)
        try:
            for i in range(400):
                await resp.write(f"data: {i}\n\n".encode())
                await asyncio.sleep(0.025)
        except ConnectionError:
            disconnects.append(time.monotonic())
        return resp

    app = web.Application()
    app.router.add_post("/stream-ok", stream_ok)
    app.router.add_post("/stream-abort", stream_abort)
    app.router.add_post("/v1/chat/completions", stream_abort)
    app.router.add_post("/stream-forever", stream_forever)
    app.router.add_get("/json-cut", json_cut)
    app.router.add_get("/stall", stall)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    return app


class Servers:
    """One asyncio loop in a thread, serving the upstream and gateways on free loopback ports."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def start(self, app: web.Application) -> str:
        async def go() -> str:
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            return "http://127.0.0.1:%d" % runner.addresses[0][1]
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[dict]:
    servers = Servers()
    disconnects: list[float] = []
    try:
        upstream = servers.start(upstream_app(disconnects))
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = "http://127.0.0.1:%d" % s.getsockname()[1]
        yield {"upstream": upstream, "gateway": servers.start(make_app(upstream)),
               "to_dead": servers.start(make_app(dead)), "slow": servers.start(make_app(upstream, read_timeout_s=0.4)),
               "disconnects": disconnects}
    finally:
        servers.close()


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def test_normal_stream_passes_byte_for_byte_as_it_arrives(stack):
    direct = requests.post(stack["upstream"] + "/stream-ok", json={}, timeout=10)
    start = time.monotonic()
    with requests.post(stack["gateway"] + "/stream-ok", json={}, stream=True, timeout=10) as r:
        chunks = r.iter_content(chunk_size=None)
        first = next(chunks)
        first_at = time.monotonic()
        body = first + b"".join(chunks)
        end_at = time.monotonic()
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/event-stream"
    assert body == direct.content and body.endswith(b"data: [DONE]\n\n")
    assert first.startswith(EVENTS[0])
    # The first events arrived before upstream had sent the rest (it pauses 0.6 s): not buffered.
    assert end_at - first_at > 0.4, (first_at - start, end_at - start)
    assert "ts_stream_next" in direct.headers  # what the gateway is there to drop
    assert "ts_stream_next" not in r.headers and r.headers["X-Upstream"] == "yes"
    assert r.headers["Transfer-Encoding"] == "chunked"


@pytest.mark.parametrize("partial", [False, True], ids=["between-events", "mid-event"])
def test_stream_reset_upstream_ends_with_an_error_event_and_a_clean_end(stack, partial):
    url = "/stream-abort" + ("?partial=1" if partial else "")
    with pytest.raises(requests.exceptions.ChunkedEncodingError):  # what a client sees without the gateway
        requests.post(stack["upstream"] + url, json={}, timeout=10).content
    r = requests.post(stack["gateway"] + url, json={}, timeout=10)  # no exception: the body ended properly
    assert r.status_code == 200 and "ts_stream_next" not in r.headers
    events = sse_events(r.content)
    # The cut event is dropped whole, so the error is an event of its own that parses.
    assert events[:3] == [e.rstrip(b"\n") for e in EVENTS] and len(events) == 4, r.content
    assert events[3].startswith(b"data: ")
    error = json.loads(events[3][len(b"data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] == "worker_died"
    assert "retry" in error["message"]
    assert b"[DONE]" not in r.content


def test_stream_reset_after_done_is_whole(stack):
    r = requests.post(stack["gateway"] + "/stream-abort?done=1", json={}, timeout=10)
    assert r.content == b"".join(EVENTS) + b"data: [DONE]\n\n"


def test_silent_upstream_is_a_timeout_error(stack):
    r = requests.get(stack["slow"] + "/stall", timeout=10)  # silent after its head: a final event
    events = sse_events(r.content)
    assert r.status_code == 200 and events[0] == EVENTS[0].rstrip(b"\n") and len(events) == 2, r.content
    assert json.loads(events[1][len(b"data: "):])["error"]["code"] == "upstream_timeout"
    r = requests.get(stack["slow"] + "/stall?head=1", timeout=10)  # silent before it: a status
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"


def test_openai_client_raises_the_error_event(stack):
    """What an OpenAI-client user sees: the events so far, then an APIError carrying the message
    (directly, the same cut is a bare "Connection error." from httpx's incomplete chunked read)."""
    import openai

    client = openai.OpenAI(base_url=stack["gateway"] + "/v1", api_key="unused", max_retries=0)
    got = []
    with pytest.raises(openai.APIError, match="worker stopped while generating") as e:
        for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    stream=True):
            got.append(chunk)
    assert len(got) == 3 and e.value.body["code"] == "worker_died"
    assert not isinstance(e.value, openai.APIConnectionError)
    direct = openai.OpenAI(base_url=stack["upstream"] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIConnectionError) as cut:
        for _ in direct.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True):
            pass
    assert "incomplete chunked read" in str(cut.value.__cause__), repr(cut.value.__cause__)


def test_client_disconnect_reaches_upstream(stack):
    """A client that goes away mid-stream closes the gateway's upstream connection, which is how
    TorchServe's handler learns to stop generating for it."""
    host, port = stack["gateway"].removeprefix("http://").split(":")
    before = len(stack["disconnects"])
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /stream-forever HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        got = b""
        while got.count(b"data: ") < 2:
            got += s.recv(65536)
    gone = time.monotonic()
    while len(stack["disconnects"]) == before:
        assert time.monotonic() - gone < 5, "upstream still streaming 5 s after the client left"
        time.sleep(0.05)


def test_json_passes_with_status_headers_method_path_and_body(stack):
    r = requests.put(stack["gateway"] + "/echo/v1/x%2Fy?b=1&a=%20", data=b'{"q": 1}',
                     headers={"X-Client": "c1", "Connection": "keep-alive, X-Hop", "X-Hop": "h"}, timeout=10)
    assert r.status_code == 422 and r.headers["X-Upstream"] == "yes"
    assert r.headers["Content-Type"].startswith("application/json") and "Content-Length" in r.headers
    seen = r.json()
    assert seen["method"] == "PUT" and seen["path_qs"] == "/echo/v1/x%2Fy?b=1&a=%20"
    assert seen["body"] == '{"q": 1}' and seen["x_client"] == "c1"
    assert seen["connection_named"] is None  # hop-by-hop by the client's own Connection header
    assert seen["host"] == stack["upstream"].removeprefix("http://")


def test_cut_json_body_is_not_passed_off_as_whole(stack):
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        requests.get(stack["gateway"] + "/json-cut", timeout=10).content


def test_upstream_down_is_a_502_json_error(stack):
    r = requests.post(stack["to_dead"] + "/predictions/m", json={}, timeout=10)
    assert r.status_code == 502 and r.headers["Content-Type"].startswith("application/json")
    error = r.json()["error"]
    assert error["code"] == "upstream_unreachable" and error["type"] == "server_error"


def test_bad_upstream_url_is_refused():
    with pytest.raises(ValueError, match="http"):
        make_app("127.0.0.1:8090")


def test_command_logs_one_line_serves_and_stops_on_sigterm(stack):
    proc = subprocess.Popen([sys.executable, "-m", "servekit.cli", "gateway", "--upstream", stack["upstream"],
                             "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+), forwarding to (\S+)", line)
        assert m and m.group(2) == stack["upstream"], line
        r = requests.post(m.group(1) + "/stream-ok", json={}, timeout=10)
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert proc.stderr.read() == "", "one line at start, nothing per request"
    finally:
        proc.kill()
        proc.wait()


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["gateway", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--upstream", "--host", "--port", "--read-timeout", "worker_died", "502"):
        assert option in out, option
