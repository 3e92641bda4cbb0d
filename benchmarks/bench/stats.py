"""Exact statistics from raw per-request records (numpy), windows and the stability rule.

A record is one request: (intended, start, end, status, payload index), times in seconds since
the point's start. `intended` is when the request should have been sent: for open-loop load the
arrival schedule, for closed-loop load the moment the user sent it. Latency is `end - intended`,
so a stalled server or load generator cannot hide queueing time (coordinated omission).

A streamed (server-sent events) request adds (first, last, tokens): when its first and last
tokens arrived and how many completion tokens it got; `llm_summary` turns them into TTFT,
inter-token latency and output tokens/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

FIELDS = ("intended", "start", "end", "status", "payload")
NFIELDS = len(FIELDS)
LLM_FIELDS = FIELDS + ("first", "last", "tokens")
PERCENTILES = (50, 90, 95, 99, 99.9)
LLM_PERCENTILES = (50, 90, 99)

# Statuses that are not HTTP codes: no answer at all, and a 2xx stream that ended before `data: [DONE]`.
CONNECTION_ERROR, INCOMPLETE_STREAM = 0, 1
STATUS_NAMES = {CONNECTION_ERROR: "connection_error", INCOMPLETE_STREAM: "incomplete_stream"}


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


def _clean(x: Any) -> Any:
    """A figure as JSON can hold it: inf as "inf", NaN as null, floats rounded."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float) and math.isnan(x):
        return None
    return round(x, 4) if isinstance(x, float) else x


@dataclass
class LlmSummary:
    """Streamed-generation figures of a set of requests (see `llm_summary`)."""

    ttft_ms: dict[str, float]      # time to first token from the intended send time; failures infinite
    itl_ms: dict[str, float]       # per-request mean inter-token latency; failures infinite
    tokens_per_s: float            # completion tokens of successful requests per second of the span
    tokens_per_s_per_seq: float    # 1000 / median ITL of successful requests: one sequence's decode speed
    completion_tokens: int
    completion_tokens_mean: float
    itl_requests: int              # successful requests with 2+ tokens: the ITL population
    goodput_rps: float | None = None  # requests/s that met the SLA's TTFT and ITL bounds each (see `goodput`)

    def to_dict(self) -> dict[str, Any]:
        return {k: ({q: _clean(x) for q, x in v.items()} if isinstance(v, dict) else _clean(v))
                for k, v in self.__dict__.items()}


def inter_token_ms(first: np.ndarray, last: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Per request: (last - first) / (tokens - 1) in ms, the mean gap between its tokens; NaN
    below 2 tokens. With speculative decoding one chunk may carry several tokens: this is the
    mean time per token, not the time between chunks."""
    n = np.asarray(tokens, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n >= 2, (np.asarray(last) - np.asarray(first)) * 1000.0 / (n - 1), np.nan)


def llm_summary(r: np.ndarray, duration: float) -> LlmSummary:
    """TTFT, ITL and output tokens/s of the streamed requests `r` (rows of LLM_FIELDS) over
    `duration` seconds. Failed requests count as infinitely slow in the TTFT and ITL percentiles,
    as in the latency ones; a successful one-token answer has no ITL."""
    ok = ok_mask(r[:, 3])
    failed = int((~ok).sum())
    ttft = np.concatenate([(r[ok, 5] - r[ok, 0]) * 1000.0, np.full(failed, np.inf)])
    itl_ok = inter_token_ms(r[ok, 5], r[ok, 6], r[ok, 7])
    itl_ok = itl_ok[~np.isnan(itl_ok)]
    itl = np.concatenate([itl_ok, np.full(failed, np.inf)])
    tokens = r[ok, 7]
    median_itl = percentile(itl_ok, 50)
    with np.errstate(divide="ignore"):
        per_seq = float(np.float64(1000.0) / median_itl)
    return LlmSummary(
        ttft_ms={pkey(q): percentile(ttft, q) for q in LLM_PERCENTILES},
        itl_ms={pkey(q): percentile(itl, q) for q in LLM_PERCENTILES},
        tokens_per_s=float(tokens.sum() / duration) if duration > 0 else float("nan"),
        tokens_per_s_per_seq=per_seq,
        completion_tokens=int(tokens.sum()),
        completion_tokens_mean=float(tokens.mean()) if tokens.size else float("nan"),
        itl_requests=int(itl_ok.size),
    )


def goodput(r: np.ndarray, duration: float, ttft_ms: float | None, itl_ms: float | None) -> float:
    """Requests per second that each met ``ttft_ms`` (from the intended send time) and ``itl_ms``
    (their mean time per token after the first; one-token answers have none to miss), as
    ``vllm bench serve --goodput`` counts: the load a server carries within the latency a user
    sees, rather than a percentile over everything it was sent."""
    ok = ok_mask(r[:, 3])
    good = ok.copy()
    if ttft_ms is not None:
        good &= (r[:, 5] - r[:, 0]) * 1000.0 <= ttft_ms
    if itl_ms is not None:
        itl = inter_token_ms(r[:, 5], r[:, 6], r[:, 7])
        good &= np.isnan(itl) | (itl <= itl_ms)
    return float(good.sum() / duration) if duration > 0 else float("nan")


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
    llm: LlmSummary | None = None  # streamed requests only

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["p"] = {k: _clean(v) for k, v in self.p.items()}
        d["p_ok"] = {k: _clean(v) for k, v in self.p_ok.items()}
        for k in ("throughput", "offered", "error_rate", "mean_ms", "min_ms", "max_ms", "send_lag_p99_ms",
                  "duration"):
            d[k] = _clean(d[k])
        if self.llm is None:
            del d["llm"]
        else:
            d["llm"] = self.llm.to_dict()
        return d


def pkey(q: float) -> str:
    return f"p{q:g}"


def summarize(records: np.ndarray, t0: float, t1: float) -> Summary:
    """Summary of the requests whose intended time lies in [t0, t1)."""
    r = in_span(records, t0, t1)
    duration = t1 - t0
    status = r[:, 3]
    ok = ok_mask(status)
    lat = (r[:, 2] - r[:, 0]) * 1000.0
    lat_sla = np.where(ok, lat, np.inf)
    lat_ok = lat[ok]
    counts: dict[str, int] = {}
    for s, c in zip(*np.unique(status.astype(int), return_counts=True)):
        counts[STATUS_NAMES.get(int(s), str(s))] = int(c)
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
        llm=llm_summary(r, duration) if r.shape[1] >= len(LLM_FIELDS) else None,
    )


def in_span(records: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """The records whose intended time lies in [t0, t1), keeping the column count when empty."""
    if not records.size:
        return records.reshape(0, records.shape[1] if records.ndim == 2 else NFIELDS)
    return records[(records[:, 0] >= t0) & (records[:, 0] < t1)]


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
    r = in_span(records, t0, t1)
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


def stability(windows: Sequence[WindowStats], n: int, tolerance: float, tail_tolerance: float,
              p99_limit: float | None = None) -> tuple[bool, dict[str, float]]:
    """Do the last `n` windows agree? Throughput and p50 within `tolerance`, each widened to the
    window's sampling noise (see `agree`); p99 within `tail_tolerance` once every window holds at
    least 1000 requests (10 beyond its p99).

    A queue that grows from window to window moves p50 far outside any sampling interval, and
    fails the rule; a short window at a low rate is not called unstable for Poisson noise alone.
    The p99 of a window with fewer requests is its largest few latencies: one stall (a garbage
    collection, a page fault) moves it by a factor, so it is not compared; the point's p99 comes
    from all the agreeing windows together. With `p99_limit` (the SLA's), p99s that spread more
    than `tail_tolerance` still agree when every window is on the same side of the limit: the
    verdict does not depend on the window (p99s of 11 and 19 ms under a 50 ms SLA). In ms.
    """
    if len(windows) < n:
        return False, {}
    last = windows[-n:]
    ok_t, s_t = agree([w.throughput for w in last], [w.throughput_iv for w in last], tolerance)
    ok_50, s_50 = agree([w.p50 for w in last], [w.p50_iv for w in last], tolerance)
    ok_99, s_99 = agree([w.p99 for w in last], [w.p99_iv for w in last], tail_tolerance)
    if min(w.count for w in last) < TAIL_SAMPLES / 0.01:
        ok_99 = True
    if not ok_99 and p99_limit is not None:
        ok_99 = all(w.p99 <= p99_limit for w in last) or all(w.p99 > p99_limit for w in last)
    return ok_t and ok_50 and ok_99, {"throughput": s_t, "p50": s_50, "p99": s_99}
