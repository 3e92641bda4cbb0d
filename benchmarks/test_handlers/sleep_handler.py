"""TorchServe handler that sleeps for a known random time per batch and returns what it slept.

Used to check the auto-benchmark against known answers: with one worker, batch size 1 and a
sleep drawn from N(mean, sd), the service time distribution is known, so the harness must
recover its percentiles under light load and the capacity (1000 / mean requests/s) under load.

The `sleep:` section of the model-config sets the distribution:
    sleep: {mean_ms: 20, sd_ms: 2, per_item_ms: 0, seed: 0}
A batch of n requests sleeps mean + sd * z + per_item_ms * (n - 1) (never below 0), so batching
raises throughput when per_item_ms < mean_ms. A request body {"sleep_ms": x} overrides the draw
for a batch holding it (the largest such value wins).
"""
from __future__ import annotations

import json
import random
import time
from typing import Any


class SleepHandler:
    def initialize(self, context: Any) -> None:
        cfg = (getattr(context, "model_yaml_config", None) or {}).get("sleep", {}) or {}
        self.mean_s = float(cfg.get("mean_ms", 20.0)) / 1000.0
        self.sd_s = float(cfg.get("sd_ms", 0.0)) / 1000.0
        self.per_item_s = float(cfg.get("per_item_ms", 0.0)) / 1000.0
        self.rng = random.Random(cfg.get("seed", 0))

    @staticmethod
    def _override(row: dict[str, Any]) -> float | None:
        body = row.get("body", row.get("data"))
        if isinstance(body, (bytes, bytearray)):
            try:
                body = json.loads(bytes(body))
            except ValueError:
                return None
        if isinstance(body, dict) and isinstance(body.get("sleep_ms"), (int, float)):
            return float(body["sleep_ms"]) / 1000.0
        return None

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        overrides = [s for s in (self._override(r) for r in data) if s is not None]
        if overrides:
            seconds = max(overrides)
        else:
            seconds = self.mean_s + self.sd_s * self.rng.gauss(0.0, 1.0) + self.per_item_s * (len(data) - 1)
        seconds = max(0.0, seconds)
        time.sleep(seconds)
        answer = json.dumps({"slept_ms": seconds * 1000.0, "batch": len(data)})
        return [answer] * len(data)


_handler = SleepHandler()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    if not getattr(_handler, "rng", None):
        _handler.initialize(context)
    if data is None:
        return None
    return _handler.handle(data, context)
