"""Server-side figures per point: TorchServe's and the handler's Prometheus metrics, GPU via NVML, host CPU.

/metrics is scraped at each window boundary and parsed with prometheus_client's text parser;
a point's figures are differences of counters over its measured windows. TorchServe's latency
metrics are counters of summed microseconds, so they give means; the handler's histograms have
TorchServe's fixed buckets and are only used for their sums and counts.
"""
from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

import psutil

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(metrics_url: str | None, timeout: float = 5.0) -> Sample | None:
    """All samples of /metrics as {(name, sorted labels): value}; None when it cannot be read."""
    if not metrics_url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return None
    out: Sample = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except ValueError:
        return None
    return out


def _model_total(sample: Sample, name: str, model: str) -> float | None:
    """Sum of `name` over the series of `model` (label model_name or ModelName); None if absent."""
    names = (name, f"{name}_total")  # the parser names counter samples <family>_total
    vals = [v for (n, labels), v in sample.items() if n in names
            and dict(labels).get("model_name", dict(labels).get("ModelName")) == model]
    return sum(vals) if vals else None


def _delta(a: Sample, b: Sample, name: str, model: str) -> float | None:
    va, vb = _model_total(a, name, model), _model_total(b, name, model)
    if vb is None:
        return None
    return vb - (va or 0.0)


def point_figures(before: Sample | None, after: Sample | None, model: str, seconds: float) -> dict[str, Any]:
    """Server-side figures of `model` between two scrapes `seconds` apart."""
    if before is None or after is None:
        return {"available": False}
    d = lambda name: _delta(before, after, name, model)  # noqa: E731
    out: dict[str, Any] = {"available": True}
    reqs = d("ts_inference_requests_total")
    inf_us = d("ts_inference_latency_microseconds")
    queue_us = d("ts_queue_latency_microseconds")
    if reqs:
        out["ts_requests"] = reqs
        out["ts_requests_per_s"] = reqs / seconds if seconds > 0 else None
        # TorchServe's "inference latency" counter includes the queue: the backend (worker) time
        # per request is the difference.
        if inf_us is not None:
            out["ts_latency_mean_ms"] = inf_us / reqs / 1000.0
        if queue_us is not None:
            out["ts_queue_mean_ms"] = queue_us / reqs / 1000.0
            if inf_us is not None:
                out["ts_backend_mean_ms"] = (inf_us - queue_us) / reqs / 1000.0
    batches = d("servekit_batches_total")
    texts = d("servekit_texts_total")
    requests = d("servekit_requests_total")
    tokens = d("servekit_tokens_total")
    padded = d("servekit_padded_tokens_total")
    if batches:
        out["batches"] = batches
        if texts is not None:
            out["texts_per_batch"] = texts / batches
        if requests is not None:
            out["requests_per_batch"] = requests / batches
    if tokens is not None and padded is not None and tokens + padded > 0:
        out["padding_fraction"] = padded / (tokens + padded)
    for stage in ("preprocess", "inference", "postprocess"):
        s, c = d(f"servekit_{stage}_seconds_sum"), d(f"servekit_{stage}_seconds_count")
        if s is not None and c:
            out[f"handler_{stage}_mean_ms"] = s / c * 1000.0
    s, c = d("servekit_request_latency_seconds_sum"), d("servekit_request_latency_seconds_count")
    if s is not None and c:
        out["handler_request_mean_ms"] = s / c * 1000.0
    errs = [v for (n, labels), v in after.items() if n == "servekit_request_errors_total"
            and dict(labels).get("ModelName") == model]
    if errs:
        out["handler_errors_total"] = sum(errs)
    plan = [dict(labels).get("Plan") for (n, labels), v in after.items() if n == "servekit_plan_info"
            and dict(labels).get("ModelName") == model and v > 0]
    if plan:
        out["plan"] = sorted(set(plan))
    return out


class GPUSampler:
    """Samples GPU utilisation and memory through NVML in a thread; inert when there is no GPU."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.handles: list[Any] = []
        self.names: list[str] = []
        self.driver = None
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                self.handles.append(h)
                name = pynvml.nvmlDeviceGetName(h)
                self.names.append(name.decode() if isinstance(name, bytes) else name)
            drv = pynvml.nvmlSystemGetDriverVersion()
            self.driver = drv.decode() if isinstance(drv, bytes) else drv
        except Exception:  # no NVML library or no GPU: skip cleanly
            self.handles, self._nvml = [], None
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def _run(self) -> None:
        nv = self._nvml
        while not self._stop.is_set():
            try:
                util = [nv.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]
                mem = [nv.nvmlDeviceGetMemoryInfo(h).used / 2**20 for h in self.handles]
                self._samples.append((sum(util) / len(util), sum(mem)))
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if not self.available:
            return
        self._samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        if not self.available or self._thread is None:
            return {"available": False}
        self._stop.set()
        self._thread.join()
        self._thread = None
        if not self._samples:
            return {"available": True, "samples": 0}
        util = [u for u, _ in self._samples]
        mem = [m for _, m in self._samples]
        return {"available": True, "samples": len(util), "util_mean_pct": sum(util) / len(util),
                "util_max_pct": max(util), "memory_used_max_mib": max(mem)}


SATURATED_PCT = 90.0  # host CPU busy share from which client and server are taken to compete


class HostCPU:
    """How busy the host's CPUs were over a point, and how many cores the load generator took.

    The load generator usually shares the host with TorchServe: when the host is saturated, client
    and server slow each other down and the capacity found is a lower bound (and varies run to run).
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._host0: Any = None
        self._procs: list[tuple[psutil.Process, float]] = []

    def start(self, pids: list[int]) -> None:
        self._t0 = time.monotonic()
        self._host0 = psutil.cpu_times()
        self._procs = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                self._procs.append((p, sum(p.cpu_times()[:2])))
            except psutil.Error:  # gone already: it simply adds nothing
                pass

    def stop(self) -> dict[str, Any]:
        if self._host0 is None:
            return {}
        wall = time.monotonic() - self._t0
        host1 = psutil.cpu_times()
        idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        total = sum(host1) - sum(self._host0)
        busy = total - (idle(host1) - idle(self._host0))
        gen = 0.0
        for p, before in self._procs:
            try:
                gen += sum(p.cpu_times()[:2]) - before
            except psutil.Error:
                pass
        self._host0 = None
        return {"cpu_count": psutil.cpu_count(), "busy_pct": round(100.0 * busy / total, 1) if total > 0 else None,
                "loadgen_cores": round(gen / wall, 3) if wall > 0 else None}


def host_saturation(host: dict[str, Any]) -> str | None:
    """'the host's CPUs were N% busy, ...' when a point's host was saturated (HostCPU figures), else None."""
    busy = host.get("busy_pct")
    if busy is None or busy < SATURATED_PCT:
        return None
    return (f"the host's CPUs were {busy:.0f}% busy, the load generator taking {host.get('loadgen_cores')} of "
            f"{host.get('cpu_count')} cores")
