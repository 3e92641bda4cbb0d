"""servekit.optimizations.llm.sampling: greedy, seeded Gumbel sampling, top-k / top-p filters (CPU)."""

from __future__ import annotations


import pytest
import torch

from servekit.optimizations.llm.sampling import (FILTER, GREEDY, SAMPLE, SamplingTensors, sample, sampling_mode,
                                    top_k_top_p_filter, uniform_noise)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _params(b: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> SamplingTensors:
    return SamplingTensors.build([temperature] * b, [top_k] * b, [top_p] * b, [seed + i for i in range(b)])


def test_cpu_noise_is_the_compiled_paths_bit_for_bit() -> None:
    """Eager CPU steps hash the vocabulary in uint32 numpy; CUDA and compiled steps in int64 torch
    ops: the same floats for every seed (2**32 - 1 and values above 2**31 included) and position."""
    from servekit.optimizations.llm import sampling

    seeds = torch.tensor([0, 1, 7, 2**31, 2**32 - 1, 123456789])
    for position in (0, 1, 4095, 2**31 + 5):
        pos = torch.full_like(seeds, position)
        row = sampling._fmix32((sampling._fmix32(seeds) + sampling._mulmod32(pos, 0x9E3779B9)) & sampling._M32)
        for vocab in (1, 49_152, 151_936):
            expected = sampling._vocab_noise(row, vocab)
            assert torch.equal(sampling._vocab_noise_numpy(row, vocab), expected)
            assert torch.equal(uniform_noise(seeds, pos, vocab), expected)


def test_uniform_noise_is_deterministic_in_range_and_uncorrelated() -> None:
    seeds, pos = torch.tensor([0, 1, 2**32 - 1]), torch.tensor([5, 5, 5])
    u = uniform_noise(seeds, pos, 50_000)
    assert torch.equal(u, uniform_noise(seeds, pos, 50_000))
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # Different seed, position or vocab id: different noise.
    assert not torch.equal(u[0], u[1])
    assert not torch.equal(u[0], uniform_noise(seeds, pos + 1, 50_000)[0])
    assert abs(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1].item()) < 0.02
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1].item()) < 0.02


def test_temperature_zero_is_argmax_per_row() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = SamplingTensors.build([0.0, 1.0, 0.0, 1.0], [0] * 4, [1.0] * 4, [1, 2, 3, 4])
    out = sample(logits, params, torch.zeros(4, dtype=torch.int64))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_same_seed_and_position_give_same_token_regardless_of_batch_neighbours() -> None:
    logits = torch.zeros(3, 1000)  # uniform: the token is decided by the noise alone
    pos = torch.tensor([7, 7, 8])
    a = sample(logits, SamplingTensors.build([1.0] * 3, [0] * 3, [1.0] * 3, [42, 43, 42]), pos)
    b = sample(logits[:1], SamplingTensors.build([1.0], [0], [1.0], [42]), pos[:1])
    assert a[0] == b[0]
    assert a[0] != a[1] or a[0] != a[2]  # different seed or position: (almost surely) other tokens


def test_sampling_follows_softmax_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    params = _params(n, temperature=1.0)
    draws = sample(logits.expand(n, -1), params, torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(draws, minlength=6).double() / n
    expected = logits.double().softmax(-1)
    # 4.5 standard errors per cell: fails for a wrong distribution, not by chance.
    tol = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-4
    assert torch.all((freq - expected).abs() < tol), (freq, expected)


def test_temperature_sharpens_distribution() -> None:
    logits = torch.tensor([1.0, 0.0, 0.0, 0.0])
    n = 5000
    cold = sample(logits.expand(n, -1), _params(n, temperature=0.25), torch.zeros(n, dtype=torch.int64))
    hot = sample(logits.expand(n, -1), _params(n, temperature=4.0), torch.zeros(n, dtype=torch.int64))
    assert (cold == 0).float().mean() > 0.9  # softmax(4, 0, 0, 0)[0] = 0.95
    assert (hot == 0).float().mean() < 0.4  # softmax(0.25, 0, 0, 0)[0] = 0.30


def test_top_k_top_p_match_transformers_warpers() -> None:
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=gen) * 3
    cases = [(0, 1.0), (1, 1.0), (10, 1.0), (0, 0.9), (0, 0.3), (20, 0.5)]
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases])
    got = top_k_top_p_filter(logits, top_k, top_p)
    for i, (k, p) in enumerate(cases):
        ref = logits[i:i + 1]
        if k:
            ref = transformers.TopKLogitsWarper(top_k=k)(None, ref)
        if p < 1.0:
            ref = transformers.TopPLogitsWarper(top_p=p)(None, ref)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref[0])), (k, p)
        kept = ~torch.isinf(got[i])
        assert torch.equal(got[i][kept], logits[i][kept])
    assert (~torch.isinf(got[1])).sum() == 1 and (~torch.isinf(got[2])).sum() == 10


def test_top_p_always_keeps_the_most_likely_token() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    got = top_k_top_p_filter(logits, torch.tensor([0]), torch.tensor([1e-6]))
    assert not torch.isinf(got[0, 0]) and torch.isinf(got[0, 1:]).all()


def test_sampled_tokens_stay_inside_top_k_and_top_p_sets() -> None:
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(5))
    n = 3000
    topk = sample(logits.expand(n, -1), _params(n, temperature=2.0, top_k=5), torch.zeros(n, dtype=torch.int64))
    assert set(topk.tolist()) == set(logits[0].topk(5).indices.tolist())  # all 5 seen, nothing else
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = order[:int((probs[order].cumsum(0) < 0.5).sum()) + 1]
    topp = sample(logits.expand(n, -1), _params(n, temperature=1.0, top_p=0.5), torch.zeros(n, dtype=torch.int64))
    assert set(topp.tolist()) <= set(nucleus.tolist())


def test_sampling_mode_is_chosen_from_the_requests() -> None:
    assert sampling_mode([0.0, 0.0], [0, 50], [1.0, 0.5]) == GREEDY  # filters irrelevant when greedy
    assert sampling_mode([0.0, 0.7], [0, 0], [1.0, 1.0]) == SAMPLE
    assert sampling_mode([0.0, 0.7], [0, 0], [1.0, 0.9]) == FILTER
    assert sampling_mode([0.7, 0.0], [5, 0], [1.0, 1.0]) == FILTER


def test_modes_agree_where_they_overlap() -> None:
    """SAMPLE skips the sort; for rows without top-k/top-p it must draw what FILTER draws."""
    logits = torch.randn(8, 400, generator=torch.Generator().manual_seed(9))
    params = SamplingTensors.build([0.0, 0.5, 1.0, 2.0] * 2, [0] * 8, [1.0] * 8, list(range(8)))
    pos = torch.arange(8)
    assert torch.equal(sample(logits, params, pos, SAMPLE), sample(logits, params, pos, FILTER))
    greedy = SamplingTensors.build([0.0] * 8, [0] * 8, [1.0] * 8, list(range(8)))
    assert torch.equal(sample(logits, greedy, pos, GREEDY), logits.argmax(-1))
