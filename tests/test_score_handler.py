"""The score handler with a mock TorchServe context (real Context, real metrics cache): every route's
answer shape and values against sentence-transformers / transformers, and each bad request of a
batch its own 4xx while its batch-mates are answered."""
from __future__ import annotations

import json

import pytest
import torch

from mock_context import batch, mock_context, status
from tiny_classifiers import DOCUMENTS, QUERIES, TEXTS, ce_scores, cross_encoder, hf_classifier, hf_logits

LABELS = ("toxic", "insult", "threat")
SERVEKIT = {"device": "cpu", "buckets": {"batch_sizes": [1, 4], "seq_lens": [16, 24]},
            "limits": {"max_texts_per_request": 100}}


def make_handler(path, servekit=SERVEKIT):
    from servekit.handlers.score_handler import ScoreHandler

    ctx = mock_context(path, {"batchSize": 8, "servekit": servekit}, batch_size=8, model_name="m")
    h = ScoreHandler()
    h.initialize(ctx)
    return h, ctx


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, one_thread):
    path = cross_encoder(tmp_path_factory.mktemp("models") / "ce", "bert", max_length=24)
    return (path, *make_handler(path))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, one_thread):
    path = hf_classifier(tmp_path_factory.mktemp("models") / "cls", "distilbert", LABELS, "multi_label_classification")
    return (path, *make_handler(path))


def test_rerank_score_and_bad_requests_in_one_batch(reranker):
    path, h, ctx = reranker
    q = QUERIES[0]
    out = h.handle(batch(ctx, [
        ("v1/rerank", {"query": q, "documents": DOCUMENTS, "top_n": 3, "return_documents": True, "model": "x"}),
        ("v1/rerank", {"query": q, "documents": [{"text": d} for d in DOCUMENTS]}),
        ("v1/rerank", {"query": q, "documents": []}),
        ("v1/rerank", {"query": q, "documents": ["a"] * 10_000}),
        ("v1/rerank", {"query": q, "documents": ["a", 5]}),
        ("v1/score", {"text_1": q, "text_2": DOCUMENTS}),
        ("v1/score", {"text_1": [q, QUERIES[1]], "text_2": DOCUMENTS[:2]}),
        ("v1/score", {"text_1": [q, q], "text_2": DOCUMENTS[:3]}),
        ("rerank", {"query": q, "texts": DOCUMENTS, "return_text": True}),
        ("v1/models", None),
        ("v1/embeddings", {"input": "x"}),
        ("v1/rerank", {"query": "  ", "documents": ["a"]}),
    ]), ctx)
    assert [status(ctx, i) for i in range(12)] == [200, 200, 400, 413, 400, 200, 200, 400, 200, 200, 404, 400]
    expected = ce_scores(path, [(q, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda k: -float(expected[k]))
    top = json.loads(out[0])
    assert top["model"] == "x" and top["usage"]["total_tokens"] > 0
    assert [r["index"] for r in top["results"]] == order[:3]
    assert [r["document"]["text"] for r in top["results"]] == [DOCUMENTS[k] for k in order[:3]]
    torch.testing.assert_close(torch.tensor([r["relevance_score"] for r in top["results"]]), expected[order[:3]],
                               atol=1e-4, rtol=0)
    every = json.loads(out[1])["results"]
    assert [r["index"] for r in every] == order and all("document" not in r for r in every)
    errors = [json.loads(out[i])["error"]["message"] for i in (2, 3, 4, 7, 10, 11)]
    assert "'documents' is an empty list" in errors[0]
    assert "'documents' has 10000 items; at most 100 per request" in errors[1]
    assert "'documents[1]' must be a string, got int" in errors[2]
    assert "'text_1' has 2 texts and 'text_2' 3" in errors[3]
    assert "unknown route 'v1/embeddings'" in errors[4]
    assert "'query' is empty" in errors[5]
    one_to_many = json.loads(out[5])
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCUMENTS)))
    torch.testing.assert_close(torch.tensor([d["score"] for d in one_to_many["data"]]), expected, atol=1e-4, rtol=0)
    pairs = json.loads(out[6])["data"]
    torch.testing.assert_close(torch.tensor([d["score"] for d in pairs]),
                               ce_scores(path, list(zip(QUERIES, DOCUMENTS[:2]))), atol=1e-4, rtol=0)
    tei = json.loads(out[8])
    assert [r["index"] for r in tei] == order and tei[0]["text"] == DOCUMENTS[order[0]]
    assert json.loads(out[9])["data"][0]["id"] == "m"


def test_classify_and_predict_shapes(classifier):
    path, h, ctx = classifier
    out = h.handle(batch(ctx, [
        ("v1/classify", {"input": TEXTS}),
        ("v1/classify", {"input": TEXTS[0], "raw_scores": True}),
        ("predict", {"inputs": TEXTS[1]}),
        ("predict", {"inputs": TEXTS[:2], "raw_scores": True}),
        ("", {"inputs": TEXTS[0]}),
        ("v1/rerank", {"query": "a", "documents": ["b"]}),
        ("v1/score", {"text_1": "a", "text_2": "b"}),
        ("v1/classify", {"input": TEXTS, "top_n": 2}),
    ]), ctx)
    assert [status(ctx, i) for i in range(8)] == [200] * 5 + [400] * 3
    logits = hf_logits(path, TEXTS, max_length=h.runner.max_tokens)
    probs = torch.sigmoid(logits)  # multi-label: each label on its own
    data = json.loads(out[0])["data"]
    assert [d["num_classes"] for d in data] == [3] * len(TEXTS)
    assert [d["label"] for d in data] == [LABELS[int(k)] for k in probs.argmax(1)]
    torch.testing.assert_close(torch.tensor([d["probs"] for d in data]), probs, atol=1e-4, rtol=0)
    raw = json.loads(out[1])["data"][0]
    torch.testing.assert_close(torch.tensor(raw["logits"]), logits[0], atol=1e-4, rtol=0)
    single = json.loads(out[2])
    assert [x["score"] for x in single] == sorted((x["score"] for x in single), reverse=True)
    assert {x["label"]: x["score"] for x in single} == pytest.approx(dict(zip(LABELS, probs[1].tolist())), abs=1e-4)
    many = json.loads(out[3])
    assert len(many) == 2 and {x["label"]: x["score"] for x in many[1]} == pytest.approx(
        dict(zip(LABELS, logits[1].tolist())), abs=1e-4)
    plain = json.loads(out[4])  # no route: TEI's predict for a classifier
    assert {x["label"]: x["score"] for x in plain} == pytest.approx(dict(zip(LABELS, probs[0].tolist())), abs=1e-4)
    assert "needs a cross-encoder (one label" in json.loads(out[5])["error"]["message"]
    assert "unknown field 'top_n'" in json.loads(out[7])["error"]["message"]


def test_too_long_pairs_rejected_when_asked(reranker, tmp_path):
    path, h, ctx = reranker
    long_doc = DOCUMENTS[4]
    out = h.handle(batch(ctx, [("rerank", {"query": "a", "texts": ["b", long_doc], "truncate": False}),
                               ("rerank", {"query": "a", "texts": ["b", long_doc]}),
                               ("rerank", {"query": "a", "texts": ["b"], "truncate": False})]), ctx)
    assert [status(ctx, i) for i in range(3)] == [413, 200, 200]
    assert "input 1 is longer than the 24 tokens" in json.loads(out[0])["error"]["message"]
    strict = make_handler(path, {**SERVEKIT, "limits": {"too_long": "reject"}})[0]
    out = strict.handle(batch(ctx, [("v1/rerank", {"query": "a", "documents": ["b", long_doc]}),
                                    ("v1/rerank", {"query": "a", "documents": ["b"]})]), ctx)
    assert [status(ctx, i) for i in range(2)] == [413, 200]
