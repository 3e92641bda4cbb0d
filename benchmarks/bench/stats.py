"""Exact statistics from raw per-request records (numpy), windows and the stability rule.

A record is one request: (intended, start, end, status, payload index), times in seconds since
the point's start. `intended` is when the request should have been sent: for open-loop load the
arrival schedule, for closed-loop load the moment the user sent it. Latency is `end - intended`,
so a stalled server or load generator cannot hide queueing time (coordinated omission).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

FIELDS = ("intended", "start", "end", "status", "payload")
NFIELDS = len(FIELDS)
PERCENTILES = (50, 90, 95, 99, 99.9)


def percentile(values: np.ndarray | Sequence[float], q: float) -> float:
    """The q-th percentile by nearest rank (an observed value: q% of values are <= it).

    Failed requests are passed in as +inf by callers, so a p99 over a set with more than 1% errors
    is infinite: a failed request never met the SLA.
    """
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return float("nan")
    return float(np.percentile(a, q, method="inverted_cdf"))


def poisson_schedule(rate: float, duration: float, rng: np.random.Generator, start: float = 0.0) -> np.ndarray:
    """Intended send times of a Poisson process of `rate`/s over [start, start + duration)."""
    n = int(rate * duration * 1.2 + 10 * math.sqrt(rate * duration) + 10)
    times = start + np.cumsum(rng.exponential(1.0 / rate, n))
    while times[-1] < start + duration:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate, n))
        times = np.concatenate([times, more])
    return times[times < start + duration]


def constant_schedule(rate: float, duration: float, start: float = 0.0, phase: float = 0.0) -> np.ndarray:
    """Intended send times of a constant-rate process (one request every 1/rate s)."""
    return start + (np.arange(int(math.ceil(rate * duration)) + 1) + phase) / rate


def ok_mask(status: np.ndarray) -> np.ndarray:
    return (status >= 200) & (status < 300)


@dataclass
class Summary:
    """Figures of a set of records over a span of `duration` seconds."""

    count: int
    ok: int
    errors: int
    duration: float
    throughput: float        # successful requests per second (by intended time in the span)
    offered: float           # all requests per second
    error_rate: float
    p: dict[str, float]      # SLA percentiles (ms) over all requests, failures counted as infinite
    p_ok: dict[str, float]   # percentiles (ms) over successful requests only
    mean_ms: float
    min_ms: float
    max_ms: float
    send_lag_p99_ms: float   # how far behind its schedule the load generator sent (open loop)
    status_counts: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        def clean(x: float) -> float | None | str:
            if isinstance(x, float) and math.isinf(x):
                return "inf"
            if isinstance(x, float) and math.isnan(x):
                return None
            return round(x, 4) if isinstance(x, float) else x
        d = dict(self.__dict__)
        d["p"] = {k: clean(v) for k, v in self.p.items()}
        d["p_ok"] = {k: clean(v) for k, v in self.p_ok.items()}
        for k in ("throughput", "offered", "error_rate", "mean_ms", "min_ms", "max_ms", "send_lag_p99_ms",
                  "duration"):
            d[k] = clean(d[k])
        return d


def pkey(q: float) -> str:
    return f"p{q:g}"


def summarize(records: np.ndarray, t0: float, t1: float) -> Summary:
    """Summary of the requests whose intended time lies in [t0, t1)."""
    r = records[(records[:, 0] >= t0) & (records[:, 0] < t1)] if records.size else records.reshape(0, NFIELDS)
    duration = t1 - t0
    status = r[:, 3]
    ok = ok_mask(status)
    lat = (r[:, 2] - r[:, 0]) * 1000.0
    lat_sla = np.where(ok, lat, np.inf)
    lat_ok = lat[ok]
    counts: dict[str, int] = {}
    for s, c in zip(*np.unique(status.astype(int), return_counts=True)):
        counts[str(s) if s else "connection_error"] = int(c)
    n = len(r)
    return Summary(
        count=n, ok=int(ok.sum()), errors=int(n - ok.sum()), duration=duration,
        throughput=float(ok.sum() / duration) if duration > 0 else float("nan"),
        offered=float(n / duration) if duration > 0 else float("nan"),
        error_rate=float((n - ok.sum()) / n) if n else 0.0,
        p={pkey(q): percentile(lat_sla, q) for q in PERCENTILES},
        p_ok={pkey(q): percentile(lat_ok, q) for q in PERCENTILES},
        mean_ms=float(lat_ok.mean()) if lat_ok.size else float("nan"),
        min_ms=float(lat_ok.min()) if lat_ok.size else float("nan"),
        max_ms=float(lat.max()) if lat.size else float("nan"),
        send_lag_p99_ms=percentile((r[:, 1] - r[:, 0]) * 1000.0, 99) if n else float("nan"),
        status_counts=counts,
    )


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of positive values; inf when they disagree about being finite."""
    v = np.asarray(values, dtype=np.float64)
    if np.all(np.isinf(v)):
        return 0.0
    if np.any(~np.isfinite(v)):
        return float("inf")
    med = float(np.median(v))
    if med <= 0:
        return 0.0 if float(v.max() - v.min()) == 0 else float("inf")
    return float((v.max() - v.min()) / med)


def percentile_interval(values: np.ndarray, q: float, z: float = 2.0) -> tuple[float, float]:
    """Distribution-free ~95% interval of the q-th percentile from order statistics (ranks
    n*q/100 -/+ z*sqrt(n*q/100*(1-q/100)))."""
    a = np.sort(np.asarray(values, dtype=np.float64))
    n = a.size
    if n == 0:
        return float("nan"), float("nan")
    f = q / 100.0
    half = z * math.sqrt(n * f * (1 - f))
    lo = int(max(0, math.floor(n * f - half) - 1))
    hi = int(min(n - 1, math.ceil(n * f + half)))
    return float(a[lo]), float(a[hi])


@dataclass
class WindowStats:
    """What the stability rule compares: point estimates and their sampling intervals."""

    count: int
    throughput: float
    throughput_iv: tuple[float, float]
    p50: float
    p50_iv: tuple[float, float]
    p99: float
    p99_iv: tuple[float, float]


def window_stats(records: np.ndarray, t0: float, t1: float) -> WindowStats:
    r = records[(records[:, 0] >= t0) & (records[:, 0] < t1)] if records.size else records.reshape(0, NFIELDS)
    d = t1 - t0
    ok = ok_mask(r[:, 3])
    lat = np.where(ok, (r[:, 2] - r[:, 0]) * 1000.0, np.inf)
    n = float(ok.sum())
    half = 2.0 * math.sqrt(max(n, 1.0))  # counting noise of a Poisson number of arrivals
    return WindowStats(len(r), n / d, (max(0.0, n - half) / d, (n + half) / d),
                       percentile(lat, 50), percentile_interval(lat, 50),
                       percentile(lat, 99), percentile_interval(lat, 99))


def agree(values: Sequence[float], intervals: Sequence[tuple[float, float]], tolerance: float) -> tuple[bool, float]:
    """Values agree when their spread is within `tolerance`, or when their sampling intervals all
    overlap (the window is too short for the difference to mean anything). Returns (agree, spread)."""
    s = spread(values)
    if s <= tolerance:
        return True, s
    los = [iv[0] for iv in intervals]
    his = [iv[1] for iv in intervals]
    if any(math.isnan(x) for x in los + his):
        return False, s
    return max(los) <= min(his), s


TAIL_SAMPLES = 10  # requests beyond the p99 a window needs before its p99 is worth comparing


def stability(windows: Sequence[WindowStats], n: int, tolerance: float, tail_tolerance: float) -> tuple[bool, dict[str, float]]:
    """Do the last `n` windows agree? Throughput and p50 within `tolerance`, each widened to the
    window's sampling noise (see `agree`); p99 within `tail_tolerance` once every window holds at
    least 1000 requests (10 beyond its p99).

    A queue that grows from window to window moves p50 far outside any sampling interval, and
    fails the rule; a short window at a low rate is not called unstable for Poisson noise alone.
    The p99 of a window with fewer requests is its largest few latencies: one stall (a garbage
    collection, a page fault) moves it by a factor, so it is not compared; the point's p99 comes
    from all the agreeing windows together.
    """
    if len(windows) < n:
        return False, {}
    last = windows[-n:]
    ok_t, s_t = agree([w.throughput for w in last], [w.throughput_iv for w in last], tolerance)
    ok_50, s_50 = agree([w.p50 for w in last], [w.p50_iv for w in last], tolerance)
    ok_99, s_99 = agree([w.p99 for w in last], [w.p99_iv for w in last], tail_tolerance)
    if min(w.count for w in last) < TAIL_SAMPLES / 0.01:
        ok_99 = True
    return ok_t and ok_50 and ok_99, {"throughput": s_t, "p50": s_50, "p99": s_99}
