"""Handler metrics for TorchServe's backend metrics path (declared in config/metrics.yaml).

TorchServe's own emitter (`CachingMetric.add_or_update`) validates, builds Dimension objects and goes
through `logging` for every value: ~30 us a line on a 2-core VM, a batch of 64 requests emits ~75
lines. Here each metric's fixed part is formatted once, a batch's lines are collected, and all of them
reach the frontend in one write of the same `[METRICS]...` text TorchServe 0.12 would print.
"""
from __future__ import annotations

import logging
import socket
import sys
import time
from typing import Any, Sequence, TextIO

from ts.metrics.metric_type_enum import MetricTypes

log = logging.getLogger(__name__)
KINDS = {"counter": MetricTypes.COUNTER, "gauge": MetricTypes.GAUGE, "histogram": MetricTypes.HISTOGRAM}


def metric_line(metric: Any, value: float, dimension_values: Sequence[str], hostname: str, now: int) -> str:
    """The line TorchServe 0.12's CachingMetric.emit_metrics logs for one value (without a request id)."""
    if len(dimension_values) != len(metric.dimension_names):
        raise ValueError(f"metric {metric.metric_name} has dimensions {metric.dimension_names}, "
                         f"got values {list(dimension_values)}")
    if metric.metric_type == MetricTypes.COUNTER and value < 0:
        raise ValueError(f"counter {metric.metric_name} cannot decrease (got {value})")
    dims = ",".join(f"{n}:{v}" for n, v in zip(metric.dimension_names, dimension_values))
    return (f"[METRICS]{metric.metric_name}.{metric.unit}:{value}|#{dims}|"
            f"#type:{metric.metric_type.name}|#hostname:{hostname},{now}\n")


class HandlerMetrics:
    """Looks each metric up once; `emit` queues a value and `flush` writes the queued lines at once.

    Values emitted outside a batch (at load time) are written straight away.
    """

    def __init__(self, context: Any, model_name: str, stream: TextIO | None = None) -> None:
        self._cache = context.metrics
        self._model = model_name
        self._metrics: dict[str, Any] = {}
        self._stream = stream
        self._hostname = socket.gethostname()
        self._pending: list[str] = []
        self._batching = False

    def _get(self, name: str, kind: str, unit: str, extra_dims: Sequence[str]) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            try:
                metric = self._cache.get_metric(name, KINDS[kind])
            except Exception:  # not declared in the metrics config: declare it here
                metric = self._cache.add_metric_to_cache(name, unit, ["ModelName", *extra_dims], KINDS[kind])
            self._metrics[name] = metric
        return metric

    def emit(self, name: str, kind: str, value: float, unit: str = "Count", times: int = 1, **dims: str) -> None:
        """One value (`times` observations of it, for a histogram) of metric `name`."""
        try:
            line = metric_line(self._get(name, kind, unit, list(dims)), value, [self._model, *dims.values()],
                               self._hostname, int(time.time()))
        except Exception:  # metrics must never fail a request
            log.exception("could not emit metric %s", name)
            return
        self._pending.append(line * times)
        if not self._batching:
            self.flush()

    def begin_batch(self) -> None:
        self._batching = True

    def flush(self) -> None:
        """Writes the queued lines in one go (the worker's stdout is what TorchServe's frontend parses)."""
        self._batching = False
        if not self._pending:
            return
        text, self._pending = "".join(self._pending), []
        stream = self._stream or sys.stdout
        try:
            stream.write(text)
            stream.flush()
        except Exception:
            log.exception("could not write %d metric lines", text.count("\n"))


class NoMetrics:
    """Where a request's metrics go when it is not counted (the inference warm-up's chats)."""

    def emit(self, name: str, kind: str, value: float, unit: str = "Count", times: int = 1, **dims: str) -> None:
        pass


NO_METRICS = NoMetrics()


def emit_batch(metrics: HandlerMetrics, *, requests: int, texts: int, tokens: int, computed_tokens: int,
               batch_size: int, times: tuple[float, float, float, float], recompiles: int) -> None:
    """The per-batch metrics every encoder-style handler (embeddings, rerank/score/classify) emits.

    `texts` counts what the model ran on: texts for an embedding model, (query, document) pairs for a
    cross-encoder. `computed_tokens` is what the device computed, padding included. `times` are the
    batch's perf_counter stamps: received, preprocessed, inferred, answered.
    """
    t0, t1, t2, t3 = times
    padded = max(0, computed_tokens - tokens)
    metrics.emit("servekit_batches_total", "counter", 1)
    metrics.emit("servekit_requests_total", "counter", requests)
    metrics.emit("servekit_texts_total", "counter", texts)
    metrics.emit("servekit_tokens_total", "counter", tokens)
    metrics.emit("servekit_padded_tokens_total", "counter", padded)
    metrics.emit("servekit_padding_ratio", "histogram", padded / computed_tokens if computed_tokens else 0.0, "Ratio")
    metrics.emit("servekit_batch_fill_ratio", "histogram", min(1.0, requests / max(1, batch_size)), "Ratio")
    metrics.emit("servekit_preprocess_seconds", "histogram", t1 - t0, "Seconds")
    metrics.emit("servekit_inference_seconds", "histogram", t2 - t1, "Seconds")
    metrics.emit("servekit_postprocess_seconds", "histogram", t3 - t2, "Seconds")
    # Every request of the batch waited for the whole batch: one observation each.
    metrics.emit("servekit_request_latency_seconds", "histogram", t3 - t0, "Seconds", times=requests)
    metrics.emit("servekit_recompiles", "gauge", recompiles)
