"""The server under test: a local TorchServe started from config/, or a running one given by URLs.

Models are registered, scaled and unregistered through the management API, so the server runs
for the whole sweep: batch size and batch delay need a new registration, the worker count only
a scale call.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servekit.benchmarks.bench.schema import Target
from servekit.torchserve import ManagementClient, Registration, ServerError, TorchServe


@dataclass
class Registered:
    model: str
    mar: str
    batch_size: int
    max_batch_delay_ms: int
    workers: int


class Server:
    """The sweep's server: a local TorchServe or a remote one, and the model registered now."""

    def __init__(self, target: Target, run_dir: Path, model_store: Path | None) -> None:
        self.target = target
        self.local: TorchServe | None = None
        if target.local is not None:
            # The model API stays on: batch size and delay are read at registration only, so every
            # point of the sweep is a registration. What it registers is confined to archive names
            # of the sweep's own store (`output_dir/model_store`, ManagementClient.register).
            self.local = TorchServe(run_dir / "torchserve", model_store, config=target.local.config,
                                    extra_props={"metrics_mode": "prometheus", **target.local.extra_props},
                                    model_api=True)
            self.inference_url = self.local.inference_url
            self.metrics_url: str | None = self.local.metrics_url
            self.api = self.local.api
        else:
            r = target.remote
            self.inference_url, self.metrics_url = r.inference_url, r.metrics_url
            self.api = ManagementClient(r.management_url)
        self.model_store = model_store
        self.current: Registered | None = None

    def __enter__(self) -> "Server":
        if self.local is not None:
            self.local.run_dir.mkdir(parents=True, exist_ok=True)
            self.local.start()
        else:
            self.api.wait_reachable(10)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.current is not None and not self.target.keep_models:
                self.unregister()
        except (ServerError, OSError):
            pass
        if self.local is not None:
            self.local.stop()

    def register(self, mar: str, model: str, batch_size: int, max_batch_delay_ms: int, workers: int) -> float:
        """(Re-)register `model`; returns seconds from the call until every worker was READY. A model
        of that name left over from an interrupted run is replaced."""
        if self.current is not None:
            self.unregister()
        reg = Registration(mar, model, workers, batch_size, max_batch_delay_ms)
        self.current = Registered(model, mar, batch_size, max_batch_delay_ms, workers)
        return self.api.register(reg, if_exists="replace", timeout=self.target.ready_timeout_s)

    def scale(self, workers: int) -> float:
        assert self.current is not None
        took = self.api.scale(self.current.model, workers, timeout=self.target.ready_timeout_s)
        self.current.workers = workers
        return took

    def unregister(self) -> None:
        if self.current is None:
            return
        model, self.current = self.current.model, None
        self.api.unregister(model)
