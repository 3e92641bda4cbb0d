"""The runner's refinement stage against a live TorchServe: after the sweep, the winner's bracket
between its best pass and first fail is bisected further, and its capacity moves inside it.

The sleep handler (20 ms per request, 1 worker, batch 1: at most ~50 requests/s) passes at 10
requests/s and cannot meet the SLA at 80; one coarse bisection point, then two refine points.
An in-process reference is asked for, and the report says why a non-embedding model has none.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_run import remote_target, run_sweep

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]


def test_refine_narrows_the_winners_bracket(minilm_server, model_store: Path, tmp_path: Path) -> None:
    sweep = {
        "name": "refine",
        "target": remote_target(minilm_server, model_store),
        "variants": [{"name": "rf-sleep", "model": "sleep", "overrides": {"sleep": {"mean_ms": 20, "sd_ms": 1}},
                      "sweep": {"workers": [1], "batch_size": [1], "max_batch_delay_ms": [0]}}],
        "payloads": {"body": {"text": "x"}},
        # p99 <= 600 ms: at 10 requests/s a window's p99 is its slowest request, and one frontend
        # pause on the loaded test machine (504 ms, seen once) failed the 10 requests/s level; 80
        # requests/s still fails it by seconds (its queue grows by ~30 requests each second).
        "sla": {"p99_ms": 600, "max_error_rate": 0.01},
        "load": {"mode": "open", "levels": [10, 80], "timeout_s": 10,
                 "search": {"precision": 0.9, "max_points": 1, "refine": {"precision": 0.3, "max_points": 2}}},
        # Two agreeing windows of 15+ requests a point: 10 and 80 requests/s are far on either side of
        # the SLA (the handler saturates at ~50), so short windows give the same verdicts.
        "measurement": {"warmup_s": 1, "window_s": 1, "stable_windows": 2, "max_trials": 4,
                        "min_window_requests": 15, "tail_tolerance": 0.6, "inprocess_s": 1},
    }
    rc, out, results = run_sweep(sweep, tmp_path)
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    roles = [(p["role"], p["load"]["level"], p["status"]) for p in points]
    assert [r[:2] for r in roles[:3]] == [("level", 10.0), ("level", 80.0), ("search", 45.0)], roles
    assert roles[0][2] == "pass" and roles[1][2] != "pass", roles
    refined = [r for r in roles if r[0] == "refine"]
    assert len(refined) == 2, roles
    (conf,) = results["configs"]
    before = [r for r in roles if r[0] != "refine"]
    lo = max(level for _, level, status in before if status == "pass")
    hi = min(level for _, level, status in before if status != "pass" and level > lo)
    # every refine point lies inside the coarse bracket, and the bracket only narrows
    assert all(lo < level < hi for _, level, _ in refined), roles
    assert lo <= conf["load_at_capacity"] < conf["first_failing_load"] <= hi
    assert conf["search"].startswith("refined:") and rc == 0
    assert results["inprocess"]["skipped"].startswith("in-process reference only for embedding models")
    report = (out / "report.md").read_text()
    assert "brackets are refined to 30%" in report and "In-process reference not measured" in report
