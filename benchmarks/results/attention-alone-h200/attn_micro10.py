"""Round 10: the dots turned over, so that the block's slots are the rows of both tl.dots: scores'
= k (S x 64) . q' (64 x 16) and out' += v' (64 x S) . p' (S x 16). With 64 or more rows a dot,
Triton may use Hopper's warpgroup MMA, which reads its operands from shared memory itself instead of
each warp loading them into registers first. Run from the checkout's root."""
import itertools, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton, triton.language as tl
import attn_micro as am

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


@triton.jit
def attn_turned(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, T, sm_scale, stride_cb, stride_ch, stride_cs,
                N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
                GROUP: tl.constexpr, QROWS: tl.constexpr, Q_P: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, Q_P)
    r_mask = r < QROWS
    tok = b * T + r // GROUP
    head = g * GROUP + r % GROUP
    pos = tl.load(pos_ptr + tok, mask=r_mask, other=-1)
    d = tl.arange(0, D_P)
    d_mask = d < HEAD_DIM
    q_t = tl.load(q_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[None, :] + d[:, None],
                  mask=d_mask[:, None] & r_mask[None, :], other=0.0)  # (D, Q)
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    k_base = kc_ptr + b * stride_cb + g * stride_ch
    v_base = vc_ptr + b * stride_cb + g * stride_ch
    m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((Q_P,), dtype=tl.float32)
    acc_t = tl.zeros((D_P, Q_P), dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < n_valid
        k = tl.load(k_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        scores_t = tl.dot(k, q_t, input_precision="ieee") * sm_scale  # (S, Q)
        scores_t = tl.where((s[:, None] <= pos[None, :]) & s_mask[:, None], scores_t, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores_t, axis=0))
        alpha = tl.exp(m_i - m_new)
        p_t = tl.exp(scores_t - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p_t, axis=0)
        v_t = tl.load(v_base + s[None, :] * stride_cs + d[:, None], mask=d_mask[:, None] & s_mask[None, :], other=0.0)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p_t.to(v_t.dtype), input_precision="ieee")  # (D, Q)
        m_i = m_new
    out_t = acc_t / tl.where(l_i > 0, l_i, 1.0)[None, :]
    tl.store(y_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[None, :] + d[:, None],
             out_t.to(y_ptr.dtype.element_ty), mask=d_mask[:, None] & r_mask[None, :])


def main():
    res = []
    meta = am.META
    for label, kv_len, caches, pos, q, ys, ref, nbytes in am.each_set():
        def kept():
            return am.kept(caches, ys, q, pos, kv_len)

        def turned(bs, w, st):
            return am.layers(attn_turned, caches, ys, q, pos, kv_len, 1, HD ** -0.5, BLOCK_S=bs, num_warps=w,
                             num_stages=st, **meta)

        variants = [("kept bs128 w4 st3", kept())]
        for bs, w, st in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
            variants.append((f"turned bs{bs} w{w} st{st}", turned(bs, w, st)))
        for name, fn in variants:
            am.measure(res, label, name, fn, ys, ref, nbytes)
    am.save(res, "attn_micro10")
    if dev.type == "cuda":  # which MMA Triton chose
        caches, pos, q = am.make(1024, 450, 956)
        (k, v), y = caches[0], torch.empty_like(q)
        kern = attn_turned[(B, NKV)](q, k, v, pos, y, 1024, 1, HD ** -0.5, k.stride(0), k.stride(1), k.stride(2),
                                     BLOCK_S=128, num_warps=4, num_stages=3, **meta)
        ir = kern.asm["ttgir"]
        print("warpgroup MMA:", "warp_group_dot" in ir, "| MMA layouts:",
              sorted({line.split("=", 1)[1].strip()[:90] for line in ir.splitlines() if line.startswith("#mma")}))


if __name__ == "__main__":
    main()
