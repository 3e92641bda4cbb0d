"""Percentile, open-loop and search arithmetic of the auto-benchmark (no server)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from servekit.benchmarks.bench.loadgen import LoadSpec
from servekit.benchmarks.bench.measure import FAIL, PASS, PointResult, ServingConfig, judge
from servekit.benchmarks.bench.schema import SLA, Load, Search
from servekit.benchmarks.bench.search import refine_capacity, search_capacity
from servekit.benchmarks.bench.stats import (constant_schedule, percentile, percentile_interval, poisson_schedule, stability,
                                    summarize, window_stats)


def records(intended, latency_s, status=None, start=None) -> np.ndarray:
    intended = np.asarray(intended, dtype=float)
    latency_s = np.broadcast_to(np.asarray(latency_s, dtype=float), intended.shape)
    status = np.full(intended.shape, 200.0) if status is None else np.asarray(status, dtype=float)
    start = intended if start is None else np.asarray(start, dtype=float)
    return np.column_stack([intended, start, intended + latency_s, status, np.zeros_like(intended)])


def test_percentile_is_nearest_rank() -> None:
    v = np.arange(1, 101, dtype=float)  # 1..100
    assert percentile(v, 50) == 50.0
    assert percentile(v, 99) == 99.0
    assert percentile(v, 99.9) == 100.0
    assert percentile(np.array([7.0]), 99) == 7.0
    assert math.isnan(percentile(np.array([]), 50))
    # an observed value, never an interpolation between two
    assert percentile(np.array([1.0, 10.0]), 60) == 10.0


def test_failures_count_as_infinitely_slow() -> None:
    n = 1000
    st = np.full(n, 200.0)
    st[:5] = 503  # 0.5% errors: p99 still finite
    s = summarize(records(np.arange(n) / 100.0, 0.010, st), 0, 10)
    assert s.error_rate == pytest.approx(0.005)
    assert s.p["p99"] == pytest.approx(10.0)
    assert s.status_counts == {"200": 995, "503": 5}
    st[:20] = 0  # 2% connection errors: p99 can no longer be met
    s = summarize(records(np.arange(n) / 100.0, 0.010, st), 0, 10)
    assert math.isinf(s.p["p99"]) and s.p_ok["p99"] == pytest.approx(10.0)
    assert s.status_counts["connection_error"] == 20


def test_window_selection_and_throughput() -> None:
    r = records(np.arange(0, 10, 0.01), np.linspace(0.001, 0.100, 1000))
    s = summarize(r, 2.0, 4.0)
    assert s.count == 200 and s.throughput == pytest.approx(100.0)
    # requests of the window are those *scheduled* in it, whenever they finished
    assert s.min_ms == pytest.approx(np.linspace(1, 100, 1000)[200], rel=1e-6)


def test_open_loop_latency_counts_from_the_schedule() -> None:
    """A 1 s server stall at t=5 under 100 requests/s: the 100 requests due during the stall waited
    for it, and p99 must show it (timing from the actual send would hide it: coordinated omission)."""
    intended = constant_schedule(100, 10)[:-1]
    service = 0.001
    end = np.empty_like(intended)
    free = 0.0
    for i, t in enumerate(intended):
        begin = max(t, free, 6.0 if 5.0 <= t < 6.0 else 0.0)
        free = end[i] = begin + service
    r = np.column_stack([intended, intended, end, np.full_like(intended, 200), np.zeros_like(intended)])
    s = summarize(r, 0, 10)
    lat_ms = np.sort((end - intended) * 1000)
    assert s.p["p99"] == pytest.approx(lat_ms[int(math.ceil(0.99 * len(lat_ms))) - 1])
    assert s.p["p99"] > 800          # the stall is visible at p99 ...
    assert s.p["p50"] < 2            # ... while the median stays at the service time
    # the same requests timed from a send that waited for the stall would all look fast
    r_naive = r.copy()
    r_naive[:, 0] = np.maximum(intended, end - service)
    assert summarize(r_naive, 0, 11).p["p99"] < 2


def test_poisson_and_constant_schedules() -> None:
    rng = np.random.default_rng(1)
    t = poisson_schedule(200.0, 50.0, rng)
    assert len(t) / 50.0 == pytest.approx(200.0, rel=0.03)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 200.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps: CV 1
    assert t.min() >= 0 and t.max() < 50.0 and np.all(gaps > 0)
    c = constant_schedule(40.0, 2.0)
    assert np.allclose(np.diff(c), 0.025)


def test_percentile_interval_brackets_the_truth() -> None:
    rng = np.random.default_rng(2)
    v = rng.normal(20, 2, 2000)
    lo, hi = percentile_interval(v, 99)
    true_p99 = 20 + 2 * 2.3263
    assert lo <= true_p99 <= hi
    assert lo <= percentile(v, 99) <= hi


def test_stability_rule() -> None:
    rng = np.random.default_rng(3)
    def window(k: int, rate: float, lat: np.ndarray) -> tuple:
        t = poisson_schedule(rate, 2.0, rng, start=2.0 * k)
        return records(t, lat[: len(t)] if lat.ndim else lat)
    # steady: same latency distribution every window
    steady = np.concatenate([window(k, 200, rng.normal(0.02, 0.002, 1000)) for k in range(3)])
    ws = [window_stats(steady, 2.0 * k, 2.0 * (k + 1)) for k in range(3)]
    assert stability(ws, 3, 0.10, 0.25)[0]
    # a queue growing window after window
    growing = np.concatenate([window(k, 200, np.full(1000, 0.02 * 3 ** k)) for k in range(3)])
    ws = [window_stats(growing, 2.0 * k, 2.0 * (k + 1)) for k in range(3)]
    ok, spreads = stability(ws, 3, 0.10, 0.25)
    assert not ok and spreads["p50"] > 1
    # a low rate: Poisson counts differ by more than 10% but within their own noise
    low = np.concatenate([records(np.linspace(2.0 * k, 2.0 * k + 1.99, n), 0.02) for k, n in enumerate((16, 20, 24))])
    ws = [window_stats(low, 2.0 * k, 2.0 * (k + 1)) for k in range(3)]
    ok, spreads = stability(ws, 3, 0.10, 0.25)
    assert spreads["throughput"] > 0.10 and ok
    assert not stability(ws[:2], 3, 0.10, 0.25)[0]  # fewer windows than required
    # one stall in a short window moves its p99 by a factor: not compared below 1000 requests ...
    base = [records(np.linspace(2.0 * k, 2.0 * k + 1.99, 400), 0.01) for k in range(3)]
    base[1][-5:, 2] += 0.5  # five requests caught in a 0.5 s stall
    ws = [window_stats(np.concatenate(base), 2.0 * k, 2.0 * (k + 1)) for k in range(3)]
    ok, spreads = stability(ws, 3, 0.10, 0.25)
    assert ok and spreads["p99"] > 1
    big = [records(np.linspace(2.0 * k, 2.0 * k + 1.999, 1200), 0.01 + 0.05 * (k == 1) * (np.arange(1200) % 50 == 0))
           for k in range(3)]
    ws = [window_stats(np.concatenate(big), 2.0 * k, 2.0 * (k + 1)) for k in range(3)]
    assert not stability(ws, 3, 0.10, 0.25)[0]  # ... but compared when every window holds 1000+
    # p99s of 10, 60 and 10 ms: they straddle a 50 ms SLA (unstable verdict), not a 100 ms one
    assert [round(w.p99) for w in ws] == [10, 60, 10]
    assert not stability(ws, 3, 0.10, 0.25, p99_limit=50.0)[0]
    assert stability(ws, 3, 0.10, 0.25, p99_limit=100.0)[0]
    assert stability(ws, 3, 0.10, 0.25, p99_limit=5.0)[0]  # every window fails: a stable failure


def test_judge() -> None:
    sla = SLA(p99_ms=50, p50_ms=20, max_error_rate=0.01)
    good = summarize(records(np.arange(0, 5, 0.01), 0.010), 0, 5)
    assert judge(good, True, sla) == (PASS, [])
    assert judge(good, False, sla)[0] == "unstable"
    slow = summarize(records(np.arange(0, 5, 0.01), 0.030), 0, 5)
    status, reasons = judge(slow, True, sla)
    assert status == FAIL and reasons == ["p50 30.0 ms > 20 ms"]


def fake_point(load: LoadSpec, capacity: float) -> PointResult:
    passed = load.level <= capacity
    lat = 0.01 if passed else 1.0
    rate = load.level if load.mode == "open" else min(load.level, capacity) * 10
    s = summarize(records(np.arange(0, 3, 1 / rate), lat), 0, 3)
    return PointResult(ServingConfig("v", 1, 1, 0), load, PASS if passed else FAIL, [], summary=s, stable=True)


@pytest.mark.parametrize("capacity", [3.0, 37.0, 450.0])
def test_search_brackets_the_boundary(capacity: float) -> None:
    load = Load(mode="open", search=Search(start=10.0, precision=0.1, max_points=12))
    seen: list[float] = []
    def measure(spec: LoadSpec, role: str) -> PointResult:
        seen.append(spec.level)
        return fake_point(spec, capacity)
    res = search_capacity(load, measure, None, lambda: False)
    assert res.best is not None and res.best.load.level <= capacity
    assert res.best.load.level >= capacity / 1.1 - 1e-9, (seen, res.bound)
    assert res.first_fail is not None and res.first_fail > capacity
    assert len(seen) <= 12


@pytest.mark.parametrize("capacity", [37.0, 450.0, 1234.0])
def test_refine_narrows_a_coarse_bracket(capacity: float) -> None:
    load = Load(mode="open", search=Search(start=10.0, precision=0.3, max_points=12))
    res = search_capacity(load, lambda spec, role: fake_point(spec, capacity), None, lambda: False)
    coarse = (res.best.load.level, res.first_fail)
    seen: list[float] = []
    def measure(level: float) -> PointResult:
        seen.append(level)
        return fake_point(LoadSpec("open", level), capacity)
    refine_capacity(res, False, 0.03, 8, measure)
    assert all(coarse[0] < level < coarse[1] for level in seen) and len(seen) <= 8
    assert capacity / 1.03 - 1e-9 <= res.best.load.level <= capacity < res.first_fail
    assert (res.first_fail - res.best.load.level) / res.best.load.level <= 0.03
    assert res.bound.startswith("refined: bracketed within") and len(res.points) > len(seen)
    # out of points: the bracket is narrower but the bound says it was not reached
    res = search_capacity(load, lambda spec, role: fake_point(spec, capacity), None, lambda: False)
    refine_capacity(res, False, 0.001, 1, lambda level: fake_point(LoadSpec("open", level), capacity))
    assert res.bound.startswith("refined: 1 more point(s)")


def test_refine_leaves_an_unbracketed_search_alone() -> None:
    res = search_capacity(Load(mode="open", search=Search(start=10.0, max_points=2)),
                          lambda spec, role: fake_point(spec, 1e9), None, lambda: False)
    assert res.first_fail is None
    bound = res.bound
    refine_capacity(res, False, 0.03, 6, lambda level: pytest.fail("measured without a bracket"))
    assert res.bound == bound


def test_search_uses_the_probe_as_upper_bound() -> None:
    load = Load(mode="open", search=Search(start=None, precision=0.1, max_points=6))
    def probe() -> PointResult:
        p = fake_point(LoadSpec("open", 100.0), 1e9)  # saturation throughput 100 rps
        return p
    seen: list[float] = []
    def measure(spec: LoadSpec, role: str) -> PointResult:
        seen.append(spec.level)
        return fake_point(spec, 70.0)
    res = search_capacity(load, measure, probe, lambda: False)
    assert seen[0] == pytest.approx(50.0, rel=0.02)   # half the probe's throughput
    assert max(seen) < 115.0 + 1e-6                  # never above the saturation bound
    assert 70 / 1.1 <= res.best.load.level <= 70


def test_search_closed_loop_and_levels() -> None:
    load = Load(mode="closed", levels=(1, 2, 4), search=Search(start=None, precision=0.1, max_points=10))
    def measure(spec: LoadSpec, role: str) -> PointResult:
        assert spec.level == int(spec.level)
        return fake_point(spec, 13.0)
    res = search_capacity(load, measure, None, lambda: False)
    assert res.best.load.level == 13 and res.first_fail == 14


def test_search_reports_no_passing_level_and_budget() -> None:
    load = Load(mode="open", search=Search(start=10.0, max_points=20))
    res = search_capacity(load, lambda s, r: fake_point(s, 0.0), None, lambda: False)
    assert res.best is None and res.bound == "no level within the SLA"
    res = search_capacity(load, lambda s, r: fake_point(s, 50.0), None, lambda: True)
    assert res.best is None and res.bound == "time budget exhausted"


def _point(mode: str, level: float, rate: float, status: str = PASS, role: str = "search") -> PointResult:
    """A point whose summary holds `rate` requests/s of 5 ms requests over 10 s."""
    n = int(rate * 10)
    summary = summarize(records(np.arange(n) / rate, 0.005), 0, 10)
    return PointResult(ServingConfig("stock", 1, 1, 100), LoadSpec(mode, level), status, [], summary, role=role)


@pytest.mark.parametrize(("probe_rps", "capacity", "warned"), [(160.0, 10.0, True), (100.0, 60.0, False)])
def test_a_baseline_whose_probe_beat_its_search_is_flagged(probe_rps: float, capacity: float, warned: bool) -> None:
    """A closed-loop probe passing at over twice the open-loop capacity means the search hit unstable
    windows: "N x stock" would overstate the margin, and the report says so."""
    from servekit.benchmarks.bench.report import baseline_doubt
    from servekit.benchmarks.bench.analysis import ConfigResult
    from servekit.benchmarks.bench.search import SearchResult

    search = SearchResult(best=_point("open", capacity, capacity),
                          probe=_point("closed", 2, probe_rps, role="probe"))
    result = ConfigResult(ServingConfig("stock", 1, 1, 100), status="measured", search=search)
    assert result.capacity == capacity
    doubt = baseline_doubt(result)
    assert (doubt is not None) == warned
    if warned:
        assert f"{probe_rps:.1f} requests/s" in doubt and f"capacity of {capacity:.1f}" in doubt
    failed_probe = SearchResult(best=search.best, probe=_point("closed", 2, probe_rps, status=FAIL, role="probe"))
    assert baseline_doubt(ConfigResult(result.config, status="measured", search=failed_probe)) is None


def test_a_saturated_host_is_named_in_the_lag_reason_and_the_answer() -> None:
    from servekit.benchmarks.bench.measure import lag_advice
    from servekit.benchmarks.bench.report import host_note

    busy = {"cpu_count": 16, "busy_pct": 96.7, "loadgen_cores": 3.1}
    calm = {"cpu_count": 16, "busy_pct": 41.0, "loadgen_cores": 1.2}
    assert "97% busy" in lag_advice(busy) and "lower bound" in lag_advice(busy)
    assert lag_advice(calm) == "more load processes would help" == lag_advice({})
    point = _point("open", 100, 100)
    point.host = busy
    assert "97% busy" in host_note(point) and "3.1 of 16 cores" in host_note(point)
    point.host = calm
    assert host_note(point) is None
    point.host = {}
    assert host_note(point) is None


def test_analysis_ranks_picks_the_winner_and_the_pareto_front(tmp_path) -> None:
    """analysis.analyze on known results: the winner is the best non-baseline configuration, the
    margin is against the baseline's best, and a configuration beaten on both capacity and p99 is
    off the Pareto front."""
    from pathlib import Path

    from servekit.benchmarks.bench.analysis import ConfigResult, RunRecord, analyze
    from servekit.benchmarks.bench.schema import load_config
    from servekit.benchmarks.bench.search import SearchResult

    cfg = load_config(Path(__file__).resolve().parent.parent / "benchmarks/sweeps/minilm-cpu-demo.yaml")

    def result(variant: str, workers: int, rate: float, latency_s: float) -> ConfigResult:
        summary = summarize(records(np.arange(int(rate * 10)) / rate, latency_s), 0, 10)
        conf = ServingConfig(variant, workers, 8, 5)
        best = PointResult(conf, LoadSpec("open", rate), PASS, [], summary)
        return ConfigResult(conf, status="measured", search=SearchResult(best=best))

    stock, fast, big, slow = (result("stock", 1, 10, 0.005), result("servekit", 1, 100, 0.005),
                              result("servekit", 2, 150, 0.020), result("servekit", 4, 80, 0.030))
    failed = ConfigResult(ServingConfig("servekit", 8, 8, 5), status="error", error="boom")
    a = analyze(RunRecord(cfg, tmp_path, results=[stock, fast, big, slow, failed]))
    assert a.winner is big and a.baseline is stock and a.base_name == "stock"
    assert a.ranked == [big, fast, slow, stock]
    assert a.front == {1, 2}
    assert a.margin == pytest.approx(15.0)
    assert analyze(RunRecord(cfg, tmp_path, results=[stock])).winner is stock  # only the baseline passed
    assert analyze(RunRecord(cfg, tmp_path, results=[failed])).margin is None


def test_a_search_cut_short_by_the_budget_is_never_the_winner(tmp_path) -> None:
    """A configuration whose search ran out of time has only a lower bound: it is reported as such,
    never ranked or recommended, and a winner slower than stock is said to lose."""
    from pathlib import Path

    from servekit.benchmarks.bench.analysis import ConfigResult, RunRecord, analyze
    from servekit.benchmarks.bench.report import answer_lines
    from servekit.benchmarks.bench.schema import load_config
    from servekit.benchmarks.bench.search import BUDGET_EXHAUSTED, SearchResult

    cfg = load_config(Path(__file__).resolve().parent.parent / "benchmarks/sweeps/minilm-cpu-demo.yaml")

    def result(variant: str, batch: int, rate: float, bound: str = "") -> ConfigResult:
        summary = summarize(records(np.arange(int(rate * 10)) / rate, 0.005), 0, 10)
        conf = ServingConfig(variant, 1, batch, 10)
        best = PointResult(conf, LoadSpec("open", rate), PASS, [], summary)
        return ConfigResult(conf, status="measured", search=SearchResult(best=best, bound=bound))

    stock, cut_short, slow = (result("stock", 1, 40), result("servekit", 8, 90, BUDGET_EXHAUSTED),
                              result("servekit", 1, 30, "bracketed within 10%"))
    run = RunRecord(cfg, tmp_path, results=[stock, cut_short, slow])
    a = analyze(run)
    assert a.winner is slow and cut_short not in a.ranked
    text = "\n".join(answer_lines(run, a).lines)
    assert "LOSES" in text
    assert "ran out of time budget mid-search" in text and cut_short.config.label() in text
