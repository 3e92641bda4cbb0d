"""Fused Triton kernels for the decode steps of ``servekit.optimizations.models.llama`` models.

A decode step of a small model is bound by kernel launches, not by bandwidth: SmolLM2-135M runs
~11 kernels per layer (norm, matmul, bias, RoPE, cache write, attention, ...), a few microseconds
each. Here one layer is five kernels (six when attention splits the cache over programs):

1. ``_norm_qkv_rope_kernel``: RMSNorm of the input (every program recomputes its rows' rms:
   ``dim`` values, cheaper than a launch), the fused q/k/v projection (+ bias), RoPE on q and k,
   k and v written into the KV cache at each token's position (cache row ``rows[b]``), q out.
2. ``_attention_kernel``: attention of each row's queries over its cache slots ``<= position``,
   one program per (batch row, kv head, split of the cache) serving all the query heads of that
   kv head (GQA) and all T query tokens of the row; with several splits (long caches, small
   batches: the whole GPU works on one row) ``_attention_reduce_kernel`` merges their partial
   softmaxes (flash-decoding). From ``ATTN_BY_WARP_FROM`` slots on, the autotuner may also pick
   ``_attend_by_warp``: each warp of the program walks its own slots.
3. ``_linear_residual_kernel``: the output projection (+ bias) plus the residual.
4. ``_norm_gate_up_kernel``: RMSNorm fused into the gate/up projection, then SiLU(gate) * up.
5. ``_linear_residual_kernel`` again: the down projection plus the residual.

Rows are tokens: a batch of B rows with T query tokens each (T = 1 for a plain decode step,
k + 1 for a speculative verify step) is M = B * T rows for the matmuls. The matmuls are small-M
GEMMs on tensor cores (``tl.dot`` needs 16 rows: M is padded inside the kernel, never in memory),
or for up to ``GEMV_ROWS`` rows (a decode step at batch 1-4, a verify step of a few drafts) a GEMV
on the CUDA cores; weights in the model's dtype, fp32 accumulation, results
rounded to the model's dtype where the eager model rounds them, so bf16 runs stay close to it.

With programmatic dependent launch (Hopper, ``pdl_supported``) each kernel loads its weights
before it waits for the previous kernel, so a step's chain of short kernels overlaps their
launches and weight loads (see ``_wait_for_previous``).

GEMV, attention and large weights' block sizes are autotuned per shape (M, dims, kv length) on
the first call of each shape (small weights' tl.dot projections have one configuration each, see
``_k_prune``): the
runner's warm-up runs every captured step before its capture, so tuning never happens inside
a CUDA graph capture. Nothing here syncs with the host or reads a device value on the host.
Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tests) each kernel has one, small,
configuration, so the loops over blocks run several times in the tests.
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from servekit.optimizations.models.llama import Transformer, TransformerBlock, WithBlocks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:  # grid dependency control (Triton 3.4+); absent: programmatic dependent launch stays off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def _configs(options: Sequence[dict], interpreted: dict, warps: Sequence[int] = (4,)) -> list[triton.Config]:
    """Autotune candidates (few: each one is a compile at warm-up, per shape class); under the
    interpreter one small configuration, so that the loops over blocks run several times."""
    if INTERPRET:
        return [triton.Config(dict(interpreted), num_warps=4)]
    # K blocks of 512 and more are the one-block candidates: no loop to pipeline, so one stage
    # (the default three would ask for more shared memory than an SM has).
    return [triton.Config(dict(o), num_warps=w, num_stages=1 if o.get("BLOCK_K", 0) >= 512 else 3)
            for o in options for w in warps]


# Small-M GEMM tiles: few output columns per program, so that even one row keeps many SMs busy.
# From 5 rows on, tl.dot. Weights of up to SMALL_WEIGHTS elements (SmolLM2's, Qwen2.5-0.5B's: a
# layer's weights stay in L2) take 16 rows a program and one fixed configuration, a loop over K in
# 128- or 256-wide blocks that the pipeline stages into shared memory. Larger weights (Llama-3.1-8B's)
# take all the rows in one program (up to 64: each weight read from memory once) and autotuned
# blocks, K in one block where the tiles fit (the weights of that block load before the program
# waits for the previous kernel, see _wait_for_previous), else looped in 128 or 256.
# Up to GEMV_ROWS rows (a plain decode step at batch 1-4, a verify step with up to 3 drafts) are a
# matrix-vector product on the CUDA cores instead (GEMV): 4 or 8 output columns per program, the
# whole of K (``K_ONE``) in registers, every thread reducing its share of K for all the rows at
# once. tl.dot would pad them to 16 rows and run K as one chain of MMAs: on an H100 a SmolLM2 step
# took 0.43 ms instead of 0.76 ms at batch 1, and 0.65 ms instead of 0.74-0.84 at batch 4
# (benchmarks/results/decode-kernels-h100). From 5 rows on, tl.dot: every thread holds its share
# of x for all the rows, and the two-output kernels (q/k/v pairs, gate/up) crowd the registers.
GEMV_ROWS = 4
# 3-4 rows only for weights up to this many elements: under PDL, Qwen2.5-0.5B's 4864-wide gate/up
# projection at 3-4 rows (~1,200 programs of 4 columns) made the whole step slower than tl.dot
# (1.54 instead of 1.08 ms at batch 4), where SmolLM2's layers ran faster (0.66 instead of 0.91).
_GEMV_ROWS_WEIGHTS = 4 * 1024 * 1024
_K_BLOCKS = (64, 128, 256, 512, 1024, 2048, 4096)  # 64: small weights' fallback in fp32 (dot_config)
# 16 rows a tl.dot program at batch 32 read each weight twice: from L2 the second time while a
# layer's weights fit it (H100: 50 MB). Llama-3.1-8B's layers (17-117 M elements each) do not, and
# their batch-32 step took 3.34 instead of 2.57 ms that way (benchmarks/results/decode-kernels-h100/batch32/).
SMALL_WEIGHTS = 12 * 1024 * 1024
_COLS = (4, 8, 16, 32)  # 4 and 8: GEMV only (tl.dot needs 16 columns)
_GEMM = _configs([dict(BLOCK_N=n, BLOCK_K=k) for n in _COLS for k in _K_BLOCKS], dict(BLOCK_N=16, BLOCK_K=32),
                 warps=(4, 8))
_ROPE = _configs([dict(BLOCK_J=j, BLOCK_K=k) for j in _COLS for k in _K_BLOCKS], dict(BLOCK_J=16, BLOCK_K=32),
                 warps=(4, 8))
_ATTN = _configs([dict(BLOCK_S=32, WARPS=0), dict(BLOCK_S=64, WARPS=0), dict(BLOCK_S=128, WARPS=0)],
                 dict(BLOCK_S=16, WARPS=0))
# Each warp its own slots (``_attend_by_warp``), 4 stages: alone, at batch 32 on an H200, 17.52
# against 20.05 µs a layer over 1,000-2,000-token contexts, 11.22 against 11.74 over 450-950 and
# slower over shorter ones (benchmarks/results/attention-alone-h200/, round 8). In the whole step
# (under PDL) SmolLM2's batch-32 step over ~2,100 tokens took 1.177 against 1.263 ms, but over ~560
# 0.888 against 0.870, though the autotuner had picked it there (benchmarks/results/
# attention-by-warp-h200/): candidates only from the 2,048-slot bucket on, unsplit (``_attn_prune``).
_ATTN_BY_WARP = [] if INTERPRET else [triton.Config(dict(BLOCK_S=s, WARPS=4), num_warps=4, num_stages=4)
                                      for s in (16, 32)]
ATTN_BY_WARP_FROM = 2048
# Weight bytes one GEMV program may hold (64 KiB: 64 registers a thread at 8 warps in bf16).
_TILE_BUDGET = 65536
_SMEM_BUDGET = 200_000  # of an H100 SM's 227 KiB


@functools.cache
def _smem_budget(device_index: int) -> int:
    """Shared memory a program may stage on this GPU: 86% of what a block may use (an H100's 227 KiB
    gives ``_SMEM_BUDGET``), so that GPUs with less (A100 164 KiB, L40S and L4 99 KiB) get blocks
    that fit: a pruning that leaves one candidate has no autotuner to skip one that does not."""
    try:
        from triton.runtime import driver
        most = driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    except Exception:  # no CUDA driver here (compile checks on CPU): the H100's
        return _SMEM_BUDGET
    return min(_SMEM_BUDGET, int(most * 0.86))


def _budget_for(w: Tensor) -> int:
    return _smem_budget(w.device.index or 0) if w.device.type == "cuda" else _SMEM_BUDGET


def _tiles_fit(tiles: int, cols: int, k: int, elt: int) -> bool:
    """Whether ``tiles`` weight tiles of ``cols`` columns by all of K (rounded up to a power of two)
    fit one program's ``_TILE_BUDGET``."""
    return tiles * cols * triton.next_power_of_2(k) * elt <= _TILE_BUDGET


def gemv_fits(m: int, k: int, tiles: int, weight: Tensor) -> bool:
    """Whether ``m`` rows run as a GEMV: at most ``GEMV_ROWS`` (3-4 only for weights up to
    ``_GEMV_ROWS_WEIGHTS`` elements), ``tiles`` weight tiles of 4 columns by the whole of K within
    one program's ``_TILE_BUDGET``, and the rows' fp32 x tile too."""
    return (m <= GEMV_ROWS and (m <= 2 or weight.numel() <= _GEMV_ROWS_WEIGHTS)
            and _tiles_fit(tiles, 4, k, weight.element_size()) and _tiles_fit(1, triton.next_power_of_2(m), k, 4))


def _k_prune(tiles: int, cols: str, dot: tuple[int, int, int]):
    """Autotune pruning. GEMV (``BLOCK_M`` < 16): 4 or 8 columns at 4 warps, where their tiles over
    the whole of K fit ``_TILE_BUDGET`` (``BLOCK_K`` unused: one value of it kept). tl.dot on
    weights of up to ``SMALL_WEIGHTS`` elements: the one configuration ``dot`` = (columns,
    ``BLOCK_K``, warps), a loop over K whose blocks the pipeline stages into shared memory. Larger
    weights: the one-block candidates (``BLOCK_K`` = K rounded up to a power of two) whose
    ``tiles`` weight tiles fit, else the looping ones (128, 256); 16 columns or more.

    Why one fixed configuration for small weights: the autotuner times each kernel alone, where a
    few microseconds apart are noise, and its picks changed from run to run; the whole batch-32
    SmolLM2 step then cost 0.86 to 1.03 ms. Timed in the step (benchmarks/results/
    decode-kernels-h100/batch32/), these loops beat holding all of K in one block, which pads K
    to a power of two (576 to 1024) and moves every tile through registers into shared memory
    after the wait for the previous kernel."""
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        k = triton.next_power_of_2(named_args["K"])
        w = named_args["w_ptr"]
        elt = w.element_size()
        block_m = kwargs.get("BLOCK_M", 16)
        budget = _budget_for(w)
        if block_m < 16:  # 4 or 8 columns, 4 warps: 1.2-1.7 µs each on an H100 in a PDL chain
            return [c for c in configs if c.kwargs["BLOCK_K"] == 128 and c.kwargs[cols] <= 8 and c.num_warps == 4
                    and _tiles_fit(tiles, c.kwargs[cols], k, elt)]
        if w.numel() <= SMALL_WEIGHTS:
            chosen = dot_config(dot, block_m, tiles, elt, budget)
            return [c for c in configs if (c.kwargs[cols], c.kwargs["BLOCK_K"], c.num_warps) == chosen]
        configs = [c for c in configs if c.kwargs[cols] >= 16]

        def fits(c: triton.Config) -> bool:  # the x and weight tiles of each pipeline stage in shared memory
            staged = (block_m + tiles * c.kwargs[cols]) * c.kwargs["BLOCK_K"] * elt * c.num_stages
            return staged <= budget

        single = [c for c in configs
                  if c.kwargs["BLOCK_K"] == k and fits(c) and _tiles_fit(tiles, c.kwargs[cols], k, elt)]
        return single or [c for c in configs if c.kwargs["BLOCK_K"] in (128, 256) and fits(c)]
    return None if INTERPRET else {"early_config_prune": prune}


def dot_config(dot: tuple[int, int, int], block_m: int, tiles: int, elt: int,
               budget: int = _SMEM_BUDGET) -> tuple[int, int, int]:
    """``dot`` = (columns, ``BLOCK_K``, warps) with ``BLOCK_K`` halved (down to 64) until the x tile
    and ``tiles`` weight tiles of the three pipeline stages fit ``budget`` bytes of shared memory
    (fp32 weights, GPUs with less shared memory than an H100)."""
    n, block_k, warps = dot
    while block_k > 64 and (block_m + tiles * n) * block_k * elt * 3 > budget:
        block_k //= 2
    return n, block_k, warps


# One block over K: the norms compute the rms from the tile they multiply (no second pass over x).
# Fewer than 16 rows (BLOCK_M 1..GEMV_ROWS): the GEMV path.
_SINGLE = {"SINGLE": lambda args: args["BLOCK_K"] >= args["K"], "GEMV": lambda args: args["BLOCK_M"] < 16}


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and newer, a Triton with ``launch_pdl``): each kernel
    of a step may start while the previous one finishes, loading its weights meanwhile and
    waiting (``griddepcontrol.wait``) only before it reads what earlier kernels wrote. CUDA graphs
    keep these launches as programmatic edges."""
    if INTERPRET or device.type != "cuda" or gdc_wait is None or torch.version.cuda is None:
        return False  # the interpreter, CPUs, ROCm builds, a Triton without grid dependency control
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


# --- shared pieces --------------------------------------------------------------------------------

# Rows x padded features up to which a program's rms loop is unrolled (16 rows of up to 1,024).
_RSTD_UNROLLED = tl.constexpr(16 * 1024)


@triton.jit
def _block_squares(x_ptr, offs_m, m_mask, kk, K):
    x = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K),
                other=0.0).to(tl.float32)
    return tl.sum(x * x, axis=1)


@triton.jit
def _row_rstd(x_ptr, offs_m, m_mask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_ONE: tl.constexpr):
    """1 / rms of rows ``offs_m`` of x ``(M, K)``, in fp32 (as the eager RMSNorm). Up to
    ``_RSTD_UNROLLED`` the loop over K blocks is unrolled at compile time (blocks past K load
    nothing): a loop the pipeline leaves alone waited for each block's load in turn, right after
    the wait for the previous kernel. On two H100s, six processes each: the batch-32 step of
    SmolLM2 0.834 -> 0.821 ms, of the Qwen2.5-0.5B shape 1.284 -> 1.249 (benchmarks/results/
    decode-kernels-h100/rstd-unrolled/). One load of all of K instead made both slower (0.93, 1.41 ms)."""
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if BLOCK_M * K_ONE <= _RSTD_UNROLLED:
        for k0 in tl.static_range(0, K_ONE, BLOCK_K):
            ss += _block_squares(x_ptr, offs_m, m_mask, k0 + tl.arange(0, BLOCK_K), K)
    else:
        for k0 in range(0, K, BLOCK_K):
            ss += _block_squares(x_ptr, offs_m, m_mask, k0 + tl.arange(0, BLOCK_K), K)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _normed_tile(x_ptr, g_ptr, offs_m, m_mask, kk, K, rstd):
    """Columns ``kk`` of RMSNorm(x): normalised in fp32, rounded to the model's dtype, times the
    norm weight in that dtype (the eager RMSNorm's roundings)."""
    k_mask = kk < K
    x = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr + kk, mask=k_mask, other=0.0)
    return g[None, :] * (x * rstd[:, None]).to(g.dtype)


@triton.jit
def _normed_rows(x_ptr, g_ptr, offs_m, m_mask, K, eps, BLOCK_K: tl.constexpr):
    """RMSNorm of rows ``offs_m`` of x ``(M, K)`` when K is one block: the rms comes from the very
    tile that is multiplied (x is read once). The eager RMSNorm's roundings; ``(BLOCK_M, BLOCK_K)``."""
    kk = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K),
                other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
    g = tl.load(g_ptr + kk, mask=kk < K, other=0.0)
    return g[None, :] * (x * rstd[:, None]).to(g.dtype)


@triton.jit
def _weight_tile(w_ptr, rows, r_mask, kk, K):
    """Weight rows ``rows`` (output features) x columns ``kk``, as a ``(BLOCK_K, len(rows))`` tile
    (nn.Linear stores ``(out, in)``; the tile is its transpose, ready for ``x @ W.T``)."""
    return tl.load(w_ptr + rows[None, :] * K + kk[:, None], mask=r_mask[None, :] & (kk[:, None] < K), other=0.0)


@triton.jit
def _wait_for_previous(USE_PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel has finished and its
    writes are visible (everything before this may only read weights), then let the next kernel
    start (it loads its own weights while this one computes). Every program calls it, so a
    kernel's end implies its predecessors' ends. A no-op without PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _normed_gemv_pair(x_ptr, g_ptr, w_ptr, offs_m, m_mask, rows1, rows2, r_mask, K, eps, w1, w2,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, K_ONE: tl.constexpr):
    """RMSNorm(x) rows ``offs_m`` times two sets of weight rows at once (the two halves of a RoPE
    pair, or gate and up): one pass over x for both, fp32 accumulators ``(BLOCK_M, cols)``.
    ``w1``/``w2`` are the weight tiles of the first K block, loaded by the caller (before it
    waits for the previous kernel); SINGLE: that block is the whole of K."""
    if SINGLE:
        a = _normed_rows(x_ptr, g_ptr, offs_m, m_mask, K, eps, BLOCK_K)
    else:
        rstd = _row_rstd(x_ptr, offs_m, m_mask, K, eps, BLOCK_M, BLOCK_K, K_ONE)
        a = _normed_tile(x_ptr, g_ptr, offs_m, m_mask, tl.arange(0, BLOCK_K), K, rstd)
    acc1 = tl.dot(a, w1, input_precision="ieee")
    acc2 = tl.dot(a, w2, input_precision="ieee")
    if not SINGLE:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = _normed_tile(x_ptr, g_ptr, offs_m, m_mask, kk, K, rstd)
            acc1 += tl.dot(a, _weight_tile(w_ptr, rows1, r_mask, kk, K), input_precision="ieee")
            acc2 += tl.dot(a, _weight_tile(w_ptr, rows2, r_mask, kk, K), input_precision="ieee")
    return acc1, acc2


@triton.jit
def _row_tile(w_ptr, rows, r_mask, K, K_ONE: tl.constexpr):
    """Weight rows ``rows`` over the whole of K, ``(len(rows), K_ONE)``: a GEMV program's tile
    (each row contiguous in memory, as nn.Linear stores it)."""
    kk = tl.arange(0, K_ONE)
    return tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=r_mask[:, None] & (kk[None, :] < K), other=0.0)


@triton.jit
def _gemv(w, x, BLOCK_M: tl.constexpr):
    """``x (BLOCK_M, K) @ w (N, K).T`` in fp32 on the CUDA cores, ``(BLOCK_M, N)``: each thread
    multiplies its share of K for every row and column, then one reduction over K for all of them."""
    if BLOCK_M == 1:
        return tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    else:
        return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _normed_pair_product(x_ptr, g_ptr, w_ptr, b_ptr, offs_m, m_mask, rows1, rows2, r_mask, K, eps,
                         HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, K_ONE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, GEMV: tl.constexpr):
    """RMSNorm(x) times weight rows ``rows1`` and ``rows2`` (+ their biases), fp32 ``(BLOCK_M, cols)``
    each: the weights (first K block, or all of K for the GEMV) and biases are loaded before the
    wait for the previous kernel, x after it."""
    if GEMV:
        w1 = _row_tile(w_ptr, rows1, r_mask, K, K_ONE)
        w2 = _row_tile(w_ptr, rows2, r_mask, K, K_ONE)
    else:
        kk = tl.arange(0, BLOCK_K)
        w1 = _weight_tile(w_ptr, rows1, r_mask, kk, K)
        w2 = _weight_tile(w_ptr, rows2, r_mask, kk, K)
    if HAS_BIAS:
        bias1 = tl.load(b_ptr + rows1, mask=r_mask, other=0.0).to(tl.float32)
        bias2 = tl.load(b_ptr + rows2, mask=r_mask, other=0.0).to(tl.float32)
    _wait_for_previous(USE_PDL)
    if GEMV:
        a = _normed_rows(x_ptr, g_ptr, offs_m, m_mask, K, eps, K_ONE)
        acc1 = _gemv(w1, a, BLOCK_M)
        acc2 = _gemv(w2, a, BLOCK_M)
    else:
        acc1, acc2 = _normed_gemv_pair(x_ptr, g_ptr, w_ptr, offs_m, m_mask, rows1, rows2, r_mask, K, eps, w1, w2,
                                       BLOCK_M, BLOCK_K, SINGLE, K_ONE)
    if HAS_BIAS:
        acc1 += bias1[None, :]
        acc2 += bias2[None, :]
    return acc1, acc2


# --- 1. RMSNorm + q/k/v projection + RoPE + KV-cache write -----------------------------------------

@triton.autotune(configs=_ROPE, key=["M", "K", "N_HEADS", "N_KV", "HEAD_DIM"],
                 prune_configs_by=_k_prune(2, "BLOCK_J", (32, 128, 8)))
@triton.heuristics(_SINGLE)
@triton.jit
def _norm_qkv_rope_kernel(x_ptr, g_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, q_ptr, kc_ptr, vc_ptr,
                          M, K, T, eps, stride_cb, stride_ch, stride_cs,
                          N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
                          K_ONE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                          SINGLE: tl.constexpr, GEMV: tl.constexpr):
    # A program computes columns j and j + HALF of one head (the pairs RoPE rotates together) for
    # BLOCK_M rows. Heads 0..N_HEADS-1 are q, then N_KV k heads, then N_KV v heads (wqkv's order).
    HALF: tl.constexpr = HEAD_DIM // 2
    n_jb = tl.cdiv(HALF, BLOCK_J)
    head = tl.program_id(0) // n_jb
    j = (tl.program_id(0) % n_jb) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = j < HALF
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    col1 = head * HEAD_DIM + j
    col2 = col1 + HALF
    acc1, acc2 = _normed_pair_product(x_ptr, g_ptr, w_ptr, b_ptr, offs_m, m_mask, col1, col2, j_mask, K, eps,
                                      HAS_BIAS, USE_PDL, K_ONE, BLOCK_M, BLOCK_K, SINGLE, GEMV)
    dtype = q_ptr.dtype.element_ty
    x1 = acc1.to(dtype).to(tl.float32)  # the eager projection's output, in the model's dtype
    x2 = acc2.to(dtype).to(tl.float32)
    mj = m_mask[:, None] & j_mask[None, :]
    if head < N_HEADS + N_KV:  # q or k: rotate-half RoPE with this token's cos/sin row
        cs = offs_m[:, None] * HEAD_DIM + j[None, :]
        cos1 = tl.load(cos_ptr + cs, mask=mj, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs, mask=mj, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + cs + HALF, mask=mj, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs + HALF, mask=mj, other=0.0).to(tl.float32)
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    else:
        y1 = x1
        y2 = x2
    if head < N_HEADS:
        q_off = offs_m[:, None] * (N_HEADS * HEAD_DIM) + col1[None, :]
        tl.store(q_ptr + q_off, y1.to(dtype), mask=mj)
        tl.store(q_ptr + q_off + HALF, y2.to(dtype), mask=mj)
    else:
        # k or v: into the cache at (cache row, kv head, position), the row's cache row being
        # rows[b] when given (a prefill into free slots) else b.
        b = offs_m // T
        if HAS_ROWS:
            crow = tl.load(rows_ptr + b, mask=m_mask, other=0)
        else:
            crow = b
        pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0)
        kv_head = (head - N_HEADS) % N_KV
        off = (crow * stride_cb + kv_head * stride_ch + pos * stride_cs)[:, None] + j[None, :]
        if head < N_HEADS + N_KV:
            tl.store(kc_ptr + off, y1.to(dtype), mask=mj)
            tl.store(kc_ptr + off + HALF, y2.to(dtype), mask=mj)
        else:
            tl.store(vc_ptr + off, y1.to(dtype), mask=mj)
            tl.store(vc_ptr + off + HALF, y2.to(dtype), mask=mj)


# --- 2. decode attention over the cache (GQA, split-K) ---------------------------------------------

def _attn_prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """The by-warp candidates only where they were measured faster in the step: from
    ``ATTN_BY_WARP_FROM`` slots on, with the cache not split (a full batch: SmolLM2's 32 rows). Each
    candidate is a compile and a timing at warm-up; small batches (several splits a row) picked the
    shared-block ones anyway."""
    by_warp = named_args["kv_len"] >= ATTN_BY_WARP_FROM and kwargs.get("SPLITS", 1) == 1
    return [c for c in configs if by_warp or not c.kwargs["WARPS"]]


@triton.jit
def _attend_by_warp(q, k_base, v_base, pos, start, end, sm_scale, stride_cs, Q_P: tl.constexpr, D_P: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, WARPS: tl.constexpr):
    """Online softmax of the query rows ``q`` over slots ``start .. end`` (each row up to its ``pos``):
    (max, sum, weighted v), each of the program's ``WARPS`` warps taking its own ``BLOCK_S`` slots
    of every block (a batched tl.dot over a leading dimension of warps) and keeping a softmax of its
    own, merged once at the end: a block's row maximum and sum then stay inside a warp instead of
    crossing the program's warps through shared memory at every block, as in the kernel's own loop."""
    d = tl.arange(0, D_P)
    d_mask = d < HEAD_DIM
    w = tl.arange(0, WARPS)
    q3 = tl.broadcast_to(q[None, :, :], (WARPS, Q_P, D_P))
    m_w = tl.full((WARPS, Q_P), -1e30, dtype=tl.float32)
    l_w = tl.zeros((WARPS, Q_P), dtype=tl.float32)
    acc_w = tl.zeros((WARPS, Q_P, D_P), dtype=tl.float32)
    for s0 in range(start, end, WARPS * BLOCK_S):
        s = s0 + w[:, None] * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]  # (WARPS, BLOCK_S): each warp's slots
        s_mask = s < end
        kt = tl.load(k_base + s[:, None, :] * stride_cs + d[None, :, None],
                     mask=s_mask[:, None, :] & d_mask[None, :, None], other=0.0)
        scores = tl.dot(q3, kt, input_precision="ieee") * sm_scale
        scores = tl.where((s[:, None, :] <= pos[None, :, None]) & s_mask[:, None, :], scores, float("-inf"))
        m_new = tl.maximum(m_w, tl.max(scores, axis=2))
        alpha = tl.exp(m_w - m_new)
        p = tl.exp(scores - m_new[:, :, None])
        l_w = l_w * alpha + tl.sum(p, axis=2)
        v = tl.load(v_base + s[:, :, None] * stride_cs + d[None, None, :],
                    mask=s_mask[:, :, None] & d_mask[None, None, :], other=0.0)
        acc_w = acc_w * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_w = m_new
    m_i = tl.max(m_w, axis=0)
    scale = tl.exp(m_w - m_i[None, :])
    return m_i, tl.sum(l_w * scale, axis=0), tl.sum(acc_w * scale[:, :, None], axis=0)


@triton.autotune(configs=_ATTN + _ATTN_BY_WARP, key=["kv_len", "QROWS", "HEAD_DIM", "SPLITS"],
                 prune_configs_by={"early_config_prune": _attn_prune})
@triton.jit
def _attention_kernel(q_ptr, kc_ptr, vc_ptr, pos_ptr, rows_ptr, y_ptr, pm_ptr, pl_ptr, pacc_ptr,
                      kv_len, T, sm_scale, stride_cb, stride_ch, stride_cs,
                      N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
                      GROUP: tl.constexpr, QROWS: tl.constexpr, Q_P: tl.constexpr, SPLITS: tl.constexpr,
                      HAS_ROWS: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_S: tl.constexpr, WARPS: tl.constexpr):
    # One program: batch row b, kv head g, cache split `split`. Its query rows are the GROUP query
    # heads of g for each of the row's T tokens (QROWS = T * GROUP, padded to Q_P >= 16 for tl.dot):
    # every k/v slot is read once for all of them. WARPS = 0: the warps share each block of BLOCK_S
    # slots (the loop below); else each warp takes its own BLOCK_S slots of a block (_attend_by_warp).
    _wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.arange(0, Q_P)
    r_mask = r < QROWS
    tok = b * T + r // GROUP
    head = g * GROUP + r % GROUP
    pos = tl.load(pos_ptr + tok, mask=r_mask, other=-1)  # padding rows see nothing
    d = tl.arange(0, D_P)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_ROWS:
        crow = tl.load(rows_ptr + b)
    else:
        crow = b
    # Slots up to the row's last position; this split's share of them. A row whose position lies
    # past the bucket is idle: the engine picks the bucket from its live rows, so that is a free
    # row or one parked at the cache's last slot while its prompt goes in. It attends nothing:
    # reading the whole bucket, it was the kernel's slowest program beside rows of shorter contexts.
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    step: tl.constexpr = BLOCK_S * (WARPS + (WARPS == 0))  # slots a block
    chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), step) * step
    start = split * chunk
    end = tl.minimum(start + chunk, n_valid)
    k_base = kc_ptr + crow * stride_cb + g * stride_ch
    v_base = vc_ptr + crow * stride_cb + g * stride_ch
    if WARPS:
        m_i, l_i, acc = _attend_by_warp(q, k_base, v_base, pos, start, end, sm_scale, stride_cs, Q_P, D_P, HEAD_DIM,
                                        BLOCK_S, WARPS)
    else:
        # Online softmax; -1e30 rather than -inf as the start, so that rows without a visible slot yet
        # give exp(-inf) = 0, never exp(nan).
        m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
        l_i = tl.zeros((Q_P,), dtype=tl.float32)
        acc = tl.zeros((Q_P, D_P), dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_mask = s < end
            kt = tl.load(k_base + s[None, :] * stride_cs + d[:, None], mask=d_mask[:, None] & s_mask[None, :],
                         other=0.0)
            scores = tl.dot(q, kt, input_precision="ieee") * sm_scale
            scores = tl.where((s[None, :] <= pos[:, None]) & s_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(y_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
    else:  # partial results, merged by _attention_reduce_kernel
        part = (b * N_KV + g) * SPLITS + split
        tl.store(pm_ptr + part * Q_P + r, m_i)
        tl.store(pl_ptr + part * Q_P + r, l_i)
        tl.store(pacc_ptr + (part * Q_P + r)[:, None] * D_P + d[None, :], acc)


@triton.jit
def _attention_reduce_kernel(y_ptr, pm_ptr, pl_ptr, pacc_ptr, T,
                             N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
                             GROUP: tl.constexpr, QROWS: tl.constexpr, Q_P: tl.constexpr, SPLITS: tl.constexpr,
                             SPLITS_P: tl.constexpr, USE_PDL: tl.constexpr):
    # One program per (batch row, kv head, query row): the splits' softmaxes rescaled to a common max.
    _wait_for_previous(USE_PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.program_id(2)
    sp = tl.arange(0, SPLITS_P)
    sp_mask = sp < SPLITS
    d = tl.arange(0, D_P)
    part = (b * N_KV + g) * SPLITS + sp
    m = tl.load(pm_ptr + part * Q_P + r, mask=sp_mask, other=-1e30)
    l = tl.load(pl_ptr + part * Q_P + r, mask=sp_mask, other=0.0)
    acc = tl.load(pacc_ptr + (part * Q_P + r)[:, None] * D_P + d[None, :], mask=sp_mask[:, None], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # an idle row: zeros
    tok = b * T + r // GROUP
    head = g * GROUP + r % GROUP
    tl.store(y_ptr + tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM + d, out.to(y_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


# --- 3 and 5. projection + residual -----------------------------------------------------------------

# 32 columns a tl.dot program (16 before): on an H100 the batch-32 step of SmolLM2 0.881 -> 0.852 ms
# and of the Qwen2.5-0.5B shape 1.359 -> 1.282 ms, three alternating pairs of processes; the q/k/v
# and gate/up kernels' alternatives tried beside it were slower (decode-kernels-h100/linear-columns/).
@triton.autotune(configs=_GEMM, key=["M", "N", "K"], prune_configs_by=_k_prune(1, "BLOCK_N", (32, 256, 4)))
@triton.heuristics(_SINGLE)
@triton.jit
def _linear_residual_kernel(a_ptr, w_ptr, b_ptr, res_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                            USE_PDL: tl.constexpr, K_ONE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, GEMV: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    kk = tl.arange(0, BLOCK_K)
    if GEMV:
        w = _row_tile(w_ptr, offs_n, n_mask, K, K_ONE)
    else:
        w = _weight_tile(w_ptr, offs_n, n_mask, kk, K)  # the first (often only) K block, before the wait
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _wait_for_previous(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    mn = m_mask[:, None] & n_mask[None, :]
    off = offs_m[:, None] * N + offs_n[None, :]
    res = tl.load(res_ptr + off, mask=mn, other=0.0).to(tl.float32)
    if GEMV:
        k1 = tl.arange(0, K_ONE)
        a = tl.load(a_ptr + offs_m[:, None] * K + k1[None, :], mask=m_mask[:, None] & (k1[None, :] < K), other=0.0)
        acc = _gemv(w, a, BLOCK_M)
    else:
        a = tl.load(a_ptr + offs_m[:, None] * K + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K), other=0.0)
        acc = tl.dot(a, w, input_precision="ieee")
    if not SINGLE and not GEMV:
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * K + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K),
                        other=0.0)
            acc += tl.dot(a, _weight_tile(w_ptr, offs_n, n_mask, kk, K), input_precision="ieee")
    if HAS_BIAS:
        acc += bias[None, :]
    tl.store(out_ptr + off, (res + acc.to(dtype).to(tl.float32)).to(dtype), mask=mn)


# --- 4. RMSNorm + gate/up projection + SiLU(gate) * up ----------------------------------------------

@triton.autotune(configs=_GEMM, key=["M", "N", "K"], prune_configs_by=_k_prune(2, "BLOCK_N", (32, 256, 4)))
@triton.heuristics(_SINGLE)
@triton.jit
def _norm_gate_up_kernel(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, M, N, K, eps, HAS_BIAS: tl.constexpr,
                         USE_PDL: tl.constexpr, K_ONE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, GEMV: tl.constexpr):
    # w13 is [gate; up]: output column n needs weight rows n and N + n.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc_g, acc_u = _normed_pair_product(x_ptr, g_ptr, w_ptr, b_ptr, offs_m, m_mask, offs_n, N + offs_n, n_mask, K, eps,
                                        HAS_BIAS, USE_PDL, K_ONE, BLOCK_M, BLOCK_K, SINGLE, GEMV)
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)  # rounded where the eager projections round
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], (silu * up).to(dtype),
             mask=m_mask[:, None] & n_mask[None, :])


# --- host wrappers ------------------------------------------------------------------------------------

def _block_m(m: int, k: int, tiles: int, weight: Tensor) -> int:
    """Rows per program: all of them as a power of two on the GEMV path (``gemv_fits``); on the
    tl.dot path 16 for weights of up to ``SMALL_WEIGHTS`` elements, else all of them up to 64
    (each weight read from memory once), at least 16 (tl.dot's minimum). 16 for small weights: a
    batch-32 step then runs twice the programs, each with half the x tile, and the second read
    of a weight comes from L2 (SmolLM2 at batch 32 on an H100: 1.00 instead of 1.09 ms with the
    attention change below)."""
    if gemv_fits(m, k, tiles, weight):
        return triton.next_power_of_2(m)
    if weight.numel() <= SMALL_WEIGHTS:
        return 16
    return max(16, min(64, triton.next_power_of_2(m)))


def _launch(pdl: bool) -> dict:
    """The kernels' PDL constexpr, and the launch option itself when on."""
    return dict(USE_PDL=True, launch_pdl=True) if pdl else dict(USE_PDL=False)


def _bias(linear: torch.nn.Linear) -> tuple[Tensor, bool]:
    # A kernel argument must be a tensor even when unused: the weight stands in for a missing bias.
    return (linear.bias, True) if linear.bias is not None else (linear.weight, False)


def norm_qkv_rope(x: Tensor, norm: torch.nn.Module, wqkv: torch.nn.Linear, cos: Tensor, sin: Tensor,
                  input_pos: Tensor, k_cache: Tensor, v_cache: Tensor, n_heads: int, n_kv_heads: int,
                  head_dim: int, t: int, rows: Tensor | None = None, pdl: bool = False) -> Tensor:
    """x ``(M, dim)`` (M = B * T tokens, row-major by batch row); cos/sin ``(M, head_dim)``;
    input_pos ``(M,)``. Writes k, v into the caches; returns RoPE'd q ``(M, n_heads * head_dim)``."""
    m, k = x.shape
    q = torch.empty(m, n_heads * head_dim, dtype=x.dtype, device=x.device)
    bias, has_bias = _bias(wqkv)
    heads = n_heads + 2 * n_kv_heads
    half = head_dim // 2
    block_m = _block_m(m, k, 2, wqkv.weight)
    grid = lambda meta: (heads * triton.cdiv(half, meta["BLOCK_J"]), triton.cdiv(m, block_m))  # noqa: E731
    _norm_qkv_rope_kernel[grid](
        x, norm.weight, wqkv.weight, bias, cos, sin, input_pos, rows if rows is not None else input_pos,
        q, k_cache, v_cache, m, k, t, norm.eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, HAS_BIAS=has_bias, HAS_ROWS=rows is not None,
        K_ONE=triton.next_power_of_2(k), BLOCK_M=block_m, **_launch(pdl))
    return q


def attention_splits(batch: int, n_kv_heads: int, kv_len: int, programs: int = 264, min_slots: int = 64,
                     whole: int = 96) -> int:
    """Cache splits per (row, kv head): enough programs for the GPU (``programs``: ~2 per SM of an
    H100), at least ``min_slots`` cache slots each. 1 = no reduce kernel, and so no split once
    the rows and kv heads alone make ``whole`` programs: at SmolLM2's batch 32 (96 programs on
    132 SMs) one kernel fewer per layer was worth more than the idle SMs (0.09 ms per step)."""
    if batch * n_kv_heads >= whole:
        return 1
    return max(1, min(programs // (batch * n_kv_heads), triton.cdiv(kv_len, min_slots)))


# The attention kernel's autotune keys that were tuned on contexts spread over their kv bucket.
_TUNED_ON_CONTEXT: set[tuple] = set()


def _tune_on_context(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: int, batch: int, t: int, n_heads: int,
                     n_kv_heads: int, head_dim: int, rows: Tensor | None, splits: int, pdl: bool) -> None:
    """Run the attention kernel's autotuning for this shape on rows whose contexts fill the upper
    half of the kv bucket (the contexts a bucket serves: longer than the bucket below it), before
    the caller's own first call tunes it on whatever it holds. The runner's warm-up runs every
    step at position 0, where each candidate reads one slot and the pick is noise: on an H100,
    SmolLM2's batch-32 step at the 1,024 bucket took 1.04 or 1.19 ms after such starts, 0.96
    after this (benchmarks/results/decode-kernels-h100/attention-tuning/). It reads the cache
    (whatever it holds) and writes only its own scratch outputs, with the caller's launch
    options, so that no extra variant is compiled."""
    # Rows in cache rows of their own where the caller's table names rows (a packed forward's tokens
    # may outnumber them): the kernel variant with a row table, as the caller's.
    table = None if rows is None else torch.arange(batch, device=q.device) % k_cache.shape[0]
    decode_attention(torch.randn_like(q), k_cache, v_cache, tuning_positions(kv_len, batch, t, q.device), kv_len,
                     batch, t, n_heads, n_kv_heads, head_dim, table, splits, pdl)


def tuning_positions(kv_len: int, batch: int, t: int, device: torch.device | str) -> Tensor:
    """``batch * t`` positions for tuning attention at a kv bucket: row b's ``t`` tokens end at
    positions spread evenly over the bucket's upper half (row 0 at ``kv_len // 2``), consecutive
    within a row, as a verify step's are."""
    half = kv_len // 2
    last = half + torch.arange(batch, device=device) * (kv_len - 1 - half) // max(batch, 1)
    return (last[:, None] - torch.arange(t - 1, -1, -1, device=device)[None, :]).clamp(min=0).reshape(-1)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor, kv_len: int, batch: int,
                     t: int, n_heads: int, n_kv_heads: int, head_dim: int, rows: Tensor | None = None,
                     splits: int | None = None, pdl: bool = False) -> Tensor:
    """q ``(B * T, n_heads * head_dim)`` -> attention output of the same shape: token (b, t) at
    position p attends to slots ``0..p`` of cache row ``rows[b]`` (default b), below ``kv_len``.
    A row with a position at or past ``kv_len`` is idle: its output is zeros."""
    group = n_heads // n_kv_heads
    qrows = t * group
    q_p = max(16, triton.next_power_of_2(qrows))
    d_p = max(16, triton.next_power_of_2(head_dim))
    splits = splits or attention_splits(batch, n_kv_heads, kv_len)
    key = (kv_len, qrows, head_dim, splits, q.dtype, k_cache.dtype)  # the autotuner's, or finer
    if not INTERPRET and key not in _TUNED_ON_CONTEXT:
        _TUNED_ON_CONTEXT.add(key)  # first: the tuning call comes back through here
        _tune_on_context(q, k_cache, v_cache, kv_len, batch, t, n_heads, n_kv_heads, head_dim, rows, splits, pdl)
    y = torch.empty_like(q)
    if splits > 1:
        parts = batch * n_kv_heads * splits * q_p
        pm = torch.empty(parts, dtype=torch.float32, device=q.device)
        pl = torch.empty(parts, dtype=torch.float32, device=q.device)
        pacc = torch.empty(parts, d_p, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = y  # unused
    meta = dict(N_HEADS=n_heads, N_KV=n_kv_heads, HEAD_DIM=head_dim, D_P=d_p, GROUP=group, QROWS=qrows, Q_P=q_p,
                SPLITS=splits)
    _attention_kernel[(batch, n_kv_heads, splits)](
        q, k_cache, v_cache, input_pos, rows if rows is not None else input_pos, y, pm, pl, pacc,
        kv_len, t, head_dim ** -0.5, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HAS_ROWS=rows is not None, **meta, **_launch(pdl))
    if splits > 1:
        _attention_reduce_kernel[(batch, n_kv_heads, qrows)](y, pm, pl, pacc, t, SPLITS_P=triton.next_power_of_2(splits),
                                                             **meta, **_launch(pdl))
    return y


def linear_residual(a: Tensor, linear: torch.nn.Linear, residual: Tensor, pdl: bool = False) -> Tensor:
    """``residual + linear(a)`` for a ``(M, K)``, residual ``(M, N)``."""
    m, k = a.shape
    n = linear.weight.shape[0]
    out = torch.empty(m, n, dtype=residual.dtype, device=a.device)
    bias, has_bias = _bias(linear)
    block_m = _block_m(m, k, 1, linear.weight)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    _linear_residual_kernel[grid](a, linear.weight, bias, residual, out, m, n, k, HAS_BIAS=has_bias,
                                  K_ONE=triton.next_power_of_2(k), BLOCK_M=block_m, **_launch(pdl))
    return out


def norm_gate_up(x: Tensor, norm: torch.nn.Module, w13: torch.nn.Linear, pdl: bool = False) -> Tensor:
    """``silu(gate) * up`` of ``w13(RMSNorm(x))``, w13 = [gate; up]: ``(M, intermediate)``."""
    m, k = x.shape
    n = w13.weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bias, has_bias = _bias(w13)
    block_m = _block_m(m, k, 2, w13.weight)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))  # noqa: E731
    _norm_gate_up_kernel[grid](x, norm.weight, w13.weight, bias, out, m, n, k, norm.eps, HAS_BIAS=has_bias,
                               K_ONE=triton.next_power_of_2(k), BLOCK_M=block_m, **_launch(pdl))
    return out


# --- the block and the model ----------------------------------------------------------------------

class FusedDecodeBlock:
    """A ``TransformerBlock`` (after ``fuse_projections()``) as five or six Triton kernels, for
    decode and verify steps (few query tokens per row); callable like ``TransformerBlock.forward``.

    It reads the block's weights and KV cache at each call (the cache may be reallocated by
    ``setup_caches``). ``cos``/``sin`` are the ones ``Transformer.hidden`` gathered for the batch
    (already in the model's dtype, as the eager layers use them); of ``mask`` only its length
    (the kv bucket) is used: the kernels mask by position.
    """

    def __init__(self, block: TransformerBlock, splits: int | None = None, pdl: bool = False) -> None:
        if block.attention.wqkv is None or block.feed_forward.w13 is None:
            raise ValueError("FusedDecodeBlock needs fused projections: call Transformer.fuse_projections() first")
        self.block = block
        self.splits = splits  # attention cache splits (None: attention_splits' choice)
        self.pdl = pdl  # programmatic dependent launch between the kernels (pdl_supported)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor,
                 rows: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        return self.run(x, cos, sin, input_pos, mask.shape[-1], b, t, rows)

    def run(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, kv_len: int, b: int, t: int,
            rows: Tensor | None = None) -> Tensor:
        """The block over ``b`` rows of ``t`` tokens each, whatever shape ``x`` (``b * t`` tokens
        of ``dim``), cos / sin (``b * t`` rows) and input_pos (``b * t`` positions) come in:
        token (i, j) at position ``input_pos[i * t + j]`` of cache row ``rows[i]`` (default i),
        attending slots up to it below ``kv_len``. Returns ``x``'s shape."""
        att, ff = self.block.attention, self.block.feed_forward
        cache = att.kv_cache
        if cache is None:
            raise RuntimeError("call Transformer.setup_caches() before forward()")
        shape = x.shape
        x2 = x.reshape(b * t, shape[-1]).contiguous()
        pos = input_pos.reshape(-1).contiguous()
        q = norm_qkv_rope(x2, self.block.attention_norm, att.wqkv, cos.reshape(b * t, -1).contiguous(),
                          sin.reshape(b * t, -1).contiguous(), pos, cache.k_cache, cache.v_cache,
                          att.n_heads, att.n_kv_heads, att.head_dim, t, rows, self.pdl)
        y = decode_attention(q, cache.k_cache, cache.v_cache, pos, kv_len, b, t, att.n_heads,
                             att.n_kv_heads, att.head_dim, rows, self.splits, self.pdl)
        h = linear_residual(y, att.wo, x2, self.pdl)
        out = linear_residual(norm_gate_up(h, self.block.ffn_norm, ff.w13, self.pdl), ff.w2, h, self.pdl)
        return out.view(shape)


class PackedBlock:
    """A ``FusedDecodeBlock`` over a packed forward (optimizations/llm/packed.py): the ``N`` tokens of
    its one row are ``N`` rows of one token each, token i at its own position of cache row
    ``rows[i]``, so each attends over its request's row up to itself (the chunk's earlier tokens
    included: the q/k/v kernel stores every token's k/v before attention reads). A short packed
    forward then costs about a decode step of ``N`` rows instead of the compiled layers' floor.
    Callable like ``TransformerBlock.forward`` on ``Transformer.hidden``'s batch of 1."""

    def __init__(self, block: FusedDecodeBlock, rows: Tensor, kv_len: int) -> None:
        self.block, self.rows, self.kv_len = block, rows, kv_len  # rows: the packed forward's table

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor,
                 rows: Tensor | None = None) -> Tensor:
        n = x.shape[1]
        return self.block.run(x, cos, sin, input_pos, self.kv_len, n, 1, self.rows[:n])


class TritonDecode(WithBlocks):
    """The model with its layers run by ``FusedDecodeBlock``s: what decode and verify steps call
    with ``kernels: triton`` (embedding, final norm, lm_head and sampling stay torch ops). Looks
    like the model to the step functions (``__call__``, ``hidden``, other attributes), as
    ``generate.RegionalCompiled`` does; not compiled: the kernels are already fused, and the
    CUDA graph around the step removes the launch cost of what is left."""

    def __init__(self, model: Transformer, splits: int | None = None, pdl: bool | None = None) -> None:
        if not model.config.family.triton_decode:  # q/k norms, sandwich norms, windows: not in these kernels
            raise ValueError(f"kernels: triton fuses Llama-style blocks only, not {model.config.model_type}'s "
                             "(optimizations/models/families.py); use kernels: torch")
        model.fuse_projections()
        if pdl is None:  # on wherever the GPU and Triton support it
            pdl = pdl_supported(model.tok_embeddings.weight.device)
        self.pdl = pdl
        # Every projection within SMALL_WEIGHTS: the tl.dot path's fixed configuration, under which
        # short packed forwards through these blocks were measured faster than the packed layers.
        self.small_weights = max(lin.weight.numel() for layer in model.layers
                                 for lin in (layer.attention.wqkv, layer.attention.wo,
                                             layer.feed_forward.w13, layer.feed_forward.w2)) <= SMALL_WEIGHTS
        super().__init__(model, [FusedDecodeBlock(layer, splits, pdl) for layer in model.layers])


__all__ = ["FusedDecodeBlock", "PackedBlock", "TritonDecode", "gemv_fits", "norm_qkv_rope", "decode_attention",
           "linear_residual", "norm_gate_up", "attention_splits", "pdl_supported"]
