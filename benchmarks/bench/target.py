"""The server under test: a local TorchServe started from config/, or a running one given by URLs.

Models are registered, scaled and unregistered through the management API, so the server runs
for the whole sweep: batch size and batch delay need a new registration, the worker count only
a scale call.
"""
from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from servekit.torchserve import ServerError, TorchServe, http_json, model_workers

from servekit.benchmarks.bench.schema import Target


@dataclass
class Registered:
    model: str
    mar: str
    batch_size: int
    max_batch_delay_ms: int
    workers: int


class Server:
    def __init__(self, target: Target, run_dir: Path, model_store: Path | None) -> None:
        self.target = target
        self.local: TorchServe | None = None
        if target.local is not None:
            self.local = TorchServe(run_dir / "torchserve", model_store, config=target.local.config,
                                    extra_props={"metrics_mode": "prometheus", **target.local.extra_props})
            self.inference_url = self.local.inference_url
            self.management_url = self.local.management_url
            self.metrics_url: str | None = self.local.metrics_url
        else:
            r = target.remote
            self.inference_url, self.management_url, self.metrics_url = r.inference_url, r.management_url, r.metrics_url
        self.model_store = model_store
        self.current: Registered | None = None

    def __enter__(self) -> "Server":
        if self.local is not None:
            (self.local.run_dir).mkdir(parents=True, exist_ok=True)
            self.local.start()
        else:
            try:
                status, _ = http_json("GET", f"{self.management_url}/models", 10)
            except OSError as e:
                raise ServerError(f"management API {self.management_url} unreachable: {e}") from None
            if status != 200:
                raise ServerError(f"management API {self.management_url}/models answered {status}")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.current is not None and not self.target.keep_models:
                self.unregister()
        except (ServerError, OSError):
            pass
        if self.local is not None:
            self.local.stop()

    def log_tail(self) -> str:
        return self.local.tail_log("model_log.log", 40) if self.local else ""

    def _check_alive(self) -> None:
        if self.local is not None and self.local.proc is not None and self.local.proc.poll() is not None:
            raise ServerError(f"TorchServe exited ({self.local.proc.returncode}):\n{self.local.tail_log()}")

    def wait_ready(self, model: str, workers: int, timeout: float) -> float:
        t0 = time.monotonic()
        while True:
            self._check_alive()
            ws = model_workers(self.management_url, model)
            if sum(w.get("status") == "READY" for w in ws) >= workers:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                states = ", ".join(sorted(w.get("status", "?") for w in ws)) or "no workers"
                raise ServerError(f"{model}: {workers} READY worker(s) not reached within {timeout:.0f}s "
                                  f"(workers: {states})\n{self.log_tail()}")
            time.sleep(0.25)

    def register(self, mar: str, model: str, batch_size: int, max_batch_delay_ms: int, workers: int) -> float:
        """(Re-)register `model`; returns seconds from the call until every worker was READY."""
        if self.current is not None:
            self.unregister()
        params = {"url": mar, "model_name": model, "batch_size": str(batch_size),
                  "max_batch_delay": str(max_batch_delay_ms), "initial_workers": str(workers), "synchronous": "false"}
        t0 = time.monotonic()
        status, body = http_json("POST", f"{self.management_url}/models?{urllib.parse.urlencode(params)}", 60)
        if status == 409:  # left over from an interrupted run
            self.current = Registered(model, mar, 0, 0, 0)
            self.unregister()
            status, body = http_json("POST", f"{self.management_url}/models?{urllib.parse.urlencode(params)}", 60)
        if status >= 300:
            raise ServerError(f"registering {mar} as {model} failed ({status}): {body}")
        self.current = Registered(model, mar, batch_size, max_batch_delay_ms, workers)
        self.wait_ready(model, workers, self.target.ready_timeout_s)
        self._check_settings(model, batch_size, max_batch_delay_ms)
        return time.monotonic() - t0

    def _check_settings(self, model: str, batch_size: int, delay: int) -> None:
        """TorchServe lets an archive's model-config override the register call: catch that."""
        status, body = http_json("GET", f"{self.management_url}/models/{urllib.parse.quote(model)}", 10)
        if status == 200 and isinstance(body, list) and body:
            got = (body[0].get("batchSize"), body[0].get("maxBatchDelay"))
            if got != (batch_size, delay):
                raise ServerError(f"{model}: asked for batch_size={batch_size}, max_batch_delay={delay} but the server "
                                  f"uses {got}; the archive's model-config sets batchSize/maxBatchDelay (remove them)")

    def scale(self, workers: int) -> float:
        assert self.current is not None
        model = self.current.model
        q = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers, "synchronous": "false"})
        t0 = time.monotonic()
        status, body = http_json("PUT", f"{self.management_url}/models/{urllib.parse.quote(model)}?{q}", 60)
        if status >= 300:
            raise ServerError(f"scaling {model} to {workers} workers failed ({status}): {body}")
        self.wait_ready(model, workers, self.target.ready_timeout_s)
        # Scaling down: wait until the extra workers are gone, so the point measures `workers`.
        deadline = time.monotonic() + 60
        while len(model_workers(self.management_url, model)) > workers and time.monotonic() < deadline:
            time.sleep(0.25)
        self.current.workers = workers
        return time.monotonic() - t0

    def unregister(self) -> None:
        if self.current is None:
            return
        model = self.current.model
        self.current = None
        status, body = http_json("DELETE", f"{self.management_url}/models/{urllib.parse.quote(model)}", 120)
        if status >= 300 and status != 404:
            raise ServerError(f"unregistering {model} failed ({status}): {body}")
        deadline = time.monotonic() + 60
        while model_workers(self.management_url, model) and time.monotonic() < deadline:
            time.sleep(0.25)
