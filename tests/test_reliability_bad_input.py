"""Bad input against the live embedding handler (the session's TorchServe, batch 8 / 50 ms).

Every kind of bad request in `servekit.benchmarks.faults.bad_inputs()` is sent at the same instant as three
valid requests, so that TorchServe hands them to the handler as one batch. The bad one must get its
own 4xx (or 413) with a JSON message naming the problem; the valid ones must get the same vectors as
an in-process reference; the worker must be the same process afterwards.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import requests

from conftest import worker_budget
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


# -- work bounded by what the worker does in its responseTimeout ------------------------------------------
PARAGRAPH = " ".join(("servekit answers every valid request within the limits it documents and refuses "
                      "larger ones at once with a clear message naming the limit it applies").split() * 12)[:1700]
OPENAI_URL = "/predictions/{model}/1.0/v1/embeddings"


def _post(ts, body: dict, timeout: float = 180) -> tuple[requests.Response, float]:
    t0 = time.monotonic()
    r = requests.post(ts.inference_url + OPENAI_URL.format(model=MODEL), json=body, timeout=timeout)
    return r, time.monotonic() - t0


@pytest.fixture
def budget(minilm_server, worker) -> dict:
    """The limits the worker derived at start from its measured speeds (its ready line in the model log)."""
    return worker_budget(minilm_server, MODEL)


def test_bulk_beyond_the_budget_is_refused_at_once(minilm_server, worker, budget):
    """1,024 texts of ~280 words (1.7 MB, inside the 2,048-text and 100,000-character limits): on CPU this
    batch outlived responseTimeout (60 s) and took its worker and its batch-mates down. Now it exceeds what
    the worker admits (262,144 tokens, 1.7 M characters) and gets its 413 at once, naming the limit."""
    r, seconds = _post(minilm_server, {"input": [f"{i} {PARAGRAPH}" for i in range(1024)]})
    assert r.status_code == 413, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "request_too_large", err
    assert (f"at most {budget['chars_per_request']} per request" in err["message"]
            or f"at most {budget['tokens_per_request']} tokens per request" in err["message"]), (err, budget)
    assert seconds < 30, f"refused only after {seconds:.1f} s"
    assert worker_identity(minilm_server, MODEL) == worker


def test_a_full_batch_of_requests_at_the_budget_is_answered(minilm_server, reference, worker, budget):
    """Eight requests (the registered batch) each holding as many full-length texts as the limits admit,
    sent at once: all answered right, by the same worker, within the timeout."""
    text = f"0 {PARAGRAPH}"
    n = min(budget["tokens_per_request"] // 256, budget["chars_per_request"] // (len(text) + 8))
    assert n >= 1, budget
    texts = [f"{k} {PARAGRAPH}" for k in range(n)]  # each cut to 256 tokens, its special tokens included
    url = minilm_server.inference_url + OPENAI_URL.format(model=MODEL)
    t0 = time.monotonic()
    answers = send_together([("POST", url, json.dumps({"input": texts}).encode(), "application/json")] * 8,
                            timeout=180)
    seconds = time.monotonic() - t0
    assert [a.status for a in answers] == [200] * 8, [a.body[:200] for a in answers]
    want = reference(texts[:2])
    for a in answers:
        got = vectors(a.json())
        assert got.shape == (n, 384) and np.abs(got[:2] - want).max() < 1e-4
    assert worker_identity(minilm_server, MODEL) == worker
    print(f"8 requests x {n} texts of 256 tokens (budget {budget}) answered in {seconds:.1f} s")


def test_bulk_beyond_the_character_budget_is_refused_before_tokenizing(minilm_server, worker):
    """2,048 texts of 30,000 characters (61 MB, inside every per-text limit): refused on its characters,
    before the tokenizer spends minutes on it."""
    r, seconds = _post(minilm_server, {"input": ["b" * 29_990 + f" {i:08d}" for i in range(2048)]})
    assert r.status_code == 413, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "characters in all" in err["message"], err
    assert seconds < 30, f"refused only after {seconds:.1f} s"
    assert worker_identity(minilm_server, MODEL) == worker


def test_handler_error_bodies_stay_small(minilm_server):
    """Every echoed value is cut to 200 characters (saying so) and every message to 600: a 1 MB value
    comes back as a small 400 that reaches the client, not as a 1 MB body or a connection reset."""
    for case in (c for c in CASES if c.answered_by == "handler" and c.name.startswith("echo_")):
        r = requests.post(case.url(minilm_server.inference_url, MODEL), data=case.body,
                          headers={"Content-Type": case.content_type}, timeout=60)
        assert r.status_code == 400 and len(r.content) < 1000, (case.name, r.status_code, len(r.content))
        assert "truncated" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [("/predictions/{model}", {"text": "a cat sat on the mat"}),
                                        (OPENAI_URL, {"input": "a cat sat on the mat"})])
@pytest.mark.parametrize("ctype", ["application/json", "text/plain"])
def test_a_body_with_a_byte_order_mark_is_read_as_its_json(minilm_server, reference, path, body, ctype):
    """A UTF-8 BOM before the JSON (Windows tools write one): the JSON is read, its text embedded, never the
    raw body as text (which gave a vector at cosine 0.46 to the intended one)."""
    r = requests.post(minilm_server.inference_url + path.format(model=MODEL),
                      data=b"\xef\xbb\xbf" + json.dumps(body).encode(), headers={"Content-Type": ctype}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert np.abs(vectors(r.json()) - reference(["a cat sat on the mat"])).max() < 1e-4


@pytest.mark.parametrize("ctype", ["application/json", "text/plain"])
def test_duplicate_keys_fail_alone_naming_the_key(minilm_server, reference, worker, ctype):
    """TorchServe's worker parses application/json bodies with json.loads, which keeps the last of
    duplicate keys: the worker now hands bodies over unparsed and the handler refuses the duplicate
    (400 naming it) while its batch-mates get their vectors."""
    url = minilm_server.inference_url + OPENAI_URL.format(model=MODEL)
    bodies = [b'{"input": ["a cat sat on the mat"], "model": "minilm", "input": ["dogs bark"]}'] + \
        [json.dumps({"input": ["a cat sat on the mat"]}).encode()] * 3
    answers = send_together([("POST", url, body, ctype) for body in bodies])
    assert [a.status for a in answers] == [400, 200, 200, 200], answers
    error = json.loads(answers[0].body)["error"]
    assert error["code"] == "duplicate_key" and "duplicate key 'input'" in error["message"], error
    for a in answers[1:]:
        assert np.abs(vectors(json.loads(a.body)) - reference(["a cat sat on the mat"])).max() < 1e-4
    assert worker_identity(minilm_server, MODEL) == worker
