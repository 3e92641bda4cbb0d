"""The packed-prefill attention kernel (optimizations/kernels/triton_prefill.py) under the Triton
interpreter on CPU, in fp32, against attention computed request by request: several requests
packed end to end (one spanning several query blocks, one a later chunk of a prompt whose earlier
tokens are in its cache row, at a position that is not a multiple of the key block), grouped-query
heads, a sliding window, unused blocks of the table, keys and values as strided views of one
projection (as the model's fused q/k/v gives them). The kernel also stores this step's keys and
values in the cache: covered tokens at their (row, position), padding nowhere.
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


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    q, k, v = (t.reshape(N, -1, HEAD_DIM) for t in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                             KV_HEADS * HEAD_DIM], dim=-1))
    # The caches hold the rows' earlier tokens; where this step's tokens go, stale values.
    k_cache, v_cache = (torch.randn(ROWS, KV_HEADS, SLOTS, HEAD_DIM, generator=gen) for _ in range(2))
    return q, k, v, k_cache, v_cache


def _tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = [(i, off) for i, (_, length, _, _) in enumerate(SEGMENTS) for off in range(0, length, BLOCK_M)]
    block_seq = torch.tensor([b[0] for b in blocks] + [-1] * 4)  # unused entries: programs that exit
    block_off = torch.tensor([b[1] for b in blocks] + [0] * 4)
    return torch.tensor(SEGMENTS).flatten(), block_seq, block_off


@pytest.mark.parametrize("window", [None, 6, 70])
def test_packed_attention_equals_attention_request_by_request(window: int | None) -> None:
    q, k, v, k_cache, v_cache = _inputs()
    assert k.stride(0) != k.shape[1] * HEAD_DIM  # strided views, as the model's fused projection gives them
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for start, length, pos0, row in SEGMENTS:
        expected_k[row, :, pos0:pos0 + length] = k[start:start + length].transpose(0, 1)
        expected_v[row, :, pos0:pos0 + length] = v[start:start + length].transpose(0, 1)
    scale = HEAD_DIM ** -0.5
    got = packed_attention(q, k, v, k_cache, v_cache, *_tables(), scale, window)
    torch.testing.assert_close(got[:217], _reference(q, expected_k, expected_v, scale, window)[:217],
                               atol=1e-5, rtol=1e-5)
    # This step's keys and values are in the cache now, and nothing else there changed (padding
    # tokens are stored nowhere).
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_packed_attention_refuses_a_head_dimension_that_is_not_contiguous() -> None:
    q = torch.randn(8, HEAD_DIM, HEADS).transpose(1, 2)
    kv = torch.randn(8, KV_HEADS, HEAD_DIM)
    cache = torch.zeros(ROWS, KV_HEADS, SLOTS, HEAD_DIM)
    with pytest.raises(ValueError, match="contiguous"):
        packed_attention(q, kv, kv, cache, cache, torch.zeros(4, dtype=torch.int64), torch.tensor([0]),
                         torch.tensor([0]), 1.0)
