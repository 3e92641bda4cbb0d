"""End to end: `servekit bench` drives the LLM chat handler with streamed answers, on CPU.

The sweep builds its variant archive the normal way (`model:` the folder of conftest's
`tiny_smollm2`, a tiny random model in SmolLM2's format: what is checked is the harness's streamed
measurement, not SmolLM2's speed; SmolLM2's CPU model-config plus a `plan:` override that turns on
speculative decoding with two heads, and `speculator:` naming the heads `tiny_smollm2_heads`
trained), registers it on the session's live TorchServe (a remote target), and measures one
closed-loop level. Speculative steps send several tokens in one chunk, so token counts must come
from the usage chunk, not from counting chunks.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench_run import remote_target, run_sweep
from servekit.benchmarks.bench.stats import LLM_FIELDS

pytestmark = [pytest.mark.server, pytest.mark.timeout(400)]

MAX_TOKENS = 12
LLM_KEYS = {"ttft_ms", "itl_ms", "tokens_per_s", "tokens_per_s_per_seq", "completion_tokens"}


def test_llm_streaming_sweep_end_to_end(minilm_server, model_store: Path, tiny_smollm2: list[Path],
                                        tiny_smollm2_heads: Path, tmp_path: Path) -> None:
    ts = minilm_server
    heads = tiny_smollm2_heads
    sweep = {
        "name": "llm-e2e",
        "target": remote_target(ts, model_store),
        "variants": [{"name": "e2e-smollm2-spec", "model": str(tiny_smollm2[0].parent),
                      "config": "config/models/smollm2-cpu.yaml",
                      "plan": {"buckets": {"batch_sizes": [1, 2]}, "speculation": {"n_heads": 2, "max_batch": 2}},
                      "speculator": str(heads), "baseline": True}],
        "sweep": {"workers": [1], "batch_size": [2], "max_batch_delay_ms": [20]},
        "request": {"path": "/predictions/{model}/1.0/v1/chat/completions", "stream": "sse"},
        "payloads": {"file": "benchmarks/payloads/chat.jsonl", "set": {"max_tokens": MAX_TOKENS}},
        "sla": {"p99_ms": 60000, "ttft_p99_ms": 30000, "itl_p99_ms": 5000},
        "load": {"mode": "closed", "levels": [2], "search": False, "timeout_s": 60},
        # a handful of requests per window: stability is not what this test is about
        "measurement": {"warmup_s": 1.5, "window_s": 1.5, "stable_windows": 2, "max_trials": 3, "tolerance": 0.5,
                        "min_window_requests": 3},
    }
    rc, out, results = run_sweep(sweep, tmp_path)
    assert rc == 0, results["answer"]

    (point,) = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert point["status"] == "pass", point["reasons"]
    assert point["server"]["plan"] == ["fp32+spec2"]  # the heads were packed and loaded
    llm = point["llm"]
    assert LLM_KEYS <= set(llm) and llm == point["summary"]["llm"]
    for figure in ("ttft_ms", "itl_ms"):
        assert 0 < llm[figure]["p50"] <= llm[figure]["p90"] <= llm[figure]["p99"] < 30000
    assert llm["tokens_per_s"] > 0 and llm["tokens_per_s_per_seq"] > 0
    assert llm["ttft_ms"]["p99"] < point["percentiles_ms"]["p99"]  # the first token comes before the answer ends

    raw = np.load(point["raw_file"])
    assert tuple(raw["fields"]) == LLM_FIELDS
    r = raw["records"]
    intended, start, end, status, first, last, tokens = r[:, 0], r[:, 1], r[:, 2], r[:, 3], r[:, 5], r[:, 6], r[:, 7]
    assert np.all(status == 200)
    assert np.all((start <= first) & (first <= last) & (last <= end))  # TTFT < request latency, per request
    assert np.all((tokens >= 1) & (tokens <= MAX_TOKENS))
    assert tokens.max() > 1
    t0, t1 = point["segment_s"]
    seg = (intended >= t0) & (intended < t1)
    assert seg.sum() == point["summary"]["count"]
    assert llm["completion_tokens"] == tokens[seg].sum()
    # output tokens/s of the point = completion tokens of its requests over its measured span
    assert llm["tokens_per_s"] == pytest.approx(tokens[seg].sum() / (t1 - t0), rel=1e-3)
    assert llm["tokens_per_s"] == pytest.approx(point["summary"]["throughput"] * llm["completion_tokens_mean"],
                                                rel=1e-3)
    multi = seg & (tokens > 1)
    itl = (last[multi] - first[multi]) * 1000 / (tokens[multi] - 1)
    assert llm["itl_ms"]["p50"] == pytest.approx(np.percentile(itl, 50, method="inverted_cdf"), rel=1e-3)
    assert llm["tokens_per_s_per_seq"] == pytest.approx(1000 / llm["itl_ms"]["p50"], rel=1e-3)

    config = results["configs"][0]
    assert config["llm"]["ttft_ms"]["p99"] == llm["ttft_ms"]["p99"]
    overlay = json.loads((out / "recommendation.json").read_text())
    assert overlay["llm"]["tokens_per_s"] == llm["tokens_per_s"] and overlay["sla"]["ttft_p99_ms"] == 30000
    report = (out / "report.md").read_text()
    assert "| TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/s | tok/s/seq |" in report
    assert "output tokens/s" in results["answer"][0]
    assert ts.api.describe("e2e-smollm2-spec") is None
