"""Streaming reverse proxy in front of TorchServe's inference port.

    servekit gateway --upstream http://127.0.0.1:8090 --host 0.0.0.0 --port 8080

Why it exists: when a worker dies under continuous batching, TorchServe 0.12's frontend has already
sent a streamed request its `200` head, so all it can do is reset the connection: the client gets
no terminating chunk and no error event (docs/reliability.md, "Worker death"), and every head the
worker sent in parts carries TorchServe's internal `ts_stream_next` header. TorchServe gets no fix,
so this proxy, which owns the client's connection, turns such an abnormal end of an upstream
`text/event-stream` into one final SSE error event and a properly ended chunked response, and drops
`ts_stream_next`. Everything else passes through unchanged, chunk by chunk as it arrives.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy
from yarl import URL

from servekit.handlers.common import error_json

log = logging.getLogger("servekit.gateway")

# TorchServe's max_request_size in config/ and k8s/ (64 MiB): bodies up to it reach the handlers,
# whose own limits answer with a JSON 413; the gateway refuses only what TorchServe would refuse.
MAX_BODY = 64 * 1024 * 1024
# A non-streamed LLM request is answered only once finished (the handler holds its head back), and a
# request may wait in TorchServe's queue first: a read timeout must outlast both, so it is minutes.
READ_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 5.0
# Above TorchServe's job_queue_size (1000): the queue, not the pool, is where requests wait.
MAX_CONNECTIONS = 1024
# Connection-level headers (RFC 9110 7.6.1) are the proxy's own on each side; Host and the body's
# length are set again by the client library for the upstream request.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"})
REQUEST_DROPPED = HOP_BY_HOP | {"host", "content-length", "expect"}
# ts_stream_next is TorchServe's worker-to-frontend flag that leaks into every head sent in parts.
RESPONSE_DROPPED = HOP_BY_HOP | {"ts_stream_next"}
# An SSE event ends at a blank line; servekit's handlers write "\n\n", the spec allows all three.
EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
DONE_EVENT = b"data: [DONE]"
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)
READ_TIMEOUT = web.AppKey("read_timeout", float)


def error_response(status: int, message: str, code: str, type_: str = "server_error") -> web.Response:
    """The handlers' OpenAI-style error body (message bounded), so clients parse one shape."""
    return web.Response(status=status, text=error_json(status, type_, message, code), content_type="application/json")


def _dropped(headers: CIMultiDictProxy[str], always: frozenset[str]) -> frozenset[str]:
    """Header names not to forward: `always`, plus those the Connection header names as hop-by-hop."""
    return always | {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}


def _event_end(buffer: bytes) -> int:
    """Length of the longest prefix of `buffer` made of whole SSE events (0 when none is whole)."""
    return max((i + len(end) for end in EVENT_ENDS if (i := buffer.rfind(end)) >= 0), default=0)


async def _sse_chunks(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream body as whole events, each yielded as soon as its blank line arrives. A partial
    event is held until it is whole, so that after an abnormal end the error event never lands in
    the middle of a cut one (a client would parse the two as one broken event)."""
    pending = b""
    async for chunk in _chunks(upstream):
        pending += chunk
        if cut := _event_end(pending):
            yield pending[:cut]
            pending = pending[cut:]
    if pending:  # a normal end without a final blank line: pass the bytes on as they are
        yield pending


async def _chunks(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    while chunk := await upstream.content.readany():
        yield chunk


class UpstreamBroke(Exception):
    """The upstream body ended abnormally (reset, incomplete chunked body, read timeout)."""

    def __init__(self, reason: str, after_done: bool) -> None:
        super().__init__(reason)
        self.after_done = after_done  # the stream had sent `data: [DONE]`: the answer is whole


async def _relay(upstream: aiohttp.ClientResponse, resp: web.StreamResponse, sse: bool) -> None:
    """Copy the upstream body to `resp`. Raises UpstreamBroke for an upstream failure and
    ConnectionError when the client has gone: read and write errors are told apart here because
    aiohttp's write errors are ClientErrors too."""
    source = _sse_chunks(upstream) if sse else _chunks(upstream)
    last = b""
    while True:
        try:
            chunk = await anext(source)
        except StopAsyncIteration:
            return
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise UpstreamBroke(str(e) or type(e).__name__, last.rstrip().endswith(DONE_EVENT)) from e
        await resp.write(chunk)
        last = chunk


async def proxy(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION]
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body over {MAX_BODY} bytes", "request_too_large",
                              "invalid_request_error")
    dropped = _dropped(request.headers, REQUEST_DROPPED)
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in dropped]
    # raw_path is the path and query exactly as the client sent them: nothing is decoded or re-encoded.
    url = URL(request.app[UPSTREAM] + request.raw_path, encoded=True)
    try:
        upstream = await session.request(request.method, url, headers=headers, data=body or None,
                                         allow_redirects=False)
    except aiohttp.ClientConnectorError as e:
        return error_response(502, f"TorchServe is unreachable: {e}", "upstream_unreachable")
    except asyncio.TimeoutError:
        return error_response(504, "TorchServe did not answer within the gateway's timeouts",
                              "upstream_timeout")
    except aiohttp.ClientError as e:  # connected, then closed or garbled before a head came
        return error_response(502, f"TorchServe closed the connection before answering: {e}",
                              "upstream_disconnected")
    sse = upstream.content_type == "text/event-stream"
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    # A stream is sent chunked whatever upstream declared: it may get one event more than upstream sent.
    dropped = _dropped(upstream.headers, RESPONSE_DROPPED | ({"content-length"} if sse else set()))
    for k, v in upstream.headers.items():
        if k.lower() not in dropped:
            resp.headers.add(k, v)
    try:
        await resp.prepare(request)
        try:
            await _relay(upstream, resp, sse)
        except UpstreamBroke as e:
            if not sse:
                # Nothing can be added to a body already begun: cut the client's connection too, so
                # that a truncated body never ends like a whole one.
                log.warning("%s %s: upstream body cut short (%s); closing the client connection",
                            request.method, request.path, e)
                assert request.transport is not None
                request.transport.abort()
                return resp
            if not e.after_done:
                timed_out = isinstance(e.__cause__, asyncio.TimeoutError)
                code = "upstream_timeout" if timed_out else "worker_died"
                log.warning("%s %s: upstream stream cut short (%s); sent a final %s event",
                            request.method, request.path, e, code)
                message = (f"TorchServe sent nothing for {request.app[READ_TIMEOUT]:g} s" if timed_out else
                           "the model worker stopped while generating (TorchServe closed the stream)")
                event = error_json(502, "server_error", message + "; the answer is incomplete: retry the request", code)
                await resp.write(f"data: {event}\n\n".encode())
        await resp.write_eof()
        return resp
    except ConnectionError:
        # The client went away: closing the upstream connection is what tells TorchServe (and the
        # handler, at its next step) to stop generating for it. aiohttp ends the exchange quietly
        # when its own write_eof then fails too.
        upstream.close()
        return resp
    finally:
        upstream.release()


def make_app(upstream: str, read_timeout_s: float = READ_TIMEOUT_S) -> web.Application:
    """The gateway as an aiohttp application forwarding every path to `upstream`
    (TorchServe's inference URL, e.g. http://127.0.0.1:8090)."""
    base = URL(upstream)
    if base.scheme not in ("http", "https") or not base.host or base.query_string:
        raise ValueError(f"--upstream must be an http(s) URL without a query, got {upstream!r}")
    app = web.Application(client_max_size=MAX_BODY)
    app[UPSTREAM] = upstream.rstrip("/")
    app[READ_TIMEOUT] = read_timeout_s

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s)
        # Bytes pass through as TorchServe sent them (no decompression), and no header the client
        # did not send is invented for it (aiohttp would add Accept, Accept-Encoding, User-Agent and
        # a Content-Type for the body).
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                         skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent",
                                                            "Content-Type")) as session:
            app[SESSION] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serve `app` until SIGTERM or SIGINT. In-flight requests then get up to 60 s to finish
    (aiohttp's graceful stop), within the pod's termination grace period."""
    # No access log: TorchServe writes one line per request already.
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=60.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound = ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses)
        log.info("servekit gateway listening on %s, forwarding to %s", bound, app[UPSTREAM])
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="servekit gateway",
        description="Streaming reverse proxy in front of TorchServe's inference port. Forwards every "
                    "request as it is and streams answers back as they arrive; when TorchServe cuts a "
                    "server-sent-event stream (a worker died mid-generation), ends it with a final "
                    "`data: {\"error\": {..., \"code\": \"worker_died\"}}` event instead of a reset; "
                    "answers 502/504 JSON when TorchServe is unreachable or silent; drops TorchServe's "
                    "internal ts_stream_next header. docs/reliability.md explains what clients see.")
    parser.add_argument("--upstream", required=True,
                        help="TorchServe inference URL, e.g. http://127.0.0.1:8090 (its inference_address)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=8000,
                        help="port to listen on (default 8000, beside a local TorchServe's 8080; 0 picks a free one)")
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S,
                        help=f"seconds TorchServe may stay silent, before its head or between chunks "
                             f"(default {READ_TIMEOUT_S:g}); past it: 504 JSON or a final error event")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        app = make_app(args.upstream, args.read_timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(app, args.host, args.port))
    except OSError as e:  # e.g. the port is taken
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
