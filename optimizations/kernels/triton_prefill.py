"""Attention of a packed prefill in one Triton kernel: the tokens of several requests in one flat
batch, each attending over its own earlier tokens, with this step's keys and values written into
the KV cache by the same kernel.

The queries, keys and values come packed (``(N, heads, head_dim)``, request after request, no
padding between them). A request's earlier tokens (the chunks of its prompt that earlier steps
prefilled, or a prefix the cache already held) are read from its KV-cache row (``(rows,
n_kv_heads, slots, head_dim)``); its tokens of this step are read from the packed keys and values
themselves, and the first query head of each group also stores them into the row for later steps.
Reading this step's keys from the packed tensors instead of the cache is what lets the cache write
live in this kernel: no program reads a slot that another program of the same launch writes, so
nothing has to be written before the launch (before, a scatter per layer for keys and one for
values did that: 60 launches in a 30-layer model's forward).

One program computes one block of ``BLOCK_M`` queries of one request for one query head: flash
attention's online softmax (base 2), first over the cache row's slots before the chunk, then over
the chunk's own keys up to each query, causal only in the block on the diagonal. Key blocks that
every query of the block sees whole skip the masks.

Which request a program block serves comes from a block table the host builds per step
(``block_seq[i]``: request index or -1, ``block_off[i]``: first query of the block within the
request) and a per-request table ``seq[s] = (first packed token, tokens, first position, cache
row)``. Everything shape-like is data, so one compiled kernel serves every packing, and a CUDA
graph of a whole packed forward replays for any mix of requests that fits its token bucket.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M = 64  # queries per program (also the block table's unit: see packed.py)
BLOCK_N = 64  # keys per iteration; equal to BLOCK_M, so the diagonal is one key block


@triton.jit
def _attend(q, k, v, seen, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """One key block's step of the online softmax (scores in base 2)."""
    qk = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A query whose keys so far all lie outside its window has no maximum yet: subtract 0, not -inf.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
    p = tl.math.exp2(qk - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_whole(q, k_base, v_base, stride_k, stride_v, lo, hi, d, m_i, l_i, acc, qk_scale,
                  BLOCK_N: tl.constexpr):
    """Key blocks ``lo .. hi`` (whole blocks) that every query of the block sees: no masks."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + n[:, None] * stride_k + d[None, :])
        v = tl.load(v_base + n[:, None] * stride_v + d[None, :])
        m_i, l_i, acc = _attend(q, k, v, None, m_i, l_i, acc, qk_scale, False)
    return m_i, l_i, acc


@triton.jit
def _packed_attention(Q, K, V, KC, VC, O, SEQ, BLOCK_SEQ, BLOCK_OFF,
                      stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                      stride_cb, stride_ch, stride_cn, stride_on, stride_oh,
                      qk_scale, window,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      WINDOWED: tl.constexpr):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(BLOCK_SEQ + blk)
    if s >= 0:
        off = tl.load(BLOCK_OFF + blk)
        start = tl.load(SEQ + s * 4)
        length = tl.load(SEQ + s * 4 + 1)
        pos0 = tl.load(SEQ + s * 4 + 2)
        row = tl.load(SEQ + s * 4 + 3)
        m = off + tl.arange(0, BLOCK_M)  # the block's queries, as indices within the chunk
        valid = m < length
        d = tl.arange(0, HEAD_DIM)
        kv_head = h // GROUP
        k_packed = K + start * stride_kn + kv_head * stride_kh
        v_packed = V + start * stride_vn + kv_head * stride_vh
        kc_row = KC + row * stride_cb + kv_head * stride_ch
        vc_row = VC + row * stride_cb + kv_head * stride_ch
        if h % GROUP == 0:  # one program per kv head stores the block's own keys and values
            kb = tl.load(k_packed + m[:, None] * stride_kn + d[None, :], mask=valid[:, None])
            vb = tl.load(v_packed + m[:, None] * stride_vn + d[None, :], mask=valid[:, None])
            tl.store(kc_row + (pos0 + m)[:, None] * stride_cn + d[None, :], kb, mask=valid[:, None])
            tl.store(vc_row + (pos0 + m)[:, None] * stride_cn + d[None, :], vb, mask=valid[:, None])
        q = tl.load(Q + (start + m)[:, None] * stride_qn + h * stride_qh + d[None, :], mask=valid[:, None], other=0.0)
        qpos = pos0 + m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # 1. The request's earlier tokens, slots [lo, pos0) of its cache row: before every query here.
        lo = 0
        full_end = pos0 // BLOCK_N * BLOCK_N
        if WINDOWED:  # from the key block of the block's first query's window; every block masked
            lo = tl.maximum(pos0 + off - window + 1, 0) // BLOCK_N * BLOCK_N
            full_end = lo
        m_i, l_i, acc = _attend_whole(q, kc_row, vc_row, stride_cn, stride_cn, lo, full_end, d, m_i, l_i, acc,
                                      qk_scale, BLOCK_N)
        for n0 in range(full_end, pos0, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            inside = n < pos0
            k = tl.load(kc_row + n[:, None] * stride_cn + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(vc_row + n[:, None] * stride_cn + d[None, :], mask=inside[:, None], other=0.0)
            seen = inside[None, :]
            if WINDOWED:
                seen = seen & (n[None, :] > qpos[:, None] - window)
            m_i, l_i, acc = _attend(q, k, v, seen, m_i, l_i, acc, qk_scale, True)
        # 2. The chunk's own tokens, from the packed keys: whole blocks before the diagonal, then it.
        jlo = 0
        diag = off
        if WINDOWED:
            jlo = tl.maximum(off - window + 1, 0) // BLOCK_N * BLOCK_N
            diag = jlo
        m_i, l_i, acc = _attend_whole(q, k_packed, v_packed, stride_kn, stride_vn, jlo, diag, d, m_i, l_i, acc,
                                      qk_scale, BLOCK_N)
        end = tl.minimum(off + BLOCK_M, length)
        for j0 in range(diag, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            inside = j < end
            k = tl.load(k_packed + j[:, None] * stride_kn + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_packed + j[:, None] * stride_vn + d[None, :], mask=inside[:, None], other=0.0)
            seen = j[None, :] <= m[:, None]
            if WINDOWED:
                seen = seen & (j[None, :] > m[:, None] - window)
            m_i, l_i, acc = _attend(q, k, v, seen, m_i, l_i, acc, qk_scale, True)
        out = acc / l_i[:, None]
        tl.store(O + (start + m)[:, None] * stride_on + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=valid[:, None])


def packed_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, seq: Tensor,
                     block_seq: Tensor, block_off: Tensor, scale: float, window: int | None = None) -> Tensor:
    """q ``(N, n_heads, head_dim)``, k / v ``(N, n_kv_heads, head_dim)`` (any strides but a
    contiguous head dimension); caches ``(rows, n_kv_heads, slots, head_dim)``; ``seq`` ``(S, 4)``
    int64; ``block_seq`` / ``block_off`` ``(blocks,)`` int64. Stores each covered token's k / v at
    (its request's row, its position) and returns the attention ``(N, n_heads, head_dim)``; tokens
    that no block covers (padding) are neither stored nor computed: their rows of the result are
    left as allocated."""
    n, n_heads, head_dim = q.shape
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache)) or k_cache.stride() != v_cache.stride():
        raise ValueError("packed_attention needs the head dimension contiguous and k/v caches of one layout")
    out = torch.empty_like(q)
    group = n_heads // k_cache.shape[1]
    _packed_attention[(block_seq.shape[0], n_heads)](
        q, k, v, k_cache, v_cache, out, seq, block_seq, block_off,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        scale * math.log2(math.e), window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, WINDOWED=bool(window), num_warps=4)
    return out
