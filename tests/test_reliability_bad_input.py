"""Bad input against the live embedding handler (the session's TorchServe, batch 8 / 50 ms).

Every kind of bad request in `servekit.benchmarks.faults.bad_inputs()` is sent at the same instant as three
valid requests, so that TorchServe hands them to the handler as one batch. The bad one must get its
own 4xx (or 413) with a JSON message naming the problem; the valid ones must get the same vectors as
an in-process reference; the worker must be the same process afterwards.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from servekit.benchmarks.faults import (MAX_REQUEST_SIZE, bad_inputs, check_with_good, good_requests,
                               reference_embedder, send_together, vectors, worker_identity)

pytestmark = pytest.mark.server
MODEL = "minilm"
CASES = bad_inputs()


@pytest.fixture(scope="module")
def reference():
    return reference_embedder()


@pytest.fixture(scope="module")
def worker(minilm_server):
    """The worker (id, pid) before the first bad request: every test checks it is still the same."""
    before = worker_identity(minilm_server, MODEL)
    assert before and before[0][1], before
    return before


def test_matrix_has_at_least_twenty_kinds():
    assert len({c.name for c in CASES}) == len(CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_fails_alone(minilm_server, reference, worker, case):
    r = check_with_good(minilm_server, MODEL, case, reference, worker)
    assert r["status"] == case.status, r
    assert r["names_problem"], f"message does not name the problem ({case.expect!r}): {r['message']}"
    if case.expect:
        assert r["json_error"], r
    assert r["good_statuses"] == [200, 200, 200], r
    assert r["good_correct"], r
    assert r["worker_same"], f"worker changed: {worker} -> {worker_identity(minilm_server, MODEL)}"
    if case.answered_by == "handler":
        assert r["batches_used"] >= 1, r  # the handler ran (and reported its batch)


def test_bad_and_good_requests_share_one_batch(minilm_server, reference, worker):
    """The premise of the matrix: sent at once, the four requests reach the handler as one batch."""
    case = next(c for c in CASES if c.name == "lone_surrogate")
    used = [check_with_good(minilm_server, MODEL, case, reference, worker)["batches_used"] for _ in range(3)]
    assert 1 in used, f"batches per round of 4 requests: {used}"


def test_handler_errors_have_the_openai_shape(minilm_server):
    r = requests.post(f"{minilm_server.inference_url}/predictions/{MODEL}/1.0/v1/embeddings",
                      json={"input": []}, timeout=60)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"}
    assert err == {"message": "'input' is an empty list", "type": "invalid_request_error", "code": "empty_input"}


def test_torchserve_own_answers_are_documented(minilm_server):
    """The frontend answers these before any worker: its own JSON shape, or an empty 413."""
    base = minilm_server.inference_url
    r = requests.post(f"{base}/predictions/no_such_model", json={"text": "a"}, timeout=60)
    assert r.status_code == 404
    assert r.json() == {"code": 404, "type": "ModelNotFoundException", "message": "Model not found: no_such_model"}
    r = requests.post(f"{base}/predictions/{MODEL}", data=b"x" * (MAX_REQUEST_SIZE + 1),
                      headers={"Content-Type": "text/plain"}, timeout=60)
    assert r.status_code == 413 and r.content == b""
    r = requests.post(f"{base}/predictions/{MODEL}", data=b"x" * (MAX_REQUEST_SIZE - 1000),
                      headers={"Content-Type": "text/plain"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "input_too_long"


def test_text_over_the_largest_bucket_is_truncated_by_default(minilm_server, reference):
    """too_long: truncate (the default plan): 200, and the vector of the text cut at 256 tokens."""
    long_text = " ".join(["reliability"] * 600)
    r = requests.post(f"{minilm_server.inference_url}/predictions/{MODEL}", json={"text": long_text}, timeout=60)
    assert r.status_code == 200
    assert np.abs(vectors(r.json()) - reference([long_text])).max() < 1e-4


def test_many_bad_and_good_requests_at_once(minilm_server, reference, worker):
    """Sixteen requests at once (two full batches), every other one bad: each valid one answered right."""
    base = minilm_server.inference_url
    goods = good_requests(MODEL)
    bad = [c for c in CASES if c.answered_by == "handler" and len(c.body) < 100_000]
    calls, expected = [], []
    for k in range(16):
        if k % 2:
            c = bad[k % len(bad)]
            calls.append((c.method, c.url(base, MODEL), c.body, c.content_type))
            expected.append(c.status)
        else:
            path, body, texts = goods[k // 2 % len(goods)]
            calls.append(("POST", base + path, json.dumps(body).encode(), "application/json"))
            expected.append(texts)
    answers = send_together(calls)
    for a, e in zip(answers, expected):
        if isinstance(e, int):
            assert a.status == e, a
            assert "error" in a.json()
        else:
            assert a.status == 200, a
            assert np.abs(vectors(a.json()) - reference(e)).max() < 1e-4
    assert worker_identity(minilm_server, MODEL) == worker
