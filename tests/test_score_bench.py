"""The auto-benchmark takes rerank sweeps: a cross-encoder folder is archived with the score handler,
and generated texts regroup into TEI /rerank bodies (`query` kept, `texts` of the requested size)
whose texts the harness counts, so that configurations rank by pairs/s."""
from __future__ import annotations

import json

import pytest

from servekit.benchmarks.bench.archives import model_spec
from servekit.benchmarks.bench.payloads import body_texts, load_bodies, regroup
from servekit.benchmarks.bench.schema import Payloads, SchemaError, parse_config
from tiny_classifiers import hf_classifier


def test_rerank_bodies_regroup_into_queries_with_n_documents():
    query = "how do the workers batch"
    bodies = load_bodies(Payloads(generate={"words": [3, 5], "weights": [1.0, 1.0], "count": 9, "seed": 0,
                                            "field": "texts"}, set_keys={"query": query}))
    grouped = [json.loads(b) for b in regroup(bodies, 4)]
    assert len(grouped) == 2 and all(set(b) == {"query", "texts"} and b["query"] == query for b in grouped)
    assert [len(body_texts(b)) for b in grouped] == [4, 4]
    assert grouped[0]["texts"] + grouped[1]["texts"] == [json.loads(b)["texts"] for b in bodies[:8]]


def test_prose_texts_have_the_drawn_lengths_and_a_varied_vocabulary():
    """`text: prose`: runs of English prose of the drawn word counts, with far more distinct words
    than the ~60 of the default vocabulary (what a per-word tokenizer cache meets in service)."""
    sweep = {"name": "p", "target": {"local": {}}, "sla": {"p99_ms": 50},
             "variants": [{"name": "v", "model": "minilm", "baseline": True}]}
    cfg = parse_config({**sweep, "payloads": {"generate": {"words": [20, 60], "count": 300, "field": "texts",
                                                           "text": "prose"}}})
    texts = [json.loads(b)["texts"] for b in load_bodies(cfg.payloads)]
    assert {len(t.split()) for t in texts} == {20, 60}
    assert len({w.lower() for t in texts for w in t.split()}) > 1000
    assert len(set(texts)) > 290
    vocabulary = [json.loads(b)["texts"] for b in load_bodies(Payloads(generate={
        "words": [20, 60], "weights": [1.0, 1.0], "count": 300, "seed": 0, "field": "texts"}))]
    assert len({w for t in vocabulary for w in t.split()}) < 100
    with pytest.raises(SchemaError, match="payloads.generate.text: 'poems' is not one of vocabulary, prose"):
        parse_config({**sweep, "payloads": {"generate": {"words": [20], "text": "poems"}}})


def test_a_cross_encoder_folder_is_archived_with_the_score_handler(tmp_path):
    spec = model_spec(str(hf_classifier(tmp_path / "reranker", "bert")))
    assert spec.kind == "rerank" and spec.handler.name == "score_handler.py"
