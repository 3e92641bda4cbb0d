"""One fused pass for a decode step's greedy and temperature sampling (``sampling.sample``'s
GREEDY and SAMPLE modes, with the rows' bias and packed grammar masks).

As torch ops inside the captured step, sampling a batch-32 row block of SmolLM2's 49,152 logits
took ~30 kernels over ``(B, V)`` int64 and float tensors: the noise's hash (``_fmix32`` in 16-bit
halves), the Gumbel transform, the bias add, the argmaxes; a grammar row's mask added the unpacking
and the dead-row rule. On an H100 that was 300 µs of a 1.17 ms batch-32 step at temperature > 0,
and 94 µs for a split step's masked greedy sampling. Here each program reads a chunk of one row's
logits, bias and mask words once and keeps running maxima; a second, tiny kernel picks each row's
token from its chunks.

The values are ``sampling.sample``'s bit for bit: the same uint32 hash (here uint32 arithmetic wraps
by itself), libdevice's ``log`` (the CUDA math library's ``logf``, which torch's ``log`` compiles
to), IEEE division by the temperature (``div_rn``), and the first index among equal maxima as
``torch.argmax`` returns it. ``tests/test_triton_sample.py`` checks the tokens against the torch
ops under the Triton interpreter, ``tests/test_triton_sample_cuda.py`` on the GPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from servekit.optimizations.llm import noise

try:
    from triton.language.extra import libdevice
except ImportError:  # Triton < 3.2 kept it under the CUDA backend
    from triton.language.extra.cuda import libdevice

# Compiled, libdevice's log (tl.log is an approximation); the interpreter has no libdevice and runs
# numpy's log, close enough for the CPU tests' tokens.
_PRECISE_LOG = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")

# The noise's constants (noise.py, as sampling.py's torch ops use them), as the kernels take globals.
_FMIX_C1, _FMIX_C2 = tl.constexpr(noise.FMIX_C1), tl.constexpr(noise.FMIX_C2)
_POSITION_MUL = tl.constexpr(noise.POSITION_MUL)
_VOCAB_STRIDE = tl.constexpr(noise.VOCAB_STRIDE)
_GUMBEL_MAX = tl.constexpr(noise.GUMBEL_MAX)
_MIN_TEMPERATURE = tl.constexpr(noise.MIN_TEMPERATURE)

BLOCK = 2048  # tokens a program handles per loop iteration
_PROGRAMS = 264  # ~2 per SM of an H100: rows x chunks aim at this many programs
# Per (row, chunk): greedy and sampled maxima over the live bias, then over the dead row's bias.
_SLOTS = 4


@triton.jit
def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full((), _FMIX_C1, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full((), _FMIX_C2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _log(x):
    if _PRECISE_LOG:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _better(x, s0, best_v, best_i):
    """Block ``x`` (tokens from ``s0``) against the running maximum: only a strictly greater one
    replaces it, so that among equal maxima the earliest token stays (torch.argmax's choice)."""
    m = tl.max(x, axis=0)
    take = m > best_v
    return tl.where(take, m, best_v), tl.where(take, s0 + tl.argmax(x, axis=0, tie_break_left=True), best_i)


# Sizes and strides vary with the batch (first tokens are sampled for however many prompts end in a
# step): not specialized on, so the variants warm-up compiles serve every request.
@triton.jit(do_not_specialize=["V", "chunk", "n_chunks", "stride_l", "stride_bb", "stride_bv", "stride_p",
                               "stride_pos"])
def _chunk_kernel(logits_ptr, bias_ptr, packed_ptr, temp_ptr, seed_ptr, pos_ptr, val_ptr, idx_ptr,
                  V, chunk, n_chunks, stride_l, stride_bb, stride_bv, stride_p, stride_pos,
                  SAMPLED: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk
    end = tl.minimum(start + chunk, V)
    if SAMPLED:
        temp = tl.maximum(tl.load(temp_ptr + row), _MIN_TEMPERATURE)
        seed = tl.load(seed_ptr + row).to(tl.uint32)  # seeds are in [0, 2**32)
        pos = tl.load(pos_ptr + row * stride_pos).to(tl.uint32)  # mod 2**32, as sampling.py masks it
        key = _fmix32(_fmix32(seed) + pos * tl.full((), _POSITION_MUL, tl.uint32))
    neg = float("-inf")
    # Running maxima (value, token); a chunk of only -inf keeps its first token, as argmax does.
    g_v = tl.full((), neg, tl.float32)
    g_i = start
    s_v = g_v
    s_i = start
    gd_v = g_v
    gd_i = start
    sd_v = g_v
    sd_i = start
    for s0 in range(start, end, BLOCK):
        v = s0 + tl.arange(0, BLOCK)
        in_row = v < end
        logit = tl.load(logits_ptr + row * stride_l + v, mask=in_row, other=neg).to(tl.float32)
        bias = tl.load(bias_ptr + row * stride_bb + v * stride_bv, mask=in_row, other=0.0)
        if MASKED:
            word = tl.load(packed_ptr + row * stride_p + v // 32, mask=in_row, other=0)
            allowed = ((word >> (v % 32)) & 1) != 0
            live = tl.where(allowed, bias, neg)
            # sampling.masked_bias: a row whose bias leaves nothing allowed keeps the grammar's mask only.
            dead = tl.where(allowed, tl.where(bias == neg, 0.0, bias), neg)
        else:
            live = bias
        g = tl.where(in_row, logit + live, neg)
        g_v, g_i = _better(g, s0, g_v, g_i)
        if SAMPLED:
            x = _fmix32(key + v.to(tl.uint32) * tl.full((), _VOCAB_STRIDE, tl.uint32))
            u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            gumbel = tl.minimum(-_log(-_log(u)), _GUMBEL_MAX)
            s = tl.where(in_row, tl.math.div_rn(logit + live, temp) + gumbel, neg)
            s_v, s_i = _better(s, s0, s_v, s_i)
        if MASKED:
            gd = tl.where(in_row, logit + dead, neg)
            gd_v, gd_i = _better(gd, s0, gd_v, gd_i)
            if SAMPLED:
                sd = tl.where(in_row, tl.math.div_rn(logit + dead, temp) + gumbel, neg)
                sd_v, sd_i = _better(sd, s0, sd_v, sd_i)
    out = (row * n_chunks + c) * SLOTS
    tl.store(val_ptr + out + 0, g_v)
    tl.store(idx_ptr + out + 0, g_i)
    tl.store(val_ptr + out + 1, s_v)
    tl.store(idx_ptr + out + 1, s_i)
    tl.store(val_ptr + out + 2, gd_v)
    tl.store(idx_ptr + out + 2, gd_i)
    tl.store(val_ptr + out + 3, sd_v)
    tl.store(idx_ptr + out + 3, sd_i)


@triton.jit
def _pick(val_ptr, idx_ptr, base, c, in_range, slot: tl.constexpr, SLOTS: tl.constexpr):
    """Over a row's chunks, one slot's maximum and its token (the first chunk among equal maxima)."""
    v = tl.load(val_ptr + base + c * SLOTS + slot, mask=in_range, other=float("-inf"))
    i = tl.load(idx_ptr + base + c * SLOTS + slot, mask=in_range, other=0)
    j = tl.argmax(v, axis=0, tie_break_left=True)
    return tl.max(v, axis=0), tl.sum(tl.where(c == j, i, 0), axis=0)


@triton.jit(do_not_specialize=["n_chunks"])
def _pick_kernel(val_ptr, idx_ptr, temp_ptr, out_ptr, n_chunks,
                 SAMPLED: tl.constexpr, MASKED: tl.constexpr, CHUNKS_P: tl.constexpr, SLOTS: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_P)
    in_range = c < n_chunks
    base = row * n_chunks * SLOTS
    g_v, token = _pick(val_ptr, idx_ptr, base, c, in_range, 0, SLOTS)
    if SAMPLED:
        _, s_token = _pick(val_ptr, idx_ptr, base, c, in_range, 1, SLOTS)
    if MASKED:
        # Nothing finite under the live bias: the row is dead, its dead-bias maxima count.
        dead = g_v == float("-inf")
        _, gd_token = _pick(val_ptr, idx_ptr, base, c, in_range, 2, SLOTS)
        token = tl.where(dead, gd_token, token)
        if SAMPLED:
            _, sd_token = _pick(val_ptr, idx_ptr, base, c, in_range, 3, SLOTS)
            s_token = tl.where(dead, sd_token, s_token)
    if SAMPLED:
        token = tl.where(tl.load(temp_ptr + row) > 0, s_token, token)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(logits: Tensor, bias: Tensor, temperature: Tensor, seed: Tensor, position: Tensor,
                sampled: bool, packed: Tensor | None = None) -> Tensor:
    """Each row's token ``(B,)`` int64: the argmax of ``logits + bias`` (``sampled`` and the row's
    temperature > 0: of ``(logits + bias) / temperature`` plus the row's Gumbel noise), with
    ``-inf`` where the row's ``packed`` mask forbids a token. ``logits`` ``(B, V)`` with unit
    stride along V, ``bias`` ``(B, V)`` or ``(B, 1)`` float32, ``packed`` ``(B, ceil(V / 32))``
    int32; the per-row tensors ``(B,)``. No host sync: capturable in a CUDA graph."""
    b, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    per_row = triton.cdiv(vocab, BLOCK)
    n_chunks = max(1, min(per_row, triton.cdiv(_PROGRAMS, b)))
    chunk = triton.cdiv(per_row, n_chunks) * BLOCK
    n_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(b * n_chunks * _SLOTS, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(b * n_chunks * _SLOTS, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    masked = packed is not None
    words = packed if masked else idxs  # an unused pointer when there is no mask
    _chunk_kernel[(b, n_chunks)](
        logits, bias, words, temperature, seed, position, vals, idxs,
        vocab, chunk, n_chunks, logits.stride(0), bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0,
        packed.stride(0) if masked else 0, position.stride(0),
        SAMPLED=sampled, MASKED=masked, BLOCK=BLOCK, SLOTS=_SLOTS, num_warps=8)
    # CHUNKS_P from the vocabulary alone (the most chunks a row can have), not from this batch.
    _pick_kernel[(b,)](vals, idxs, temperature, out, n_chunks, SAMPLED=sampled, MASKED=masked,
                       CHUNKS_P=max(2, triton.next_power_of_2(per_row)), SLOTS=_SLOTS, num_warps=1)
    return out
