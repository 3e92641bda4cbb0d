"""Compile every fused decode kernel (every autotune candidate) for an H100 (sm_90) without a GPU:
Triton's front end, LLVM and ptxas, which the interpreter never runs. Catches type errors and
unsupported constructs before the code reaches a GPU. Run by test_triton_decode.py in a
subprocess (the interpreter, once on, is on for the whole process):

    python tests/triton_compile_check.py          # bf16, each kernel's first candidate (~15 s)
    python tests/triton_compile_check.py --all    # bf16 and fp32, every candidate (~90 s)
"""
from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "compiles real kernels: run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from servekit.optimizations import triton_decode as td  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


ALL = "--all" in sys.argv


def compile_all(kernel, types: dict[str, str], constants: dict[str, object]) -> int:
    """Compile ``kernel`` (autotuned or plain) with its first (``--all``: each) candidate configuration."""
    fn = kernel if isinstance(kernel, triton.runtime.JITFunction) else kernel.fn  # an Autotuner wraps it
    configs = getattr(kernel, "configs", [triton.Config({}, num_warps=4)])[:None if ALL else 1]
    for cfg in configs:
        consts = {**constants, **cfg.kwargs}
        signature = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
        triton.compile(ASTSource(fn, signature, consts), target=TARGET, options={"num_warps": cfg.num_warps})
    return len(configs)


def main() -> int:
    n = 0
    for dt in ("bf16", "fp32") if ALL else ("bf16",):
        p = f"*{dt}"
        ints = dict(M="i32", N="i32", K="i32", T="i32", kv_len="i32", stride_cb="i32", stride_ch="i32", stride_cs="i32")
        ptrs = {name: p for name in ("x_ptr", "g_ptr", "w_ptr", "b_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr",
                                     "a_ptr", "res_ptr", "out_ptr", "y_ptr")}
        types = {**ints, **ptrs, "pos_ptr": "*i64", "rows_ptr": "*i64", "pm_ptr": "*fp32", "pl_ptr": "*fp32",
                 "pacc_ptr": "*fp32", "eps": "fp32", "sm_scale": "fp32"}
        # SmolLM2 (GQA 3, one token per row) and Qwen2.5-0.5B (GQA 7, biases, 5 tokens per row: a verify step).
        for heads, kv, bias, t, block_m in ((9, 3, False, 1, 16), (14, 2, True, 5, 64)):
            group = heads // kv
            q_p = max(16, triton.next_power_of_2(group * t))
            for rows in (False, True):
                n += compile_all(td._norm_qkv_rope_kernel, types, dict(N_HEADS=heads, N_KV=kv, HEAD_DIM=64, HAS_BIAS=bias,
                                                                       HAS_ROWS=rows, BLOCK_M=block_m))
            attn = dict(N_HEADS=heads, N_KV=kv, HEAD_DIM=64, D_P=64, GROUP=group, QROWS=group * t, Q_P=q_p)
            for splits in (1, 4):
                n += compile_all(td._attention_kernel, types, dict(attn, SPLITS=splits, HAS_ROWS=False))
            n += compile_all(td._attention_reduce_kernel, types, dict(attn, SPLITS=4, SPLITS_P=4))
            n += compile_all(td._linear_residual_kernel, types, dict(HAS_BIAS=bias, BLOCK_M=block_m))
            n += compile_all(td._norm_gate_up_kernel, types, dict(HAS_BIAS=bias, BLOCK_M=block_m))
    print(f"compiled {n} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
