"""Round 5: the kept kernel's loop with each row's k and v first prefetched into L2, every slot the
row reads (a hint: the positions are read before the wait, clamped to the bucket). MODE 1
``prefetch.global.L2`` a 128-byte line (one slot's k or v), 2 the same with ``evict_last``, 3
``cp.async.bulk.prefetch.L2`` of 1 KiB (8 slots) an element; 0 no prefetch (this copy of the kept
kernel, to compare with it). Then under programmatic dependent launch behind a stand-in for the
q/k/v kernel (``spin``: 60 programs that wait, let the next kernel launch, then compute for ~2 or
~3.5 us), so that the prefetch runs while that kernel computes. Run from the checkout's root."""
import os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton, triton.language as tl
import attn_micro as am
from servekit.optimizations.kernels import triton_decode as td
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


@triton.jit
def _pf(ptrs, MODE: tl.constexpr):
    if MODE == 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 2:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 3:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 1024; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def attn_pf(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, T, sm_scale, stride_cb, stride_ch, stride_cs,
            N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
            GROUP: tl.constexpr, QROWS: tl.constexpr, Q_P: tl.constexpr, USE_PDL: tl.constexpr,
            BLOCK_S: tl.constexpr, MODE: tl.constexpr, PF_BLOCK: tl.constexpr, SKIP_FIRST: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, Q_P)
    r_mask = r < QROWS
    tok = b * T + r // GROUP
    head = g * GROUP + r % GROUP
    k_base = kc_ptr + b * stride_cb + g * stride_ch
    v_base = vc_ptr + b * stride_cb + g * stride_ch
    if MODE > 0:  # before the wait: positions are a hint here, clamped to the bucket
        hint = tl.max(tl.load(pos_ptr + tok, mask=r_mask, other=-1), axis=0)
        n_pf = tl.where(hint < kv_len, hint + 1, 0)
        if MODE == 3:  # 1 KiB (8 slots of 128 B) an element
            for s0 in range(SKIP_FIRST, n_pf, PF_BLOCK * 8):
                s = tl.minimum(s0 + tl.arange(0, PF_BLOCK) * 8, tl.maximum(n_pf - 8, 0))
                _pf(k_base + s * stride_cs, MODE)
                _pf(v_base + s * stride_cs, MODE)
        else:
            for s0 in range(SKIP_FIRST, n_pf, PF_BLOCK):
                s = tl.minimum(s0 + tl.arange(0, PF_BLOCK), n_pf - 1)
                _pf(k_base + s * stride_cs, MODE)
                _pf(v_base + s * stride_cs, MODE)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    pos = tl.load(pos_ptr + tok, mask=r_mask, other=-1)
    d = tl.arange(0, D_P)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((Q_P,), dtype=tl.float32)
    acc = tl.zeros((Q_P, D_P), dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < n_valid
        kt = tl.load(k_base + s[None, :] * stride_cs + d[:, None], mask=d_mask[:, None] & s_mask[None, :], other=0.0)
        scores = tl.dot(q, kt, input_precision="ieee") * sm_scale
        scores = tl.where((s[None, :] <= pos[:, None]) & s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(y_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


@triton.jit
def spin(x_ptr, N, USE_PDL: tl.constexpr):
    # Stands in for the q/k/v kernel before attention: waits, lets the next kernel launch, computes.
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    i = tl.program_id(0)
    x = tl.load(x_ptr + i * 128 + tl.arange(0, 128))
    for _ in range(N):
        x = x * 1.000001 + 0.5
    tl.store(x_ptr + i * 128 + tl.arange(0, 128), x)


def main():
    res = []
    meta = am.META
    scratch = torch.zeros(132 * 128, device=dev)
    for label, kv_len, caches, pos, q, ys, ref, nbytes in am.each_set():
        def kept(bs=128, w=4, st=3):
            return am.kept(caches, ys, q, pos, kv_len, bs, w, st)

        def pf(mode, bs=128, w=4, st=3, pfb=256, skip=0, pdl=False, spin_n=0):
            extra = td._launch(pdl)
            def fn():
                for (k, v), y in zip(caches, ys):
                    if spin_n:
                        spin[(60,)](scratch, spin_n, **extra)
                    attn_pf[(B, NKV)](q, k, v, pos, y, kv_len, 1, HD ** -0.5, k.stride(0), k.stride(1), k.stride(2),
                                      BLOCK_S=bs, MODE=mode, PF_BLOCK=pfb, SKIP_FIRST=skip, num_warps=w,
                                      num_stages=st, **extra, **meta)
            return fn

        def spins(n, pdl):
            extra = td._launch(pdl)
            def fn():
                for _ in range(LAYERS):
                    spin[(60,)](scratch, n, **extra)
            return fn

        variants = [("kept bs128 w4 st3", kept()), ("kept bs64 w4 st3", kept(64)),
                    ("copy mode0", pf(0))]
        for mode in (1, 2, 3):
            variants.append((f"pf mode{mode} bs128", pf(mode)))
        variants.append(("pf mode1 bs64", pf(1, bs=64)))
        variants.append(("pf mode1 bs256", pf(1, bs=256)))
        variants.append(("pf mode1 skip128", pf(1, skip=128)))
        variants.append(("pf mode1 w8", pf(1, w=8)))
        variants.append(("pf mode1 pfb128", pf(1, pfb=128)))
        for name, fn in variants:
            am.measure(res, label, name, fn, ys, ref, nbytes)
        # Under PDL behind a kernel of ~3 us: the prefetch runs while that kernel computes.
        for n in (400, 800):
            am.measure(res, label, f"spin{n} alone pdl", spins(n, True), [ref], ref, nbytes)
            for mode in (0, 1, 2, 3):
                am.measure(res, label, f"spin{n}+attn mode{mode} pdl", pf(mode, pdl=True, spin_n=n), ys, ref, nbytes)
    am.save(res, "attn_micro5")


if __name__ == "__main__":
    main()
