"""Arithmetic of benchmarks/llm_serve_bench on known timings, and the model-config it archives."""
from __future__ import annotations

from pathlib import Path

import pytest

from servekit.benchmarks.llm_serve_bench import Timing, summarize, variant_config

ROOT = Path(__file__).resolve().parent.parent


def test_summary_of_known_timings() -> None:
    timings = [Timing(200, 0.100, 0.100 + 9 * 0.010, 10, 100, 10, "a"),   # ITL 10 ms, 1 token per chunk
               Timing(200, 0.300, 0.300 + 9 * 0.020, 10, 100, 5, "b"),    # ITL 20 ms, 2 tokens per chunk
               Timing(500, None, None, 0, 0, 0, "", "boom")]
    s = summarize(timings, wall_s=2.0)
    assert (s["requests"], s["failed"], s["errors"], s["completion_tokens"]) == (3, 1, ["boom"], 20)
    assert s["tokens_per_chunk"] == pytest.approx(20 / 15, abs=0.01)
    assert (s["ttft_ms_p50"], s["ttft_ms_p99"]) == (100.0, 300.0)  # nearest rank over 2 values
    assert (s["itl_ms_p50"], s["itl_ms_p99"]) == (10.0, 20.0)
    assert s["tok_per_s_per_seq_p50"] == 50.0 and s["tok_per_s_total"] == 10.0
    assert Timing(200, 0.1, 0.1, 1, 5, 1, "x").itl_s is None  # one token: no inter-token latency
    empty = summarize([Timing(-1, None, None, 0, 0, 0, "", "refused")], 1.0)
    assert empty["failed"] == 1 and empty["ttft_ms_p50"] is None and empty["tok_per_s_total"] == 0.0


def test_variant_config_sets_batching_and_speculation() -> None:
    plain = variant_config(ROOT / "config/models/smollm2-spec.yaml", [1, 4, 16], 10, None)
    assert (plain["batchSize"], plain["maxBatchDelay"]) == (16, 10)
    assert plain["servekit"]["buckets"]["batch_sizes"] == [1, 2, 4, 8, 16] and "speculation" not in plain["servekit"]
    spec = variant_config(ROOT / "config/models/smollm2.yaml", [1, 2], 5, {"heads": "speculator", "max_batch": 2})
    assert spec["servekit"]["buckets"]["batch_sizes"] == [1, 2] and spec["batchSize"] == 2
    assert spec["servekit"]["speculation"] == {"heads": "speculator", "max_batch": 2}
    assert spec["continuousBatching"] is True and plain["continuousBatching"] is True  # as the base configs


def test_continuous_bench_variants_choose_batching_and_drafts() -> None:
    """llm_continuous_bench's model-config per variant: continuous batching, speculation with all
    trained heads or the first --spec-heads of them, buckets up to max_num_seqs."""
    import yaml

    from servekit.benchmarks.llm_continuous_bench import variant_config as continuous_variant

    base = yaml.safe_load((ROOT / "config/models/smollm2-spec.yaml").read_text())
    plain = continuous_variant(base, "continuous", 32)
    assert plain["continuousBatching"] is True and "speculation" not in plain["servekit"]
    assert plain["servekit"]["buckets"]["batch_sizes"] == [1, 2, 4, 8, 16, 32]
    spec = continuous_variant(base, "continuous-spec", 12, spec_max_batch=4)
    assert spec["continuousBatching"] is True and spec["batchSize"] == 12
    assert spec["servekit"]["speculation"] == {"heads": "speculator", "max_batch": 4}  # every trained head
    assert spec["servekit"]["buckets"]["batch_sizes"] == [1, 2, 4, 8, 12]
    three = continuous_variant(base, "continuous-spec", 32, spec_heads=3)
    assert three["servekit"]["speculation"] == {"heads": "speculator", "max_batch": 8, "n_heads": 3}
    assert base["servekit"]["speculation"]["max_batch"] == 8  # the base config is left as it was
