"""Scaffolding for the tests' stand-ins of HTTP APIs that cannot run here (Grafana) or that a test
needs to script (TorchServe's management API in a given state): a threaded loopback server."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """Request handler base: quiet, with JSON (or text) replies and a JSON body reader."""

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def json_body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


class HttpDouble:
    """Serves `handler` on 127.0.0.1 (`port` 0: a free one) from a daemon thread until `close()`."""

    def __init__(self, handler: type[JsonHandler], port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
