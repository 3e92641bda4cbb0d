"""A short soak (15 s) on the session's TorchServe: no unexpected answer, no restart, stable vectors,
bounded memory. `python -m servekit.benchmarks.soak --minutes 10` is the long version (benchmarks/results)."""
from __future__ import annotations

import json

import pytest

from servekit.benchmarks.soak import markdown, run_soak

pytestmark = pytest.mark.server


def test_short_soak(minilm_server, tmp_path):
    # 150 requests in 15 s (in 30 s before, a core idle meanwhile): client 0 sends 5/s, so its 1st
    # and 51st requests (at ~10 s) are the probe checks whose vectors are compared.
    report = run_soak(minilm_server, "minilm", seconds=15, rate=10, concurrency=2, sample_every=3)
    (tmp_path / "soak.json").write_text(json.dumps(report, indent=2))
    print(markdown({**report, "command": "test_short_soak", "machine": {
        "date": "", "cpu": "", "cpu_count": "", "memory_gib": "", "gpu": None, "os": "", "python": "",
        "torch": "", "torchserve": "", "java": ""}}))
    assert report["requests"] >= 20, report["statuses"]
    assert report["errors"] == 0, report["statuses"]
    assert report["valid_lost"] == 0
    assert report["invalid_requests_sent"] + report["valid_requests"] == report["requests"]
    assert report["worker_restarts"] == 0
    assert report["probe"]["checks"] >= 1 and report["probe"]["max_abs_diff"] < 1e-5
    mem = report["memory"]
    assert mem["frontend_rss"]["end_mib"] > 50 and mem["workers_rss"]["end_mib"] > 100  # it measured something
    # Generous bounds for 15 s on a shared CPU: a leak per request would show up as far more.
    assert mem["frontend_rss"]["growth_mib"] < 200, mem
    assert mem["workers_rss"]["growth_mib"] < 300, mem
