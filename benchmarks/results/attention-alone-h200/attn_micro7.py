"""Round 7: the kept kernel's loop with less work a slot: full blocks without masks (T = 1: only
the blocks past the row's lowest position need one; a second loop takes those), exp2 with log2(e)
folded into the scale (``EXP2``), and q scaled before the dot instead of the scores after it
(``PRESCALE``: one multiply a query element instead of one a score; q rounded to bf16 once more).
Run from the checkout's root."""
import itertools, math, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import triton, triton.language as tl
import attn_micro as am

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


@triton.jit
def _block(q, k_base, v_base, s0, d, d_mask, pos, n_valid, scale, m_i, l_i, acc, stride_cs,
           BLOCK_S: tl.constexpr, MASKED: tl.constexpr, EXP2: tl.constexpr, PRESCALE: tl.constexpr):
    s = s0 + tl.arange(0, BLOCK_S)
    if MASKED:
        s_mask = s < n_valid
        kt = tl.load(k_base + s[None, :] * stride_cs + d[:, None], mask=d_mask[:, None] & s_mask[None, :], other=0.0)
        v = tl.load(v_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        kt = tl.load(k_base + s[None, :] * stride_cs + d[:, None])
        v = tl.load(v_base + s[:, None] * stride_cs + d[None, :])
    scores = tl.dot(q, kt, input_precision="ieee")
    if not PRESCALE:
        scores = scores * scale
    if MASKED:
        scores = tl.where((s[None, :] <= pos[:, None]) & s_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    if EXP2:
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def attn_lean(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, T, scale, stride_cb, stride_ch, stride_cs,
              N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
              GROUP: tl.constexpr, QROWS: tl.constexpr, Q_P: tl.constexpr, BLOCK_S: tl.constexpr,
              UNMASKED: tl.constexpr, EXP2: tl.constexpr, PRESCALE: tl.constexpr):
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
    if PRESCALE:
        q = (q.to(tl.float32) * scale).to(q.dtype)
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    # Every query row sees every slot up to its lowest position (padding rows aside): blocks below it
    # need no mask.
    lowest = tl.min(tl.where(r_mask, pos, kv_len), axis=0)
    n_full = tl.where(last < kv_len, (lowest + 1) // BLOCK_S * BLOCK_S, 0) if UNMASKED else 0
    k_base = kc_ptr + b * stride_cb + g * stride_ch
    v_base = vc_ptr + b * stride_cb + g * stride_ch
    m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((Q_P,), dtype=tl.float32)
    acc = tl.zeros((Q_P, D_P), dtype=tl.float32)
    for s0 in range(0, n_full, BLOCK_S):
        m_i, l_i, acc = _block(q, k_base, v_base, s0, d, d_mask, pos, n_valid, scale, m_i, l_i, acc, stride_cs,
                               BLOCK_S, False, EXP2, PRESCALE)
    for s0 in range(n_full, n_valid, BLOCK_S):
        m_i, l_i, acc = _block(q, k_base, v_base, s0, d, d_mask, pos, n_valid, scale, m_i, l_i, acc, stride_cs,
                               BLOCK_S, True, EXP2, PRESCALE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(y_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def main():
    res = []
    meta = am.META
    for label, kv_len, caches, pos, q, ys, ref, nbytes in am.each_set():
        def kept():
            return am.kept(caches, ys, q, pos, kv_len)

        def lean(unmasked, exp2, prescale, bs=128, w=4, st=3):
            scale = HD ** -0.5 * (math.log2(math.e) if exp2 else 1.0)
            return am.layers(attn_lean, caches, ys, q, pos, kv_len, 1, scale, BLOCK_S=bs, UNMASKED=unmasked,
                             EXP2=exp2, PRESCALE=prescale, num_warps=w, num_stages=st, **meta)

        variants = [("kept bs128 w4 st3", kept())]
        for unmasked, exp2, prescale in itertools.product((False, True), repeat=3):
            variants.append((f"lean unmasked={int(unmasked)} exp2={int(exp2)} prescale={int(prescale)}",
                             lean(unmasked, exp2, prescale)))
        for bs, w, st in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
            variants.append((f"lean all bs{bs} w{w} st{st}", lean(True, True, True, bs, w, st)))
        for name, fn in variants:
            am.measure(res, label, name, fn, ys, ref, nbytes)
    am.save(res, "attn_micro7")


if __name__ == "__main__":
    main()
