"""A custom encoder through the embedding handler: with a mock TorchServe context (token-id inputs,
`dimensions`, `prompt_name`, each bad request its own 4xx) and through a live TorchServe serving
its `servekit archive PATH` archive, compared with sentence-transformers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mock_context import batch, mock_context, status
from tiny_encoders import SHORT, TEXTS, reference, st_model

PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return st_model(tmp_path_factory.mktemp("models") / "custom", "mpnet", "mean", dense=24, prompts=PROMPTS)


@pytest.fixture(scope="module")
def handler(model_dir, one_thread):
    from servekit.handlers.embedding_handler import EmbeddingHandler

    cfg = {"batchSize": 8, "servekit": {"device": "cpu", "buckets": {"batch_sizes": [1, 4], "seq_lens": [8, 24]}}}
    ctx = mock_context(model_dir, cfg, batch_size=8, model_name="custom")
    h = EmbeddingHandler()
    h.initialize(ctx)
    return h, ctx


def vectors(answer: str) -> np.ndarray:
    return np.array([d["embedding"] for d in json.loads(answer)["data"]])


def test_token_ids_dimensions_and_prompts_in_one_batch(handler, model_dir):
    h, ctx = handler
    tokens = h.runner.encode_texts(SHORT)
    route = "v1/embeddings"
    out = h.handle(batch(ctx, [
        (route, {"input": SHORT}),
        (route, {"input": tokens}),                               # list of token arrays
        (route, {"input": tokens[0]}),                            # one token array
        (route, {"input": SHORT, "dimensions": 10}),
        (route, {"input": SHORT, "prompt_name": "query"}),
        ("", {"text": SHORT, "prompt_name": "passage"}),
        (route, {"input": [[1, 2], [3, h.runner.vocab_size]]}),   # an id outside the vocabulary
        (route, {"input": SHORT, "prompt_name": "nope"}),
        (route, {"input": [5, "x"]}),
        (route, {"input": SHORT, "dimensions": 25}),
        (route, {"input": tokens, "prompt_name": "query"}),
    ]), ctx)
    assert [status(ctx, i) for i in range(11)] == [200] * 6 + [400] * 5
    ref = reference(model_dir, SHORT).numpy()
    texts = vectors(out[0])
    np.testing.assert_allclose(texts, ref, atol=2e-5)
    np.testing.assert_allclose(vectors(out[1]), texts, atol=1e-6)
    np.testing.assert_allclose(vectors(out[2]), texts[:1], atol=1e-6)
    short = vectors(out[3])
    assert short.shape == (4, 10)  # first 10 coordinates, made unit length again (the model normalises)
    np.testing.assert_allclose(short, texts[:, :10] / np.linalg.norm(texts[:, :10], axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(vectors(out[4]), reference(model_dir, SHORT, prompt_name="query").numpy(), atol=2e-5)
    np.testing.assert_allclose(json.loads(out[5])["embeddings"],
                               reference(model_dir, SHORT, prompt_name="passage").numpy(), atol=2e-5)
    errors = [json.loads(out[i])["error"]["message"] for i in range(6, 11)]
    assert f"'input[1][1]' is token id {h.runner.vocab_size}, outside this model's vocabulary" in errors[0]
    assert f"unknown prompt_name 'nope'; this model's prompts: {', '.join(sorted(h.runner.spec.prompts))}" in errors[1]
    assert {'passage', 'query'} <= set(h.runner.spec.prompts)
    assert "'input[1]' must be a token id" in errors[2]
    assert "'dimensions' must be between 1 and 24" in errors[3]
    assert "'prompt_name' applies to text inputs" in errors[4]


def test_dimensions_are_not_normalised_for_a_model_that_does_not(tmp_path, one_thread):
    from servekit.handlers.embedding_handler import EmbeddingHandler

    path = st_model(tmp_path / "raw", "distilbert", "cls", normalize=False)
    ctx = mock_context(path, {"servekit": {"device": "cpu", "buckets": {"batch_sizes": [1, 4], "seq_lens": [24]}}},
                       batch_size=4)
    h = EmbeddingHandler()
    h.initialize(ctx)
    full, cut = h.handle(batch(ctx, [("v1/embeddings", {"input": SHORT}),
                                     ("v1/embeddings", {"input": SHORT, "dimensions": 8})]), ctx)
    np.testing.assert_allclose(vectors(cut), vectors(full)[:, :8], atol=1e-7)
    np.testing.assert_allclose(vectors(full), reference(path, SHORT).numpy(), atol=2e-5)
    assert not np.allclose(np.linalg.norm(vectors(full), axis=1), 1.0, atol=1e-3)


@pytest.mark.server
def test_live_torchserve_serves_an_archived_custom_encoder(model_dir, tmp_path):
    """`servekit archive PATH` -> TorchServe -> the OpenAI client: sentence-transformers' numbers."""
    from openai import OpenAI

    from servekit.archive import archive_path
    from servekit.torchserve import TorchServe

    store = tmp_path / "store"
    mar, written = archive_path(model_dir, store, name="custom", device="cpu", compress=False)
    assert mar.exists() and written == store / "custom.yaml"
    with TorchServe(tmp_path / "run", store) as ts:
        ts.register("custom.mar", "custom", batch_size=4, max_batch_delay_ms=20, workers=1)
        client = OpenAI(base_url=f"{ts.inference_url}/predictions/custom/1.0/v1", api_key="unused")
        resp = client.embeddings.create(model="custom", input=TEXTS, encoding_format="float")
        got = torch.tensor([d.embedding for d in resp.data])
        torch.testing.assert_close(got, reference(model_dir, TEXTS), atol=2e-5, rtol=1e-4)
        query = client.embeddings.create(model="custom", input=SHORT, encoding_format="float",
                                         extra_body={"prompt_name": "query"})
        torch.testing.assert_close(torch.tensor([d.embedding for d in query.data]),
                                   reference(model_dir, SHORT, prompt_name="query"), atol=2e-5, rtol=1e-4)
        ids = client.embeddings.create(model="custom", input=[[5, 6, 7], [8]], encoding_format="float", dimensions=12)
        assert [len(d.embedding) for d in ids.data] == [12, 12]
