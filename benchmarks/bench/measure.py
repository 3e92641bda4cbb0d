"""One load point: warm up, measure windows until the last N agree (or max trials), judge the SLA.

Windows are consecutive slices of one continuous load (no gaps, no ramp per window). A point's
figures come from its last N windows when they agree; when they never do, the point is marked
unstable and its figures cover every measured window; it is never silently averaged into a pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from servekit.benchmarks.bench.loadgen import Handle, LoadGenerator, LoadSpec
from servekit.benchmarks.bench.schema import SLA, Measurement
from servekit.benchmarks.bench.server_metrics import GPUSampler, HostCPU, Sample, host_saturation, point_figures
from servekit.benchmarks.bench.stats import (FIELDS, LLM_FIELDS, Summary, goodput, in_span, stability, summarize,
                                             window_stats)

PASS, FAIL, UNSTABLE, ERROR = "pass", "fail", "unstable", "error"


@dataclass(frozen=True)
class ServingConfig:
    variant: str
    workers: int
    batch_size: int
    max_batch_delay_ms: int
    texts_per_request: int | None = None  # the payloads' texts regrouped into requests of this many

    def label(self) -> str:
        texts = f" t{self.texts_per_request}" if self.texts_per_request else ""
        return f"{self.variant} w{self.workers} b{self.batch_size} d{self.max_batch_delay_ms}{texts}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"variant": self.variant, "workers": self.workers, "batch_size": self.batch_size,
                               "max_batch_delay_ms": self.max_batch_delay_ms}
        if self.texts_per_request:
            out["texts_per_request"] = self.texts_per_request
        return out


@dataclass
class PointResult:
    config: ServingConfig
    load: LoadSpec
    status: str
    reasons: list[str]
    summary: Summary | None = None
    warmup: Summary | None = None
    windows: list[Summary] = field(default_factory=list)
    stable: bool = False
    spreads: dict[str, float] = field(default_factory=dict)
    segment: tuple[float, float] = (0.0, 0.0)
    server: dict[str, Any] = field(default_factory=dict)
    gpu: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)  # host CPU busy %, load generator cores
    generator: dict[str, Any] = field(default_factory=dict)
    raw_file: str | None = None
    elapsed_s: float = 0.0
    role: str = "search"  # search, level, probe or repeat

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def throughput(self) -> float:
        return self.summary.throughput if self.summary else 0.0

    @property
    def sustained_rps(self) -> float:
        """The load this point sustained: the offered arrival rate (open loop; what the achieved
        throughput estimates, without its Poisson counting noise) or the achieved throughput (closed)."""
        if self.summary is None:
            return 0.0
        return self.load.level if self.load.mode == "open" else self.summary.throughput

    @property
    def p99(self) -> float:
        return self.summary.p["p99"] if self.summary else float("inf")


def judge(summary: Summary, stable: bool, sla: SLA) -> tuple[str, list[str]]:
    reasons = []
    if summary.count == 0:
        return FAIL, ["no request completed in the measured windows"]
    if summary.error_rate > sla.max_error_rate:
        reasons.append(f"error rate {summary.error_rate:.2%} > {sla.max_error_rate:.2%} "
                       f"({', '.join(f'{k}: {v}' for k, v in summary.status_counts.items())})")
    if summary.p["p99"] > sla.p99_ms:
        reasons.append(f"p99 {summary.p['p99']:.1f} ms > {sla.p99_ms:g} ms")
    if sla.p50_ms is not None and summary.p["p50"] > sla.p50_ms:
        reasons.append(f"p50 {summary.p['p50']:.1f} ms > {sla.p50_ms:g} ms")
    if summary.llm is not None:
        if sla.ttft_p99_ms is not None and summary.llm.ttft_ms["p99"] > sla.ttft_p99_ms:
            reasons.append(f"TTFT p99 {summary.llm.ttft_ms['p99']:.1f} ms > {sla.ttft_p99_ms:g} ms")
        if sla.itl_p99_ms is not None and summary.llm.itl_ms["p99"] > sla.itl_p99_ms:
            reasons.append(f"ITL p99 {summary.llm.itl_ms['p99']:.1f} ms > {sla.itl_p99_ms:g} ms")
    if reasons:
        return FAIL, reasons
    if not stable:
        return UNSTABLE, ["within the SLA but the windows never agreed within tolerance"]
    return PASS, []


def lag_advice(host: dict[str, Any]) -> str:
    """What a late load generator means, given how busy the host's CPUs were."""
    saturated = host_saturation(host)
    if saturated:
        return f"{saturated}: client and server compete for them, so this capacity is a lower bound"
    return "more load processes would help"


def _decisive_failure(ws: list[Summary], sla: SLA) -> str | None:
    """Two windows in a row so far outside the SLA that more windows cannot change the verdict."""
    if len(ws) < 2:
        return None
    a, b = ws[-2], ws[-1]
    limit = max(3 * sla.max_error_rate, 0.05)
    if a.count >= 20 and b.count >= 20 and a.error_rate > limit and b.error_rate > limit:
        return f"error rate {b.error_rate:.1%} in two windows in a row"
    if a.count >= 5 and b.count >= 5 and min(a.p["p50"], b.p["p50"]) > sla.p99_ms:
        return f"p50 above the p99 limit in two windows in a row ({a.p['p50']:.0f}, {b.p['p50']:.0f} ms)"
    return None


def measure_point(gen: LoadGenerator, config: ServingConfig, load: LoadSpec, processes: int, meas: Measurement,
                  sla: SLA, timeout_s: float, scrape: Callable[[], Sample | None], model: str,
                  gpu: GPUSampler | None, raw_path: Path | None,
                  on_window: Callable[[int, Summary], None] | None = None, early_stop: bool = True) -> PointResult:
    t_begin = time.monotonic()
    warm, win, n = meas.warmup_s, meas.window_s, meas.stable_windows
    if load.mode == "open":  # a window must hold enough requests to say anything about percentiles
        win = min(max(win, meas.min_window_requests / load.level), 4 * win)
    longest = 4 * meas.window_s
    handle: Handle = gen.start(load, processes, warm + meas.max_trials * longest + meas.settle_s + 2)
    if gpu is not None:
        gpu.start()
    scrapes: list[Sample | None] = []
    windows: list[Summary] = []
    wstats = []
    early: str | None = None
    host = HostCPU()
    try:
        handle.sleep_until(warm)
        host.start([p.pid for p in gen.procs])
        if load.mode == "closed" and warm > 0:  # the same rule, with the rate seen during warm-up
            seen = len(handle.records()) / warm
            if seen > 0:
                win = min(max(win, meas.min_window_requests / seen), longest)
        scrapes.append(scrape())
        for i in range(meas.max_trials):
            t_end = warm + (i + 1) * win
            handle.sleep_until(t_end)
            scrapes.append(scrape())
            handle.sleep_until(t_end + meas.settle_s)
            recs = handle.records()
            w = summarize(recs, t_end - win, t_end)
            windows.append(w)
            wstats.append(window_stats(recs, t_end - win, t_end))
            if on_window:
                on_window(i, w)
            early = _decisive_failure(windows, sla) if early_stop else None
            if early:
                break
            if stability(wstats, n, meas.tolerance, meas.tail_tolerance, sla.p99_ms)[0]:
                break
    finally:
        host_fig = host.stop()
        gen_counts = handle.stop(timeout_s)
        gpu_fig = gpu.stop() if gpu is not None else {"available": False}
    records = handle.records()
    # Judge again from the complete records: requests still in flight at a window's end are in now.
    bounds = [(warm + i * win, warm + (i + 1) * win) for i in range(len(windows))]
    windows = [summarize(records, *b) for b in bounds]
    stable, spreads = stability([window_stats(records, *b) for b in bounds], n, meas.tolerance, meas.tail_tolerance,
                                sla.p99_ms)
    first = len(windows) - n if stable else 0
    seg = (warm + first * win, warm + len(windows) * win)
    summary = summarize(records, *seg)
    if summary.llm is not None and (sla.ttft_p99_ms is not None or sla.itl_p99_ms is not None):
        summary.llm.goodput_rps = goodput(in_span(records, *seg), seg[1] - seg[0], sla.ttft_p99_ms,
                                          sla.itl_p99_ms)
    status, reasons = judge(summary, stable, sla)
    if early and status != FAIL:
        status, reasons = FAIL, [early]
    elif early:
        reasons.append(f"stopped early: {early}")
    if not stable and status == FAIL and not early:
        reasons.append(f"unstable: window spreads {', '.join(f'{k} {v:.0%}' for k, v in spreads.items())}")
    lag = summary.send_lag_p99_ms
    if load.mode == "open" and lag == lag and lag > max(5.0, 0.1 * sla.p99_ms):
        reasons.append(f"load generator ran {lag:.1f} ms behind its schedule at p99 (latencies still count "
                       f"from the scheduled time; {lag_advice(host_fig)})")
    server = point_figures(scrapes[first] if scrapes else None, scrapes[len(windows)] if len(scrapes) > len(windows)
                           else None, model, seg[1] - seg[0])
    raw_file = None
    if raw_path is not None:
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        fields = LLM_FIELDS if records.shape[1] == len(LLM_FIELDS) else FIELDS
        np.savez_compressed(raw_path, records=records, fields=np.array(fields))
        raw_file = str(raw_path)
    return PointResult(config=config, load=load, status=status, reasons=reasons, summary=summary,
                       warmup=summarize(records, 0.0, warm) if warm > 0 else None, windows=windows, stable=stable,
                       spreads=spreads, segment=seg, server=server, gpu=gpu_fig, host=host_fig,
                       generator={"processes": processes, **gen_counts}, raw_file=raw_file,
                       elapsed_s=time.monotonic() - t_begin)
