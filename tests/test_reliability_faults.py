"""Faults on a TorchServe of its own: out of memory in inference, a killed worker, a restart.

The archive is test-only (`servekit.benchmarks.faults.build_faulty_archive`): the production handler whose
inference raises torch.OutOfMemoryError for a batch holding a marker word, with `too_long: reject`
and small buckets so that a worker (re)starts quickly on CPU. Nothing of it is in the production handler.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from servekit.benchmarks.faults import (OOM_MARKER, build_faulty_archive, check_with_good, faulty_cases,
                               kill_worker_under_load, oom_isolation, reference_embedder, restart_from_store,
                               worker_identity)
from servekit.torchserve import TorchServe

pytestmark = pytest.mark.server
MODEL = "minilm_faulty"
BUCKETS = {"batch_sizes": [1, 2, 4, 8], "seq_lens": [16, 32, 64, 128]}


@pytest.fixture(scope="module")
def reference():
    return reference_embedder()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory):
    """{'ts': the running server}; the restart test replaces it, teardown stops whichever runs."""
    tmp = tmp_path_factory.mktemp("faults")
    store = tmp / "store"
    build_faulty_archive(store, tmp / "build", BUCKETS, MODEL)
    holder = {"ts": TorchServe(tmp / "run", store).start(), "tmp": tmp}
    try:
        holder["ts"].register(f"{MODEL}.mar", MODEL)
        yield holder
    finally:
        holder["ts"].stop()


def test_out_of_memory_fails_alone_and_the_worker_stays(faulty, reference):
    ts = faulty["ts"]
    r = oom_isolation(ts, MODEL, reference, rounds=2)
    assert r["marker_statuses"] == [507, 507], r
    assert r["marker_messages"] and all("out of memory" in m for m in r["marker_messages"]), r
    assert r["valid_lost"] == 0, r
    assert r["worker_same"], r
    assert r["passed"], r


def test_marker_alone_gets_507_json(faulty):
    ts = faulty["ts"]
    r = requests.post(f"{ts.inference_url}/predictions/{MODEL}", json={"text": f"x {OOM_MARKER}"}, timeout=60)
    assert r.status_code == 507
    assert r.json()["error"]["code"] == "out_of_memory"


def test_text_over_the_largest_bucket_is_rejected_with_413(faulty, reference):
    ts = faulty["ts"]
    case = faulty_cases(BUCKETS["seq_lens"][-1])[0]
    r = check_with_good(ts, MODEL, case, reference)
    assert r["status"] == 413 and r["names_problem"], r
    assert r["good_statuses"] == [200, 200, 200] and r["good_correct"], r
    assert r["worker_same"], r


def test_killed_worker_is_replaced_and_only_in_flight_requests_fail(faulty):
    ts = faulty["ts"]
    r = kill_worker_under_load(ts, MODEL, concurrency=4, before_s=2.0, after_s=1.0, timeout=180,
                               client_timeout=20.0)
    assert r["worker_ready_s"] is not None and r["recovery_s"] is not None, r
    assert r["worker_after"] and r["worker_after"][0][1] != r["worker_before"][0][1], r
    # Closed-loop clients have at most one request each in flight: those in the dead worker's batch
    # get TorchServe's 507 "Worker died."; those it was assembling into a batch get no answer (a
    # TorchServe 0.12 bug, hence the client timeout); the queued ones wait for the new worker.
    assert r["failed_in_flight_at_kill"] <= 4, r
    assert r["failed_sent_after_ready"] == 0, r
    assert set(r["failed_statuses"]) <= {"500", "503", "507", "no_answer"}, r
    assert r["requests"] > r["failed"], r


def test_restart_loads_models_from_the_store(faulty, reference):
    ts = faulty["ts"]
    new, r = restart_from_store(ts, {MODEL: f"{MODEL}.mar"}, Path(faulty["tmp"]) / "run2", reference)
    faulty["ts"] = new
    assert r["passed"], r
    assert worker_identity(new, MODEL), "no worker after restart"
    # The plan and batch settings came from the archive's model-config, not from a register call.
    desc = requests.get(f"{new.management_url}/models/{MODEL}", timeout=10).json()[0]
    assert desc["batchSize"] == 8 and desc["maxBatchDelay"] == 50
