"""The auto-benchmark takes rerank sweeps: a cross-encoder folder is archived with the score handler,
and generated texts regroup into TEI /rerank bodies (`query` kept, `texts` of the requested size)
whose texts the harness counts, so that configurations rank by pairs/s."""
from __future__ import annotations

import json

from servekit.benchmarks.bench.archives import model_spec
from servekit.benchmarks.bench.payloads import body_texts, load_bodies, regroup
from servekit.benchmarks.bench.schema import Payloads
from tiny_classifiers import hf_classifier


def test_rerank_bodies_regroup_into_queries_with_n_documents():
    query = "how do the workers batch"
    bodies = load_bodies(Payloads(generate={"words": [3, 5], "weights": [1.0, 1.0], "count": 9, "seed": 0,
                                            "field": "texts"}, set_keys={"query": query}))
    grouped = [json.loads(b) for b in regroup(bodies, 4)]
    assert len(grouped) == 2 and all(set(b) == {"query", "texts"} and b["query"] == query for b in grouped)
    assert [len(body_texts(b)) for b in grouped] == [4, 4]
    assert grouped[0]["texts"] + grouped[1]["texts"] == [json.loads(b)["texts"] for b in bodies[:8]]


def test_a_cross_encoder_folder_is_archived_with_the_score_handler(tmp_path):
    spec = model_spec(str(hf_classifier(tmp_path / "reranker", "bert")))
    assert spec.kind == "rerank" and spec.handler.name == "score_handler.py"
