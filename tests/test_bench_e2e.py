"""End to end: `servekit bench` against the session's live TorchServe (given as a remote target, so
the run also covers register/scale/unregister through URLs), on CPU.

A tiny sweep: the stock baseline (MiniLM, batch 1) vs servekit's handler (batch 4) at one closed-loop
level each, then the texts-per-request axis. servekit's variants serve a tiny random BERT folder
(what a user's `model:` path gives): what these tests check is the harness (points, ranking, server
counters, report, overlay), which does not depend on the model's size, and a tiny model's workers
load and answer in a fraction of MiniLM's time.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench_run import remote_target, run_sweep

pytestmark = [pytest.mark.server, pytest.mark.timeout(400)]

OVERLAY_KEYS = {"model", "workers", "batch_size", "max_batch_delay_ms", "per_pod_capacity_rps", "target_rps",
                "replicas", "warmup_seconds"}


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Hugging Face BERT folder, the servekit variants' `model:` (a plain encoder folder, not a
    sentence-transformers one: importing sentence-transformers to write it takes longer than the sweep)."""
    from tiny_encoders import hf_encoder

    return str(hf_encoder(tmp_path_factory.mktemp("models") / "enc", "bert"))


def test_minilm_sweep_end_to_end(minilm_server, model_store: Path, tiny_encoder: str, tmp_path: Path) -> None:
    ts = minilm_server
    sweep = {
        "name": "e2e",
        "target": remote_target(ts, model_store),
        "variants": [
            {"name": "e2e-stock", "model": "minilm-stock", "baseline": True,
             "sweep": {"workers": [1], "batch_size": [1], "max_batch_delay_ms": [100]}},
            {"name": "e2e-servekit", "model": tiny_encoder},
        ],
        "sweep": {"workers": [1], "batch_size": [4], "max_batch_delay_ms": [5]},
        "payloads": {"generate": {"words": [4, 16, 48], "weights": [0.5, 0.35, 0.15], "count": 50}},
        "sla": {"p99_ms": 10000, "max_error_rate": 0.02},
        # closed loop at one fixed level: a bounded run however slow the machine (the open-loop search
        # is covered by the known-answer test)
        "load": {"mode": "closed", "levels": [3], "search": False, "timeout_s": 30},
        # The widest stability tolerance the schema takes: on 2 shared cores a point's windows can
        # disagree by more than 30% (seen twice: servekit's only point, at 4x stock's throughput, marked
        # unstable, so stock "won"); stability itself is covered by the known-answer and statistics
        # tests. Two agreeing windows of up to 5, so one stalled window can fall out of the last two.
        "measurement": {"warmup_s": 1, "window_s": 1, "stable_windows": 2, "max_trials": 5,
                        "min_window_requests": 12, "tolerance": 0.9, "tail_tolerance": 0.9, "inprocess_s": 1},
        "deploy": {"target_rps": 100},
    }
    rc, out, results = run_sweep(sweep, tmp_path)
    assert rc == 0, results["answer"]
    assert results["answered"] and results["winner"]["variant"] == "e2e-servekit"
    assert results["baseline"]["variant"] == "e2e-stock"
    assert results["margin_over_baseline"] is None or results["margin_over_baseline"] > 0
    caps = {c["variant"]: c for c in results["configs"]}
    assert caps["e2e-servekit"]["capacity_rps"] > 0 and caps["e2e-servekit"]["batch_size"] == 4

    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert {p["config"]["variant"] for p in points} == {"e2e-stock", "e2e-servekit"}
    for p in points:
        assert {"config", "load", "summary", "percentiles_ms", "errors", "server", "versions", "windows"} <= set(p)
        assert p["versions"]["torchserve"] == "0.12.0"
        raw = np.load(p["raw_file"])["records"]
        assert raw.shape[1] == 5 and len(raw) >= p["summary"]["count"]
        # the host's CPUs were busy serving and loading; the load generator's own share is counted
        assert 0 < p["host"]["busy_pct"] <= 100 and 0 <= p["host"]["loadgen_cores"] <= p["host"]["cpu_count"]
    assert max(p["host"]["loadgen_cores"] for p in points) > 0
    fast = [p for p in points if p["config"]["variant"] == "e2e-servekit" and p["status"] == "pass"]
    assert fast and fast[-1]["server"]["available"]
    assert fast[-1]["server"]["texts_per_batch"] >= 1.0          # from the handler's own counters
    assert fast[-1]["server"]["ts_backend_mean_ms"] > 0         # from TorchServe's counters

    # the in-process reference: the winner's plan timed in this process on the same payload texts
    ip = results["inprocess"]
    assert ip["config"] == results["winner"] and ip["batch_size"] == 4 and ip["texts_per_s"] > 0
    assert ip["texts_per_request"] == 1.0 and ip["plan"].startswith("fp32")
    assert ip["served_fraction"] == pytest.approx(caps["e2e-servekit"]["capacity_rps"] / ip["texts_per_s"], rel=1e-3)

    overlay = json.loads((out / "recommendation.json").read_text())
    assert OVERLAY_KEYS <= set(overlay)
    assert overlay["batch_size"] == 4 and overlay["replicas"] >= 1
    mc = yaml.safe_load((out / "recommended-model-config.yaml").read_text())
    assert mc["batchSize"] == 4 and mc["minWorkers"] == mc["maxWorkers"] == 1 and "servekit" in mc
    report = (out / "report.md").read_text()
    assert "x the stock throughput" in report or "met the SLA at no load" in report
    assert "In-process reference: the winner's plan ran" in report
    assert "| host CPU |" in report
    assert (out / "latency_throughput.png").stat().st_size > 10_000
    # models the run registered are gone again; the session's own model is untouched
    assert ts.api.describe("e2e-servekit") is None
    assert "READY" in [w["status"] for w in ts.api.workers("minilm")]


def test_texts_per_request_axis_end_to_end(minilm_server, model_store: Path, tiny_encoder: str,
                                           tmp_path: Path) -> None:
    """The same texts sent 1 and 4 per request (`/v1/embeddings` bodies): each size is its own
    configuration, the report gives texts/s beside requests/s and ranks by texts/s."""
    ts = minilm_server
    sweep = {
        "name": "e2e-texts",
        "target": remote_target(ts, model_store),
        "variants": [{"name": "e2e-texts", "model": tiny_encoder}],
        "sweep": {"workers": [1], "batch_size": [4], "max_batch_delay_ms": [5], "texts_per_request": [1, 4]},
        "request": {"path": "/predictions/{model}/1.0/v1/embeddings"},
        "payloads": {"generate": {"words": [4, 16], "count": 40}},  # `text` bodies: regrouped as `input`
        "sla": {"p99_ms": 10000, "max_error_rate": 0.02},
        "load": {"mode": "closed", "levels": [2], "search": False, "timeout_s": 30},
        "measurement": {"warmup_s": 1, "window_s": 1, "stable_windows": 2, "max_trials": 5,
                        "min_window_requests": 8, "tolerance": 0.4, "tail_tolerance": 0.8},
    }
    rc, out, results = run_sweep(sweep, tmp_path)
    assert rc == 0, results["answer"]
    configs = {c["texts_per_request"]: c for c in results["configs"]}
    assert set(configs) == {1, 4}
    for n, c in configs.items():
        assert c["status"] == "measured" and c["mean_texts_per_request"] == n
        assert c["capacity_texts_per_s"] == pytest.approx(c["capacity_rps"] * n, rel=1e-3)
    best = max(configs.values(), key=lambda c: c["capacity_texts_per_s"])
    assert results["winner"]["texts_per_request"] == best["texts_per_request"]  # ranked by texts/s
    assert "texts/s" in results["answer"][0]
    bodies = [json.loads(line) for line in (out / "bodies-t4.jsonl").read_text().splitlines()]
    assert bodies and all(len(b["input"]) == 4 for b in bodies)
    # every request was answered with its 4 embeddings: the server counted 4 texts per request
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    # Any measured point of the 4-text configuration: on a busy machine its windows may disagree
    # ("unstable"), which says nothing about what the server counted.
    four = [p for p in points if p["config"].get("texts_per_request") == 4 and p["server"].get("available")]
    assert four and four[-1]["server"]["texts_per_batch"] > four[-1]["server"].get("requests_per_batch", 1.0)
    report = (out / "report.md").read_text()
    assert "| texts/s |" in report and "e2e-texts w1 b4 d5 t4" in report
