"""A live TorchServe serving a cross-encoder and a classifier archived by `servekit archive PATH`,
over plain HTTP: each kind's answers equal sentence-transformers' / transformers', and bad requests
sent together with good ones (so that TorchServe batches them) get their own 4xx while the good
ones are answered. One server for the module."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from servekit.archive import archive_path
from servekit.torchserve import TorchServe
from tiny_classifiers import DOCUMENTS, QUERIES, TEXTS, ce_scores, cross_encoder, hf_classifier, hf_logits

pytestmark = pytest.mark.server
LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"reranker": cross_encoder(root / "reranker", "xlm-roberta", max_length=24),
            "sentiment": hf_classifier(root / "sentiment", "bert", LABELS)}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory) -> Iterator[TorchServe]:
    store = tmp_path_factory.mktemp("store")
    for name, path in models.items():
        archive_path(path, store, name=name, device="cpu", compress=False)
    with TorchServe(tmp_path_factory.mktemp("run"), store) as ts:
        for name in models:
            # A long delay, so that requests sent together arrive in one batch.
            ts.register(f"{name}.mar", name, batch_size=4, max_batch_delay_ms=300, workers=1)
        yield ts


def post(url: str, body: Any) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def together(url: str, bodies: list[Any]) -> list[tuple[int, Any]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: post(url, b), bodies))


def test_rerank_over_http_is_crossencoder_predict(server, models):
    base = f"{server.inference_url}/predictions/reranker/1.0/v1"
    q = QUERIES[1]
    status, body = post(f"{base}/rerank", {"query": q, "documents": DOCUMENTS, "top_n": 4, "return_documents": True})
    assert status == 200, body
    expected = ce_scores(models["reranker"], [(q, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda k: -float(expected[k]))[:4]
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[k] for k in order]
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in body["results"]]), expected[order],
                               atol=1e-4, rtol=0)
    status, body = post(f"{base}/score", {"text_1": q, "text_2": DOCUMENTS})
    assert status == 200
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), expected, atol=1e-4, rtol=0)


def test_classify_over_http_is_the_transformers_classifier(server, models):
    url = f"{server.inference_url}/predictions/sentiment/1.0"
    status, body = post(f"{url}/v1/classify", {"input": TEXTS})
    assert status == 200, body
    probs = torch.softmax(hf_logits(models["sentiment"], TEXTS), -1)
    torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]]), probs, atol=1e-4, rtol=0)
    assert [d["label"] for d in body["data"]] == [LABELS[int(k)] for k in probs.argmax(1)]
    status, body = post(f"{url}/predict", {"inputs": TEXTS[0]})
    assert status == 200 and body[0]["label"] == LABELS[int(probs[0].argmax())]


def test_bad_requests_get_their_own_4xx_while_batch_mates_are_answered(server, models):
    url = f"{server.inference_url}/predictions/reranker/1.0/v1/rerank"
    good = {"query": QUERIES[0], "documents": DOCUMENTS[:3]}
    answers = together(url, [good, {"query": "q", "documents": []}, {"query": "q", "documents": ["d"] * 10_000},
                             {"query": "q", "documents": ["d", {"text": 3}]}, good])
    assert [s for s, _ in answers] == [200, 400, 413, 400, 200], answers
    assert "'documents' is an empty list" in answers[1][1]["error"]["message"]
    assert "'documents' has 10000 items; at most 1000 per request" in answers[2][1]["error"]["message"]
    assert "'documents[1].text' must be a string, got int" in answers[3][1]["error"]["message"]
    expected = ce_scores(models["reranker"], [(QUERIES[0], d) for d in DOCUMENTS[:3]])
    for _, body in (answers[0], answers[4]):
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        torch.testing.assert_close(torch.tensor([got[k] for k in range(3)]), expected, atol=1e-4, rtol=0)
    text = urllib.request.urlopen(f"{server.metrics_url}/metrics", timeout=10).read().decode()
    errors = {s.labels.get("ErrorType"): s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name.startswith("servekit_request_errors")}
    assert {"empty_input", "too_many_inputs", "invalid_type"} <= set(errors), errors
    totals = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.labels.get("ModelName") == "reranker" and s.name in ("servekit_batches_total", "servekit_requests_total")}
    assert totals["servekit_batches_total"] < totals["servekit_requests_total"], totals  # they did share batches
