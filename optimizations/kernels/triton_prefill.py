"""Attention of a packed prefill in one Triton kernel: the tokens of several requests in one flat
batch, each attending over its own KV-cache row up to its own position.

The queries come packed (``(N, n_heads, head_dim)``, request after request, no padding between
them); keys and values are read straight from the cache (``(rows, n_kv_heads, slots, head_dim)``),
where the packed forward has just written this step's tokens, so a later chunk of a long prompt
sees the chunks before it without any gather. One program computes one block of ``BLOCK_M``
queries of one request for one query head: flash attention's online softmax over the request's
cache row, from slot 0 to the block's last position, causal within the block.

Which request a program block serves comes from a block table the host builds per step
(``block_seq[i]``: request index or -1, ``block_off[i]``: first query of the block within the
request) and a per-request table ``seq[s] = (first packed token, tokens, first position, cache
row)``. Everything shape-like is data, so one compiled kernel serves every packing, and a CUDA
graph of a whole packed forward replays for any mix of requests that fits its token bucket.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 64  # queries per program (also the block table's unit: see packed.py)
BLOCK_N = 64  # keys per iteration


@triton.jit
def _packed_attention(Q, K, V, O, SEQ, BLOCK_SEQ, BLOCK_OFF,
                      stride_qn, stride_qh, stride_kb, stride_kh, stride_kn, stride_on, stride_oh,
                      scale, window,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(BLOCK_SEQ + blk)
    if s >= 0:
        off = tl.load(BLOCK_OFF + blk)
        start = tl.load(SEQ + s * 4)
        length = tl.load(SEQ + s * 4 + 1)
        pos0 = tl.load(SEQ + s * 4 + 2)
        row = tl.load(SEQ + s * 4 + 3)
        m = off + tl.arange(0, BLOCK_M)
        valid = m < length
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (start + m)[:, None] * stride_qn + h * stride_qh + d[None, :], mask=valid[:, None], other=0.0)
        qpos = pos0 + m
        kv_head = h // GROUP
        k_base = K + row * stride_kb + kv_head * stride_kh
        v_base = V + row * stride_kb + kv_head * stride_kh
        end = pos0 + tl.minimum(off + BLOCK_M, length)  # one past the block's last position
        # Sliding-window layers start at the first key block inside the block's first query's window.
        lo = tl.where(window > 0, tl.maximum(pos0 + off - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n0 in range(lo, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            inside = n < end
            k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_base + n[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale
            seen = n[None, :] <= qpos[:, None]
            if window > 0:
                seen = seen & (n[None, :] > qpos[:, None] - window)
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row whose keys so far all lie outside its window has no maximum yet: subtract 0, not -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + (start + m)[:, None] * stride_on + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=valid[:, None])


def packed_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, seq: Tensor, block_seq: Tensor,
                     block_off: Tensor, scale: float, window: int | None = None) -> Tensor:
    """q ``(N, n_heads, head_dim)`` (last dim contiguous); caches ``(rows, n_kv_heads, slots,
    head_dim)``; ``seq`` ``(S, 4)`` int64; ``block_seq`` / ``block_off`` ``(blocks,)`` int64.
    Returns ``(N, n_heads, head_dim)``; tokens that no block covers (padding) are zero."""
    n, n_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("packed_attention needs the head dimension contiguous and k/v caches of one layout")
    out = torch.zeros_like(q)
    group = n_heads // k_cache.shape[1]
    _packed_attention[(block_seq.shape[0], n_heads)](
        q, k_cache, v_cache, out, seq, block_seq, block_off,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        scale, window or 0, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4)
    return out
