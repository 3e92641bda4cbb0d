"""The fused sampling kernel (optimizations/kernels/triton_sample.py) under the Triton interpreter on
CPU, against ``sampling.sample_torch`` (the torch ops it replaces on CUDA): the same token for every
row, greedy and sampled, with logit_bias, grammar masks, dead rows and odd vocabulary sizes.

The interpreter is chosen by ``TRITON_INTERPRET=1`` when the kernels are defined, for the whole
process: on a CUDA machine this module is skipped and test_triton_sample_cuda.py runs the
compiled kernel instead."""
from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA machine: test_triton_sample_cuda.py tests the compiled kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (first import of triton_sample)
pytest.importorskip("triton")

from servekit.optimizations.kernels import triton_sample as ts  # noqa: E402
from servekit.optimizations.llm.sampling import (GREEDY, SAMPLE, SamplingTensors, sample_torch,  # noqa: E402
                                                  uniform_noise)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _rows(b: int, vocab: int, seed: int, temperatures: list[float], bias: str = "none") -> tuple[torch.Tensor, SamplingTensors, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, vocab, generator=gen) * 3
    if bias == "rows":
        rows = torch.zeros(b, vocab)
        rows[:, torch.randint(0, vocab, (vocab // 10,), generator=gen)] = float("-inf")  # logit_bias -100 / stops
        rows[:, :5] += torch.randn(5, generator=gen) * 10
        bias_t = rows
    else:
        bias_t = torch.zeros(b, 1)
    params = SamplingTensors.build(temperatures, [0] * b, [1.0] * b,
                                   torch.randint(0, 2**32, (b,), generator=gen).tolist(), bias=bias_t)
    position = torch.randint(0, 5000, (b,), generator=gen)
    return logits, params, position


def _kernel(logits: torch.Tensor, p: SamplingTensors, position: torch.Tensor, mode: str,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    return ts.sample_rows(logits, p.bias, p.temperature, p.seed, position, mode == SAMPLE, packed)


@pytest.mark.parametrize("vocab", [1000, 4096 + 37])
@pytest.mark.parametrize("bias", ["none", "rows"])
def test_same_tokens_as_the_torch_ops(vocab: int, bias: str) -> None:
    temps = [0.0, 0.7, 1.0, 1.5, 0.0, 0.3]
    for seed in range(3):
        logits, p, pos = _rows(len(temps), vocab, seed, temps, bias)
        for mode in (GREEDY, SAMPLE):
            got = _kernel(logits, p, pos, mode)
            assert got.dtype == torch.int64
            assert got.tolist() == sample_torch(logits, p, pos, mode).tolist(), (seed, mode)
    # Sampled rows really sample: over positions, a flat row's draws spread over the vocabulary.
    flat = torch.zeros(1, vocab)
    p1 = SamplingTensors.build([1.0], [0], [1.0], [7])
    draws = {int(_kernel(flat, p1, torch.tensor([i]), SAMPLE)) for i in range(40)}
    assert len(draws) > 30


def test_grammar_masks_and_dead_rows() -> None:
    """Packed masks (bit b of word w allows token 32 w + b) and ``masked_bias``'s rule: a row whose
    bias leaves none of its allowed tokens keeps the grammar's mask only."""
    vocab, temps = 3000, [0.0, 0.9, 0.0, 1.2, 0.5]
    b = len(temps)
    logits, p, pos = _rows(b, vocab, 11, temps, "rows")
    gen = torch.Generator().manual_seed(3)
    words = (vocab + 31) // 32
    packed = torch.randint(-2**31, 2**31, (b, words), generator=gen, dtype=torch.int64).to(torch.int32)
    packed[0] = -1  # no grammar
    packed[1] = 0
    packed[1, 10] = 1 << 3  # one token allowed: 323
    packed[2] = 0
    packed[2, 0] = 0b1010  # tokens 1 and 3, both forbidden by the bias: a dead row
    p.bias[2, 1] = p.bias[2, 3] = float("-inf")
    packed[3] = 0
    packed[3, 5] = 0b111  # tokens 160-162, two of them forbidden by the bias
    p.bias[3, 160] = p.bias[3, 161] = float("-inf")
    p.bias[4, 3000 - 5:] = 50.0  # the bias favours the last tokens, the mask decides
    for mode in (GREEDY, SAMPLE):
        want = sample_torch(logits, p, pos, mode, packed).tolist()
        assert _kernel(logits, p, pos, mode, packed).tolist() == want, mode
    got = _kernel(logits, p, pos, SAMPLE, packed).tolist()
    assert got[1] == 323 and got[2] in (1, 3) and got[3] == 162


def test_ties_take_the_first_token_and_views_work() -> None:
    """torch.argmax's first index among equal maxima, across blocks and chunks; logits as a strided
    view (a verify step's first positions) and positions as a column of a (B, T) tensor."""
    vocab = 3 * ts.BLOCK + 100
    logits = torch.zeros(2, 3, vocab)
    logits[0, 0, [5, ts.BLOCK + 1, 2 * ts.BLOCK + 7]] = 4.0
    logits[1, 0, [2 * ts.BLOCK + 7, 3 * ts.BLOCK + 50]] = 4.0
    p = SamplingTensors.build([0.0, 0.0], [0, 0], [1.0, 1.0], [1, 2])
    positions = torch.arange(6).view(2, 3)
    assert _kernel(logits[:, 0], p, positions[:, -1], GREEDY).tolist() == [5, 2 * ts.BLOCK + 7]
    assert _kernel(torch.full((1, vocab), float("-inf")), SamplingTensors.build([1.0], [0], [1.0], [1]),
                   torch.tensor([0]), SAMPLE).tolist() == [0]


def test_the_noise_is_sampling_py_s() -> None:
    """The kernel draws with the same hash as ``uniform_noise``: logits of -log(-log(u)) of another
    key give other tokens, of this key the argmax of the Gumbel noise itself."""
    vocab = 2048 + 64
    p = SamplingTensors.build([1.0], [0], [1.0], [12345])
    pos = torch.tensor([77])
    gumbel = -torch.log(-torch.log(uniform_noise(p.seed, pos, vocab)))
    assert _kernel(torch.zeros(1, vocab), p, pos, SAMPLE).item() == int(gumbel.argmax())


def test_the_kernels_compile_for_an_h100() -> None:
    """What the interpreter never runs (Triton's compiler down to sm_90 machine code, libdevice's
    log), in a process of its own without the interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_compile_check.py")
    done = subprocess.run([sys.executable, str(script), "--sampling"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 8 sampling kernels for sm_90" in done.stdout
