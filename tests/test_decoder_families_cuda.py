"""The LLM plan's GPU paths (bf16, compile, CUDA-graph decode, captured prefill) on every decoder
family of tests/decoder_checkpoints.py: the same shapes and code paths as SmolLM2's, with biases
in the fused projections and scaled RoPE tables. Greedy outputs are equal, or part only at a near-tie
of transformers' fp32 logits (random tiny weights have those, and bf16 or another reduction order
may round either way there). Needs a CUDA device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_checkpoints import FAMILIES, write_checkpoint
from greedy_parity import check_same_or_tie
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.llm.plan import LlmPlan, load_llm_runner, stop_token_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLAN = dict(device="cuda", max_seq_len=128, batch_sizes=(1, 4), prompt_lens=(32, 64), kv_lens=(64, 128))


def _prompts(folder: Path) -> list[list[int]]:
    tok = ChatTokenizer(folder)
    return [tok.encode_chat([{"role": "user", "content": "Name a colour."}]), tok.encode_prompt("The sea is"),
            tok.encode_prompt("x" * 40)]


def _greedy(folder: Path, **plan: object) -> list[list[int]]:
    runner, effective, downgrades = load_llm_runner(str(folder), LlmPlan(**{**PLAN, **plan}))
    assert not downgrades
    stops = stop_token_ids(folder, ChatTokenizer(folder))
    return [c.tokens for c in generate(runner, _prompts(folder),
                                       [SamplingParams(max_tokens=24, stop_token_ids=stops)] * 3)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_and_captured_plans_generate_what_eager_does(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = write_checkpoint(family, tmp_path / family, seed=1, shard=family == "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def logits_after(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    def check(got: list[list[int]], want: list[list[int]], rel_tol: float, what: str) -> None:
        problems = [p for prompt, g, w in zip(_prompts(folder), got, want)
                    if (p := check_same_or_tie(prompt, g, w, logits_after, rel_tol)) is not None]
        assert not problems, f"{family}, {what}: {problems}"

    eager = _greedy(folder, precision="fp32")
    check(_greedy(folder, precision="fp32", cuda_graphs=True), eager, 1e-4, "fp32 graphs")
    check(_greedy(folder, precision="fp32", compile="default", cuda_graphs=True), eager, 1e-4,
          "fp32 compiled graphs")
    # bf16 itself may differ from fp32 on random weights: compiled, captured bf16 against eager bf16.
    check(_greedy(folder, precision="bf16", compile="default", cuda_graphs=True),
          _greedy(folder, precision="bf16"), 2e-2, "bf16 compiled graphs")
