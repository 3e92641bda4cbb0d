"""The fused sampling kernel (optimizations/kernels/triton_sample.py) on a GPU, compiled and captured
in a CUDA graph, against ``sampling.sample_torch``: the same token in every row, greedy and
sampled, with bias rows, grammar masks and dead rows, at SmolLM2's and odd vocabulary sizes; and
the Gumbel noise itself bit for bit (libdevice's log is torch's).

    pytest -q tests/test_triton_sample_cuda.py      # on a CUDA machine, in a process of its own
"""
from __future__ import annotations

import pytest
import torch

from compiled_triton import require_compiled_triton

require_compiled_triton()

from servekit.optimizations.kernels.triton_sample import sample_rows  # noqa: E402
from servekit.optimizations.llm.sampling import (GREEDY, SAMPLE, SamplingTensors, sample,  # noqa: E402
                                                  sample_torch, uniform_noise)

DEV = torch.device("cuda")


def _batch(b: int, vocab: int, seed: int, masked: bool) -> tuple[torch.Tensor, SamplingTensors, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(b, vocab, generator=gen, device=DEV) * 4
    temps = ((torch.rand(b, generator=gen, device=DEV) * 1.5) * (torch.rand(b, generator=gen, device=DEV) > 0.25)).tolist()
    bias = torch.zeros(b, vocab, device=DEV)
    bias[:, torch.randint(0, vocab, (vocab // 20,), generator=gen, device=DEV)] = float("-inf")
    bias[:, :8] = torch.randn(8, generator=gen, device=DEV) * 5
    seeds = torch.randint(0, 2**31, (b,), generator=gen, device=DEV).tolist()
    params = SamplingTensors.build(temps, [0] * b, [1.0] * b, seeds, DEV, bias=bias)
    position = torch.randint(0, 8192, (b,), generator=gen, device=DEV)
    packed = None
    if masked:
        words = (vocab + 31) // 32
        packed = torch.randint(-2**31, 2**31 - 1, (b, words), generator=gen, device=DEV, dtype=torch.int64).to(torch.int32)
        packed[::3] = -1
        packed[1::4] = 0
        packed[1::4, 3] = 1 << 5  # one token allowed: 101
        if b > 2:  # a dead row: its one allowed token is forbidden by its bias
            bias[2, 101] = float("-inf")
            packed[2] = 0
            packed[2, 3] = 1 << 5
    return logits, params, position, packed


@pytest.mark.parametrize("vocab", [49152, 151936, 5003])
@pytest.mark.parametrize("masked", [False, True])
def test_same_tokens_as_the_torch_ops(vocab: int, masked: bool) -> None:
    for b in (1, 3, 32, 64):
        for seed in range(5):
            logits, p, pos, packed = _batch(b, vocab, seed, masked)
            for mode in (GREEDY, SAMPLE):
                want = sample_torch(logits, p, pos, mode, packed)
                got = sample(logits, p, pos, mode, packed)  # the kernel, on CUDA
                assert torch.equal(got, want), (b, seed, mode, (got != want).nonzero().flatten().tolist())


def test_the_noise_is_torch_s_bit_for_bit() -> None:
    """Flat logits: the sampled token is the argmax of the Gumbel noise, over 4,096 keys."""
    vocab, b = 49152, 4096
    logits = torch.zeros(b, vocab, device=DEV)
    p = SamplingTensors.build([1.0] * b, [0] * b, [1.0] * b, list(range(b)), DEV)
    pos = torch.arange(b, device=DEV) * 7
    gumbel = (-torch.log(-torch.log(uniform_noise(p.seed, pos, vocab)))).clamp(max=20.0)
    assert torch.equal(sample_rows(logits, p.bias, p.temperature, p.seed, pos, True), gumbel.argmax(dim=-1))


def test_captured_in_a_cuda_graph() -> None:
    logits, p, pos, packed = _batch(32, 49152, 9, True)
    want = {m: sample_torch(logits, p, pos, m, packed) for m in (GREEDY, SAMPLE)}
    for mode in (GREEDY, SAMPLE):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sample(logits, p, pos, mode, packed)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sample(logits, p, pos, mode, packed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[mode]), mode
        pos.add_(1)  # the graph reads the new positions: other noise
        graph.replay()
        assert torch.equal(out, sample_torch(logits, p, pos, mode, packed)), mode
        pos.sub_(1)


def _compiled(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_other_batches_compile_nothing_new() -> None:
    """Warm-up compiles each variant once; a first token sampled for another number of prompts (other
    sizes, chunk counts, strides) must not compile at request time."""
    from servekit.optimizations.kernels import triton_sample as ts

    for b in (1, 32):
        for masked in (False, True):
            logits, p, pos, packed = _batch(b, 49152, 0, masked)
            for mode in (GREEDY, SAMPLE):
                sample(logits, p, pos, mode, packed)
    before = _compiled(ts._chunk_kernel), _compiled(ts._pick_kernel)
    assert min(before) >= 4  # greedy or sampled, masked or not: the count is real
    for b in (2, 3, 5, 12, 17, 31, 64):
        for masked in (False, True):
            logits, p, pos, packed = _batch(b, 49152, b, masked)
            for mode in (GREEDY, SAMPLE):
                sample(logits, p, pos, mode, packed)
    p1 = SamplingTensors.build([0.7] * 3, [0] * 3, [1.0] * 3, [1, 2, 3], DEV)  # a (B, 1) bias
    sample(torch.randn(3, 2, 49152, device=DEV)[:, 0], p1, torch.arange(6, device=DEV).view(3, 2)[:, 0], SAMPLE)
    assert (_compiled(ts._chunk_kernel), _compiled(ts._pick_kernel)) == before
