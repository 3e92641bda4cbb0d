"""The LLM plan's GPU paths (bf16, compile, CUDA-graph decode, captured prefill) on every decoder
family of tests/decoder_checkpoints.py: the same shapes and code paths as SmolLM2's, with biases
in the fused projections and scaled RoPE tables. Needs a CUDA device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_checkpoints import FAMILIES, write_checkpoint
from servekit.optimizations.chat_template import ChatTokenizer
from servekit.optimizations.generate import SamplingParams, generate
from servekit.optimizations.llm import LlmPlan, load_llm_runner, stop_token_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLAN = dict(device="cuda", max_seq_len=128, batch_sizes=(1, 4), prompt_lens=(32, 64), kv_lens=(64, 128))


def _greedy(folder: Path, **plan: object) -> list[list[int]]:
    runner, effective, downgrades = load_llm_runner(str(folder), LlmPlan(**{**PLAN, **plan}))
    assert not downgrades
    tok = ChatTokenizer(folder)
    stops = stop_token_ids(folder, tok)
    prompts = [tok.encode_chat([{"role": "user", "content": "Name a colour."}]), tok.encode_prompt("The sea is"),
               tok.encode_prompt("x" * 40)]
    return [c.tokens for c in generate(runner, prompts, [SamplingParams(max_tokens=24, stop_token_ids=stops)] * 3)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_and_captured_plans_generate_what_eager_does(family: str, tmp_path: Path) -> None:
    folder = write_checkpoint(family, tmp_path / family, seed=1, shard=family == "qwen2")
    eager = _greedy(folder, precision="fp32")
    assert _greedy(folder, precision="fp32", cuda_graphs=True, prefill_graphs=64) == eager
    assert _greedy(folder, precision="fp32", compile="default", cuda_graphs=True, prefill_graphs=64) == eager
    bf16 = _greedy(folder, precision="bf16", compile="default", cuda_graphs=True, prefill_graphs=64)
    assert bf16 == _greedy(folder, precision="bf16")  # bf16 itself may differ from fp32 on random weights
