"""The embedding plan's GPU paths (fp16, torch.compile, CUDA graphs per bucket) on every encoder
family servekit reads: the same code paths MiniLM's GPU plan takes, with each family's position
ids, embeddings and layer layout. The CPU tests prove the fp32 eager path equals
sentence-transformers; here the compiled, captured fp16 path must equal that eager path on the GPU
and stay on its captured buckets. Needs a CUDA device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servekit.optimizations.embed.runner import EmbeddingRunner
from servekit.optimizations.plan import parse_plan
from tiny_encoders import TEXTS, hf_encoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet")


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_captured_fp16_equals_eager_fp32(family: str, tmp_path: Path) -> None:
    folder = hf_encoder(tmp_path / family, family, max_positions=80)
    eager = EmbeddingRunner(folder, parse_plan({"device": "cuda", "precision": "fp32"}))
    graphs = EmbeddingRunner(folder, parse_plan({"device": "cuda", "precision": "fp16", "compile": "default",
                                                 "cuda_graphs": True, "buckets": {"batch_sizes": [1, 4, 8]}}))
    assert not graphs.downgrades and "cudagraphs" in graphs.plan.label()  # nothing fell back to eager
    # Every captured bucket's replay was timed at warm-up, and chunks are cut by those times.
    stats = graphs.report()["buckets"]
    assert stats and all(b["replay_ms"] is not None and b["replay_ms"] > 0 for b in stats)
    texts = TEXTS * 3  # 18 texts in several chunks, long ones beyond the 64-token bucket
    ref = eager.embed(texts)
    got = graphs.embed(texts)
    cos = torch.nn.functional.cosine_similarity(got.float(), ref.float())
    assert cos.min().item() > 0.999, cos
    single = graphs.embed(texts[:1])
    assert torch.nn.functional.cosine_similarity(single.float(), ref[:1].float()).item() > 0.999
    assert graphs.recompiles() == 0
    chunks = graphs.chunks(graphs.tokenize(texts)[0])
    assert sorted(i for c in chunks for i in c.indices) == list(range(len(texts)))
    assert all((c.batch, c.seq) in graphs.forward.captured for c in chunks)  # only captured shapes run


@pytest.mark.parametrize("family", ["modernbert", "nomic"])
def test_rotary_encoders_compiled_captured_fp16_equal_eager_fp32(family: str, tmp_path: Path) -> None:
    """ModernBERT (alternating global and sliding-window layers) and Nomic BERT take the same GPU
    plan: compiled, captured fp16 buckets equal the eager fp32 path and stay on captured shapes."""
    from tiny_encoders import nomic_st_model, st_model

    folder = (st_model(tmp_path / family, "modernbert", "mean") if family == "modernbert"
              else nomic_st_model(tmp_path / family))
    eager = EmbeddingRunner(folder, parse_plan({"device": "cuda", "precision": "fp32"}), golden_texts=TEXTS)
    graphs = EmbeddingRunner(folder, parse_plan({"device": "cuda", "precision": "fp16", "compile": "default",
                                                 "cuda_graphs": True, "buckets": {"batch_sizes": [1, 4, 8]}}),
                             golden_texts=TEXTS)
    assert not graphs.downgrades and "cudagraphs" in graphs.plan.label()
    texts = TEXTS * 3
    cos = torch.nn.functional.cosine_similarity(graphs.embed(texts).float(), eager.embed(texts).float())
    assert cos.min().item() > 0.999, cos
    assert graphs.recompiles() == 0
    chunks = graphs.chunks(graphs.tokenize(texts)[0])
    assert all((c.batch, c.seq) in graphs.forward.captured for c in chunks)
