"""Round 8: each warp of a program walks its own share of every block, with an online softmax of its
own, and the warps' partial softmaxes merge once at the end. The loop is a batched ``tl.dot`` over
a leading dimension of W = the program's warps ([W, 16, 64] x [W, 64, S] for S slots a warp), so
that a score's row maximum and sum stay inside a warp instead of crossing the program's warps at
every block. Run from the checkout's root."""
import itertools, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import triton, triton.language as tl
import attn_micro as am

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


@triton.jit
def attn_warps(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, T, sm_scale, stride_cb, stride_ch, stride_cs,
               N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
               GROUP: tl.constexpr, QROWS: tl.constexpr, Q_P: tl.constexpr, W: tl.constexpr, S: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, Q_P)
    r_mask = r < QROWS
    tok = b * T + r // GROUP
    head = g * GROUP + r % GROUP
    pos = tl.load(pos_ptr + tok, mask=r_mask, other=-1)
    d = tl.arange(0, D_P)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    q3 = tl.broadcast_to(q[None, :, :], (W, Q_P, D_P))
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    k_base = kc_ptr + b * stride_cb + g * stride_ch
    v_base = vc_ptr + b * stride_cb + g * stride_ch
    w = tl.arange(0, W)
    j = tl.arange(0, S)
    m_i = tl.full((W, Q_P), -1e30, dtype=tl.float32)
    l_i = tl.zeros((W, Q_P), dtype=tl.float32)
    acc = tl.zeros((W, Q_P, D_P), dtype=tl.float32)
    for s0 in range(0, n_valid, W * S):
        s = s0 + w[:, None] * S + j[None, :]  # (W, S): warp w's slots of this block
        s_mask = s < n_valid
        kt = tl.load(k_base + s[:, None, :] * stride_cs + d[None, :, None],
                     mask=s_mask[:, None, :] & d_mask[None, :, None], other=0.0)  # (W, D, S)
        scores = tl.dot(q3, kt, input_precision="ieee") * sm_scale  # (W, Q, S)
        scores = tl.where((s[:, None, :] <= pos[None, :, None]) & s_mask[:, None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=2))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, axis=2)
        v = tl.load(v_base + s[:, :, None] * stride_cs + d[None, None, :],
                    mask=s_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # (W, S, D)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    m = tl.max(m_i, axis=0)
    scale = tl.exp(m_i - m[None, :])
    l = tl.sum(l_i * scale, axis=0)
    out = tl.sum(acc * scale[:, :, None], axis=0) / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(y_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def main():
    res = []
    meta = am.META
    for label, kv_len, caches, pos, q, ys, ref, nbytes in am.each_set():
        def kept():
            return am.kept(caches, ys, q, pos, kv_len)

        def warps(w, s, st):
            return am.layers(attn_warps, caches, ys, q, pos, kv_len, 1, HD ** -0.5, W=w, S=s, num_warps=w,
                             num_stages=st, **meta)

        variants = [("kept bs128 w4 st3", kept())]
        for w, s, st in itertools.product((2, 4, 8), (16, 32, 64), (2, 3, 4)):
            variants.append((f"warps W{w} S{s} st{st}", warps(w, s, st)))
        for name, fn in variants:
            am.measure(res, label, name, fn, ys, ref, nbytes)
    am.save(res, "attn_micro8")


if __name__ == "__main__":
    main()
