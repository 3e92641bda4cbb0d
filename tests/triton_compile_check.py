"""Compile every fused decode kernel (every autotune candidate) for an H100 (sm_90) without a GPU:
Triton's front end, LLVM and ptxas, which the interpreter never runs. Catches type errors and
unsupported constructs before the code reaches a GPU. Run by test_triton_decode.py and
test_triton_sample.py in a subprocess (the interpreter, once on, is on for the whole process):

    python tests/triton_compile_check.py            # bf16, each kernel's first candidate (~15 s)
    python tests/triton_compile_check.py --all      # bf16 and fp32, every candidate (~90 s)
    python tests/triton_compile_check.py --sampling # the sampling kernels (triton_sample.py) only
"""
from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compiles real kernels: run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from servekit.optimizations.kernels import triton_decode as td  # noqa: E402
from servekit.optimizations.kernels import triton_sample as tsample  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"*bf16": torch.bfloat16, "*fp32": torch.float32}
H100_SHARED = 232448  # bytes of shared memory a block may use on an H100


ALL = "--all" in sys.argv


def compile_all(kernel, types: dict[str, str], constants: dict[str, object], k: int | None = None,
                weights: int = 1) -> int:
    """Compile ``kernel`` (autotuned or plain) with its first candidate configuration of each code path
    (``--all``: each candidate), of those its autotuner keeps for a reduction dimension ``k`` and a
    weight of ``weights`` elements."""
    fn = kernel
    while not isinstance(fn, triton.runtime.JITFunction):  # Autotuner -> Heuristics -> JITFunction
        fn = fn.fn
    configs = getattr(kernel, "configs", [triton.Config({}, num_warps=4)])
    prune = getattr(kernel, "early_config_prune", None)
    if prune and k is not None:
        w = torch.empty(1, dtype=DTYPES[types["w_ptr"]]).expand(weights)  # its size without its memory
        configs = prune(configs, {"K": k, "w_ptr": w}, **constants)
    if not ALL:  # the first candidate of each code path (the attention kernel's WARPS: two ways to walk the cache)
        firsts: dict[object, triton.Config] = {}
        for cfg in configs:
            firsts.setdefault(cfg.kwargs.get("WARPS"), cfg)
        configs = list(firsts.values())
    for cfg in configs:
        consts = {**constants, **cfg.kwargs}
        if "SINGLE" in fn.arg_names:
            consts.update(SINGLE=cfg.kwargs["BLOCK_K"] >= k, GEMV=constants["BLOCK_M"] < 16,
                          K_ONE=triton.next_power_of_2(k))
        signature = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, consts), target=TARGET,
                                  options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "launch_pdl": True})
        # What the H100 would refuse at load: more shared memory than an SM has.
        assert compiled.metadata.shared <= H100_SHARED, f"{fn.__name__} {cfg}: {compiled.metadata.shared} bytes of shared memory"
    return len(configs)


def compile_sampling() -> int:
    """The sampling kernels in every variant: greedy or sampled, with grammar masks or without."""
    types = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "packed_ptr": "*i32", "temp_ptr": "*fp32",
             "seed_ptr": "*i64", "pos_ptr": "*i64", "val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64",
             **{name: "i32" for name in ("V", "chunk", "n_chunks", "stride_l", "stride_bb", "stride_bv", "stride_p",
                                         "stride_pos")}}
    n = 0
    for sampled in (False, True):
        for masked in (False, True):
            n += compile_all(tsample._chunk_kernel, types, dict(SAMPLED=sampled, MASKED=masked, BLOCK=tsample.BLOCK,
                                                                SLOTS=tsample._SLOTS))
            n += compile_all(tsample._pick_kernel, types, dict(SAMPLED=sampled, MASKED=masked, CHUNKS_P=8, SLOTS=tsample._SLOTS))
    return n


def main() -> int:
    if "--sampling" in sys.argv:
        print(f"compiled {compile_sampling()} sampling kernels for sm_90")
        return 0
    n = 0
    for dt in ("bf16", "fp32") if ALL else ("bf16",):
        p = f"*{dt}"
        ints = dict(M="i32", N="i32", K="i32", T="i32", kv_len="i32", stride_cb="i32", stride_ch="i32", stride_cs="i32")
        ptrs = {name: p for name in ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr",
                                     "a_ptr", "res_ptr", "out_ptr", "y_ptr")}
        types = {**ints, **ptrs, "pos_ptr": "*i64", "rows_ptr": "*i64", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
                 "pacc_ptr": "*fp32", "eps": "fp32", "sm_scale": "fp32"}
        # SmolLM2 (GQA 3, one token per row) and Qwen2.5-0.5B (GQA 7, biases, 5 tokens per row: a
        # verify step), with programmatic dependent launch; tl.dot programs of small weights take
        # 16 rows, of large ones up to 64 (their autotuned candidates: compile_large below).
        block_m = 16
        for heads, kv, bias, t, dim, hidden in ((9, 3, False, 1, 576, 1536), (14, 2, True, 5, 896, 4864)):
            group = heads // kv
            q_p = max(16, triton.next_power_of_2(group * t))
            pdl = dict(USE_PDL=True)
            for rows, bm in ((False, block_m), (True, block_m), (False, 1), (False, 4)):  # BLOCK_M < 16: GEMV
                n += compile_all(td._norm_qkv_rope_kernel, types, dict(N_HEADS=heads, N_KV=kv, HEAD_DIM=64, HAS_BIAS=bias,
                                                                       HAS_ROWS=rows, BLOCK_M=bm, **pdl), dim)
            attn = dict(N_HEADS=heads, N_KV=kv, HEAD_DIM=64, D_P=64, GROUP=group, QROWS=group * t, Q_P=q_p, **pdl)
            for splits in (1, 4):
                n += compile_all(td._attention_kernel, types, dict(attn, SPLITS=splits, HAS_ROWS=False))
            n += compile_all(td._attention_reduce_kernel, types, dict(attn, SPLITS=4, SPLITS_P=4))
            for bm in (block_m, 1, 4):
                for k in (dim, hidden):  # the output and the down projection
                    n += compile_all(td._linear_residual_kernel, types, dict(HAS_BIAS=bias, BLOCK_M=bm, **pdl), k)
                n += compile_all(td._norm_gate_up_kernel, types, dict(HAS_BIAS=bias, BLOCK_M=bm, **pdl), dim)
        # Llama-3.1-8B-sized weights (above SMALL_WEIGHTS): all rows up to 64 a program, autotuned blocks.
        large = td.SMALL_WEIGHTS + 1
        n += compile_all(td._norm_qkv_rope_kernel, types, dict(N_HEADS=32, N_KV=8, HEAD_DIM=128, HAS_BIAS=False,
                                                               HAS_ROWS=False, BLOCK_M=64, **pdl), 4096, large)
        for k in (4096, 14336):
            n += compile_all(td._linear_residual_kernel, types, dict(HAS_BIAS=False, BLOCK_M=64, **pdl), k, large)
        n += compile_all(td._norm_gate_up_kernel, types, dict(HAS_BIAS=False, BLOCK_M=64, **pdl), 4096, large)
    print(f"compiled {n} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
