"""CUDA-only: the engine with captured decode and packed-prefill graphs (and compiled steps) gives what eager
gives. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import Completion, generate
from servekit.optimizations.models.llama import LlamaConfig, init_random

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 40, 17)]


PARAMS = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3),
          SamplingParams(max_tokens=30, temperature=1.0, seed=4)]


def _completions(params: list[SamplingParams], **switches: bool | int) -> list[Completion]:
    model = init_random(LlamaConfig.tiny(), seed=0).cuda()
    runner = LlamaRunner(model, max_seq_len=128, batch_buckets=(1, 4), prefill_buckets=(16, 64),
                         kv_buckets=(32, 64), **switches)
    runner.warmup()
    return generate(runner, _prompts(), params)


def _run(**switches: bool | int) -> list[list[int]]:
    return [c.tokens for c in _completions(PARAMS, **switches)]


def test_cuda_graph_decode_equals_eager() -> None:
    assert _run(cuda_graphs=True) == _run()


def test_compiled_and_captured_decode_equals_eager() -> None:
    # fp32 tiny model: fused kernels may differ in the last bits, so compare greedy/sampled tokens
    # (equal unless a near-tie flips, which random weights at fp32 make very unlikely).
    assert _run(compile_prefill=True, compile_decode=True, cuda_graphs=True) == _run()


def test_captured_speculative_steps_equal_plain_decoding() -> None:
    from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig, SpeculativeDecoding

    model = init_random(LlamaConfig.tiny(), seed=0).cuda()
    runner = LlamaRunner(model, max_seq_len=128, batch_buckets=(1, 4), prefill_buckets=(16, 64),
                         kv_buckets=(32, 64), cuda_graphs=True)
    heads = Speculator(SpeculatorConfig.for_model(model, 3)).reset_parameters(seed=1, random_out=True)
    runner.warmup()
    runner.speculation = SpeculativeDecoding(runner, heads, max_spec_batch=4)
    runner.speculation.warmup()
    batcher = ContinuousBatcher(runner)
    batcher.warmup()
    got = generate(runner, _prompts(), PARAMS, batcher=batcher)
    assert batcher.spec_stats.proposed[0] > 0
    assert [c.tokens for c in got] == _run()


def test_logprobs_and_penalties_with_graphs_and_compile_equal_eager() -> None:
    """A FULL-mode batch (uncaptured steps on a runner whose other steps are graphs, compiled
    blocks) gives eager's tokens, logprobs and penalised choices."""
    params = [SamplingParams(max_tokens=20, logprobs=3, presence_penalty=0.5),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, logprobs=0),
              SamplingParams(max_tokens=20, frequency_penalty=1.0)]
    got = _completions(params, compile_prefill=True, compile_decode=True, cuda_graphs=True)
    want = _completions(params)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert len(got[0].logprobs) == 20 and got[2].logprobs == []
    for g, w in zip(got[0].logprobs + got[1].logprobs, want[0].logprobs + want[1].logprobs):
        assert abs(g.logprob - w.logprob) < 1e-3 and [t for t, _ in g.top] == [t for t, _ in w.top]


def test_continuous_batching_with_graphs_and_compile_equals_solo_eager() -> None:
    """Requests joining a running batch on a compiled, captured runner (packed prefill captured)
    get what each gets alone from the eager runner."""
    from servekit.optimizations.llm.continuous import ContinuousBatcher

    model = init_random(LlamaConfig.tiny(), seed=0).cuda()
    runner = LlamaRunner(model, max_seq_len=128, batch_buckets=(1, 4), prefill_buckets=(16, 64), kv_buckets=(32, 64),
                         compile_prefill=True, compile_decode=True, cuda_graphs=True)
    runner.warmup()
    batcher = ContinuousBatcher(runner)
    batcher.warmup()
    prompts, tokens = _prompts(), {i: [] for i in range(3)}
    batcher.add(0, prompts[0], PARAMS[0])
    for _ in range(4):
        for key, u in batcher.step().items():
            tokens[key] += u.tokens
    batcher.add(1, prompts[1], PARAMS[1])
    batcher.add(2, prompts[2], PARAMS[2])
    while batcher.has_work:
        for key, u in batcher.step().items():
            tokens[key] += u.tokens
    assert [tokens[i] for i in range(3)] == _run()


def test_speculation_inside_the_continuous_batch_with_graphs_and_compile_equals_solo_eager() -> None:
    """Captured verify steps on the slots of a compiled, captured continuous runner (plain steps
    above the speculative batch bucket, a sampled request riding along) give each request what the
    eager runner gives it alone."""
    from servekit.optimizations.llm.continuous import ContinuousBatcher
    from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig, SpeculativeDecoding

    model = init_random(LlamaConfig.tiny(), seed=0).cuda()
    runner = LlamaRunner(model, max_seq_len=128, batch_buckets=(1, 2, 4), prefill_buckets=(16, 64),
                         kv_buckets=(32, 64), compile_prefill=True, compile_decode=True, cuda_graphs=True)
    runner.warmup()
    heads = Speculator(SpeculatorConfig.for_model(model, 3)).reset_parameters(seed=1, random_out=True)
    runner.speculation = SpeculativeDecoding(runner, heads, max_spec_batch=2, compile_verify=True)
    runner.speculation.warmup()
    batcher = ContinuousBatcher(runner)
    batcher.warmup()
    prompts, tokens, drafts = _prompts(), {i: [] for i in range(3)}, set()

    def step() -> None:
        drafts.add(batcher._inflight[0].drafts if batcher._inflight else None)
        for key, u in batcher.step().items():
            tokens[key] += u.tokens

    batcher.add(0, prompts[0], PARAMS[0])
    for _ in range(4):
        step()
    batcher.add(1, prompts[1], PARAMS[1])
    for _ in range(4):
        step()
    batcher.add(2, prompts[2], PARAMS[2])  # three busy slots: plain steps
    while batcher.has_work:
        step()
    assert {0, 3} <= drafts and batcher.spec_stats.proposed[0] > 0
    assert [tokens[i] for i in range(3)] == _run()


def test_captured_split_steps_equal_eager() -> None:
    """A row with min_tokens (a bias that changes with each token) runs the batch in split steps
    (forward graph, bias loaded, sampling graph): captured, they give what eager gives."""
    from servekit.optimizations.llm.grammar import DecodeConstraint

    vocab = LlamaConfig.tiny().vocab_size
    held = DecodeConstraint(min_tokens=8, vocab_size=vocab, stop_token_ids=(7,))
    params = [SamplingParams(max_tokens=30, stop_token_ids=(7,), constraint=held)] + PARAMS[1:]
    graphed = [c.tokens for c in _completions(params, cuda_graphs=True)]
    assert graphed == [c.tokens for c in _completions(params)]
    assert 7 not in graphed[0][:8]
