"""The benchmarks' PhaseTimer: calls and host seconds per phase, with nested phases counted inside
their caller (inclusive) or once, as themselves (exclusive), per thread."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from servekit.benchmarks import llm_workload_bench
from servekit.benchmarks.llm_workload_bench import PhaseTimer


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A clock the test moves: ``time.perf_counter`` as the benchmark module sees it."""
    now = [0.0]
    monkeypatch.setattr(llm_workload_bench.time, "perf_counter", lambda: now[0])
    return now


def _engine(clock: list[float]) -> SimpleNamespace:
    """outer (1 s of its own) calls inner (2 s) twice, then 1 s more of its own."""
    eng = SimpleNamespace()

    def inner() -> None:
        clock[0] += 2.0

    def outer() -> None:
        clock[0] += 0.5
        eng.inner()
        eng.inner()
        clock[0] += 0.5

    eng.inner, eng.outer = inner, outer
    return eng


@pytest.mark.parametrize("exclusive", [False, True])
def test_nested_phases_count_inside_their_caller_or_once(clock: list[float], exclusive: bool) -> None:
    eng = _engine(clock)
    timer = PhaseTimer(exclusive=exclusive)
    timer.instrument(eng, "outer", "outer")
    timer.instrument(eng, "inner", "inner")
    eng.outer()
    eng.inner()
    assert timer.calls == {"outer": 1, "inner": 3}
    assert timer.seconds["inner"] == pytest.approx(6.0)
    assert timer.seconds["outer"] == pytest.approx(1.0 if exclusive else 5.0)


def test_an_exclusive_phase_on_another_thread_is_not_taken_out_of_this_one(clock: list[float]) -> None:
    """A helper thread's phase runs beside the caller's, not inside it: the caller keeps its time."""
    eng = SimpleNamespace()
    timer = PhaseTimer(exclusive=True)

    def helper() -> None:
        clock[0] += 1.0

    def outer() -> None:
        clock[0] += 1.0
        t = threading.Thread(target=eng.helper)
        t.start()
        t.join()
        clock[0] += 1.0

    eng.helper, eng.outer = helper, outer
    timer.instrument(eng, "helper", "helper")
    timer.instrument(eng, "outer", "outer")
    eng.outer()
    assert timer.seconds["helper"] == pytest.approx(1.0) and timer.seconds["outer"] == pytest.approx(3.0)
