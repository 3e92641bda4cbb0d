"""SLA search: the highest load a serving config sustains with p99 (and p50, errors) within the SLA.

Levels are arrival rates (open loop) or user counts (closed loop). Given levels are measured
first, in order, up to the first that fails. Then, unless the search is off: a start level (given,
or half the throughput of a closed-loop saturation probe, which also bounds the search: an
arrival rate above the saturation throughput only grows the queue), exponential growth until a
level fails (or shrinking until one passes), then bisection between the last pass and the first
fail until they are within `precision` of each other. `refine_capacity` narrows a finished
search's bracket further, for the configurations the answer rests on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from servekit.benchmarks.bench.loadgen import LoadSpec
from servekit.benchmarks.bench.measure import PointResult
from servekit.benchmarks.bench.schema import Load


@dataclass
class SearchResult:
    points: list[PointResult] = field(default_factory=list)
    best: PointResult | None = None     # highest passing level
    first_fail: float | None = None     # lowest level seen failing above `best`
    bound: str = ""                     # why the search stopped
    probe: PointResult | None = None

    @property
    def capacity(self) -> float:
        return self.best.sustained_rps if self.best else 0.0


# A search cut short by the sweep's time budget: its capacity is a lower bound, never a recommendation.
BUDGET_EXHAUSTED = "time budget exhausted"


class BudgetExceeded(Exception):
    pass


def search_capacity(load: Load, measure: Callable[[LoadSpec, str], PointResult],
                    probe: Callable[[], PointResult] | None, out_of_time: Callable[[], bool]) -> SearchResult:
    res = SearchResult()
    closed = load.mode == "closed"
    lo: float | None = None
    hi: float | None = None

    def run(level: float, role: str) -> bool:
        nonlocal lo, hi
        if out_of_time():
            raise BudgetExceeded()
        p = measure(LoadSpec(load.mode, level, load.arrival), role)
        res.points.append(p)
        if p.passed and (lo is None or level > lo):
            lo, res.best = level, p
        elif not p.passed and (hi is None or level < hi) and (lo is None or level > lo):
            hi = level
        return p.passed

    def norm(x: float) -> float:
        return _norm(x, closed)

    try:
        for level in load.levels:
            if not run(float(level), "level"):
                break
        s = load.search
        if not s.enabled:
            res.bound = "given levels only"
            return _finish(res, hi)
        budget = s.max_points
        if lo is None and hi is None:
            start = s.start
            if start is None and probe is not None:
                pr = probe()
                res.probe = pr
                sat = pr.throughput if not closed else pr.load.level
                if pr.summary is not None and sat > 0:
                    if closed:
                        start = max(1.0, sat / 2)
                    else:
                        start = sat / 2
                        # Above the saturation throughput the queue can only grow: a failing bound.
                        hi = norm(sat * 1.15)
            start = norm(start or 1.0)
            level = start
            # Shrink until a level passes (if the start fails), or grow until one fails.
            while budget > 0:
                if hi is not None and level >= hi:
                    break
                passed = run(level, "search")
                budget -= 1
                if passed:
                    if hi is not None:
                        break
                    nxt = norm(min(level * s.growth, s.max_level))
                    if nxt <= level:
                        res.bound = "max_level reached"
                        return _finish(res, hi)
                    level = nxt
                else:
                    if lo is not None:
                        break
                    nxt = norm(level / s.growth)
                    if nxt >= level or nxt < start / s.growth ** 3:  # 8x below the start: give up
                        res.bound = "no level within the SLA"
                        return _finish(res, hi)
                    level = nxt
        elif hi is None and lo is not None:
            level = norm(min(lo * s.growth, s.max_level))
            while budget > 0 and hi is None and level > lo:
                run(level, "search")
                budget -= 1
                level = norm(min(level * s.growth, s.max_level))
        # Bisection between the last pass and the first fail.
        while budget > 0 and lo is not None and hi is not None:
            if closed and hi - lo <= 1:
                break
            if (hi - lo) / lo <= s.precision:
                break
            mid = norm((lo + hi) / 2)
            if mid <= lo or mid >= hi:
                break
            run(mid, "search")
            budget -= 1
        if lo is None:
            res.bound = "no level within the SLA"
        elif hi is None:
            res.bound = "highest level tried still passes"
        elif budget <= 0 and (hi - lo) / lo > s.precision:
            res.bound = f"max_points reached ({(hi - lo) / lo:.0%} between pass and fail)"
        else:
            res.bound = f"bracketed within {(hi - lo) / lo:.0%}"
    except BudgetExceeded:
        res.bound = BUDGET_EXHAUSTED
    return _finish(res, hi)


def _norm(x: float, closed: bool) -> float:
    return float(max(1, round(x))) if closed else float(f"{x:.4g}")


def refine_capacity(res: SearchResult, closed: bool, precision: float, max_points: int,
                    measure: Callable[[float], PointResult]) -> SearchResult:
    """Bisect again between a finished search's best pass and first fail, to `precision`.

    Used for the few configurations the report's answer rests on (the winner, the baseline): the
    sweep's coarse precision leaves up to that fraction between two runs' answers. Every new point
    is added to `res`; its best pass and first fail move as the bracket narrows.
    """
    if res.best is None or res.first_fail is None:
        return res
    lo, hi = res.best.load.level, res.first_fail
    spent = 0
    while spent < max_points and (hi - lo) / lo > precision:
        mid = _norm((lo + hi) / 2, closed)
        if mid <= lo or mid >= hi:
            break
        p = measure(mid)
        res.points.append(p)
        spent += 1
        if p.passed:
            lo, res.best = mid, p
        else:
            hi = mid
    res.first_fail = hi
    gap = (hi - lo) / lo
    res.bound = (f"refined: bracketed within {gap:.0%}" if gap <= precision
                 else f"refined: {max_points} more point(s), {gap:.0%} between pass and fail")
    return res


def _finish(res: SearchResult, hi: float | None) -> SearchResult:
    res.first_fail = hi if hi is not None and not math.isinf(hi) else None
    return res
