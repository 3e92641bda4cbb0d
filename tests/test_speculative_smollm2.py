"""Speculative decoding on the real SmolLM2-135M-Instruct weights (fp32, CPU, a few prompts).

Checks that verifying k+1 tokens in one pass gives the same greedy tokens as decoding them one by
one on the real model, for random heads (almost every draft rejected) and for scripted drafts
that are accepted to every length 0..k.
"""

from __future__ import annotations


import pytest
import torch

from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.models.llama import Transformer
from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig, SpeculativeDecoding
from test_speculative_logic import OracleSpeculator, _speculative

pytest.importorskip("gguf")

K = 4
# The chat-template encodings (SmolLM2's tokenizer, default system prompt) of "Why is the sky
# blue?" and "Write a haiku about the sea.", so the test needs no tokenizer.
_SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
           8182, 2, 198, 1, 4093, 198]
PROMPTS = [_SYSTEM + [4898, 314, 260, 6376, 4461, 47, 2, 198, 1, 520, 9531, 198],
           _SYSTEM + [19161, 253, 421, 30614, 563, 260, 3426, 30, 2, 198, 1, 520, 9531, 198]]
EOS = 2


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def model() -> Transformer:
    from servekit.optimizations.models.gguf_weights import find_smollm2_gguf, load_llama_from_gguf

    return load_llama_from_gguf(find_smollm2_gguf(), "cpu", torch.float32)


@pytest.fixture(scope="module")
def base(model: Transformer) -> LlamaRunner:
    return LlamaRunner(model, max_seq_len=128, batch_buckets=(1, 2), prefill_buckets=(64,), kv_buckets=(128,))


def test_random_heads_exact_on_smollm2(base: LlamaRunner, model: Transformer) -> None:
    heads = Speculator(SpeculatorConfig.for_model(model, K)).reset_parameters(seed=3, random_out=True)
    runner = SpeculativeDecoding(base, heads, max_spec_batch=2)
    params = [SamplingParams(max_tokens=20, stop_token_ids=(EOS,))] * 2
    want = generate(base, PROMPTS, params)
    _, got, stats = _speculative(base, runner, PROMPTS, params)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert stats.proposed[0] > 0


def test_scripted_drafts_accepted_as_planned_on_smollm2(base: LlamaRunner) -> None:
    max_tokens = [24, 17]
    refs = [c.tokens for c in generate(base, PROMPTS, [SamplingParams(max_tokens=m + K + 2) for m in max_tokens])]
    plan = lambda row, step: (2 * row + step) % (K + 1)  # noqa: E731
    runner = SpeculativeDecoding(base, OracleSpeculator(K, 49152, refs, plan), max_spec_batch=2)
    runner.draft.fill_(next(t for t in range(49152) if all(t not in ref for ref in refs)))  # stale drafts: wrong
    _, got, stats = _speculative(base, runner, PROMPTS, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert [c.tokens for c in got] == [ref[:m] for ref, m in zip(refs, max_tokens)]
    # Every planned acceptance length occurred, so the longest-prefix rule ran at each length.
    assert all(a > 0 for a in stats.accepted) and stats.mean_accepted_length > 2.5
