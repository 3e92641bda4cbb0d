"""The packed-prefill attention kernel (optimizations/kernels/triton_prefill.py) under the Triton
interpreter on CPU, in fp32, against attention computed request by request: several requests
packed end to end (one spanning several query blocks, one a later chunk of a prompt whose earlier
tokens are in its cache row), grouped-query heads, a sliding window, unused blocks of the table.
On a CUDA machine this module is skipped: tests/test_packed_prefill.py's CUDA test runs the
compiled kernel (see test_triton_decode.py for why the interpreter is process-wide)."""
from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA machine: test_packed_prefill.py tests the compiled kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is defined (first import of triton_prefill)
pytest.importorskip("triton")

from servekit.optimizations.kernels.triton_prefill import BLOCK_M, packed_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

HEADS, KV_HEADS, HEAD_DIM, ROWS, SLOTS = 4, 2, 16, 5, 200
# (first packed token, tokens, first position, cache row): 7 fresh tokens, 150 fresh (three query
# blocks), a 40-token chunk at position 110 of row 2, 20 fresh tokens; 3 padding tokens at the end.
SEGMENTS = [(0, 7, 0, 0), (7, 150, 0, 3), (157, 40, 110, 2), (197, 20, 0, 1)]
N = 220


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
    out = torch.zeros_like(q)
    group = HEADS // KV_HEADS
    for start, length, pos0, row in SEGMENTS:
        span = pos0 + length
        keys = k_cache[row, :, :span].repeat_interleave(group, 0)
        values = v_cache[row, :, :span].repeat_interleave(group, 0)
        scores = torch.einsum("thd,hsd->hts", q[start:start + length], keys) * scale
        slots, qpos = torch.arange(span), pos0 + torch.arange(length)[:, None]
        seen = slots[None] <= qpos
        if window:
            seen &= slots[None] > qpos - window
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[start:start + length] = torch.einsum("hts,hsd->thd", probs, values)
    return out


@pytest.mark.parametrize("window", [None, 6, 70])
def test_packed_attention_equals_attention_request_by_request(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(ROWS, KV_HEADS, SLOTS, HEAD_DIM, generator=gen) for _ in range(2))
    q = torch.randn(1, HEADS, N, HEAD_DIM, generator=gen)[0].transpose(0, 1)  # (N, heads, D), as the model lays it out
    blocks = [(i, off) for i, (_, length, _, _) in enumerate(SEGMENTS) for off in range(0, length, BLOCK_M)]
    block_seq = torch.tensor([b[0] for b in blocks] + [-1] * 4)  # unused entries: programs that exit
    block_off = torch.tensor([b[1] for b in blocks] + [0] * 4)
    seq = torch.tensor(SEGMENTS).flatten()
    scale = HEAD_DIM ** -0.5
    got = packed_attention(q, k_cache, v_cache, seq, block_seq, block_off, scale, window)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, scale, window), atol=1e-5, rtol=1e-5)
    assert got[217:].abs().sum() == 0  # padding tokens: no block attends for them


def test_packed_attention_refuses_a_head_dimension_that_is_not_contiguous() -> None:
    q = torch.randn(8, HEAD_DIM, HEADS).transpose(1, 2)
    cache = torch.zeros(ROWS, KV_HEADS, SLOTS, HEAD_DIM)
    with pytest.raises(ValueError, match="contiguous"):
        packed_attention(q, cache, cache, torch.zeros(4, dtype=torch.int64), torch.tensor([0]), torch.tensor([0]), 1.0)
