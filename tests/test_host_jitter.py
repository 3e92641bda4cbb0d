"""The host jitter check's analysis: slow units of several processes at the same time are one shared
stall, with the host samples around it; a single process's slow unit is not shared."""
from __future__ import annotations

import os
import time

from servekit.benchmarks.host_jitter import delta, read_host, stalls, summarize


def _units(k: int, slow_at: set[int], t0: float = 1000.0) -> list[dict]:
    """A process's units of 3 ms every 5 ms for 4 s; those at `slow_at` (indices) take 40 ms."""
    return [{"t": t0 + i * 0.005, "wall_ms": 40.0 if i in slow_at else 3.0, "cpu_ms": 3.0,
             "runq_ms": 30.0 if i in slow_at else 0.0, "minflt": 0, "gc_ms": 0.0} for i in range(800)]


def test_slow_units_of_several_processes_make_one_shared_stall_per_period():
    # processes 0-2 stall together every 1.5 s (units 100, 400, 700); process 3 alone once (unit 250)
    units = {k: _units(k, {100, 400, 700}) for k in range(3)}
    units[3] = _units(3, {250})
    samples = [{"t0": 1000.0 + j * 0.1, "t1": 1000.1 + j * 0.1,
                "cpu": {"user": 40, "steal": 30 if j in (5, 20, 35) else 0}, "vm": {"compact_stall": 1 if j == 20 else 0},
                "irq": {}, "procs": {"probe:42": 10, "agent:7": 9 if j in (5, 20, 35) else 0}} for j in range(40)]
    assert [ev["procs"] for ev in stalls(units)] == [[0, 1, 2], [3], [0, 1, 2], [0, 1, 2]]
    s = summarize(units, samples, own={"probe:42"})
    assert s["shared_stalls"] == 3 and s["stalls"] == 4 and s["slow_units"] == 10
    assert s["shared_interval_s"]["median"] == 1.5
    first, second = s["events"][0], s["events"][1]
    assert first["procs"] == [0, 1, 2] and first["worst_ms"] == 40.0 and first["runq_ms"] == 90.0
    assert first["host_cpu_ticks"]["steal"] == 30 and second["host_vm"] == {"compact_stall": 1}
    assert first["busy"][0] == "ours probe:42=20" and "agent:7=9" in first["busy"]
    assert s["slow_extra_split"]["runq_ms"] == 9 * 30 + 30


def test_the_host_sample_reads_this_machine():
    a = read_host()
    me = str(os.getpid())
    mine = f"{a['procs'][me][0]}:{me}"
    # Busy until the host's and this process's CPU ticks have moved (10 ms each: a fixed amount of
    # work may fall inside one tick on a loaded machine and show none).
    deadline = time.monotonic() + 10
    while True:
        sum(i * i for i in range(20_000))
        d = delta(a, read_host())
        if (mine in d["procs"] and sum(d["cpu"].values()) > 0) or time.monotonic() > deadline:
            break
    assert d["t1"] > d["t0"] and sum(d["cpu"].values()) > 0
    assert mine in d["procs"]
