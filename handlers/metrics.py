"""Thin wrapper over TorchServe's backend metrics cache (declared in config/metrics.yaml)."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from ts.metrics.metric_type_enum import MetricTypes

log = logging.getLogger(__name__)
KINDS = {"counter": MetricTypes.COUNTER, "gauge": MetricTypes.GAUGE, "histogram": MetricTypes.HISTOGRAM}


class HandlerMetrics:
    """Looks each metric up once; emitting is one call. Unknown metrics are added to the cache."""

    def __init__(self, context: Any, model_name: str) -> None:
        self._cache = context.metrics
        self._model = model_name
        self._metrics: dict[str, Any] = {}

    def _get(self, name: str, kind: str, unit: str, extra_dims: Sequence[str]) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            try:
                metric = self._cache.get_metric(name, KINDS[kind])
            except Exception:  # not declared in the metrics config: declare it here
                metric = self._cache.add_metric_to_cache(name, unit, ["ModelName", *extra_dims], KINDS[kind])
            self._metrics[name] = metric
        return metric

    def emit(self, name: str, kind: str, value: float, unit: str = "Count", **dims: str) -> None:
        try:
            self._get(name, kind, unit, list(dims)).add_or_update(value, [self._model, *dims.values()])
        except Exception:  # metrics must never fail a request
            log.exception("could not emit metric %s", name)
