"""Round 4: decode attention on the CUDA cores (no tl.dot): GROUP query heads of a kv head, T = 1."""
import itertools, json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton, triton.language as tl
from attn_micro import SETS, cache_bytes, layers, make, measure, reference, save, NH, HD, GROUP, LAYERS
from attn_micro2 import attn_nat


@triton.jit
def attn_cc(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, sm_scale, stride_cb, stride_ch, stride_cs,
            N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, Q_P: tl.constexpr,
            BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, Q_P)
    r_mask = r < GROUP
    head = g * GROUP + r
    pos = tl.load(pos_ptr + b)
    n_valid = tl.where(pos < kv_len, pos + 1, 0)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (b * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
                mask=r_mask[:, None], other=0.0).to(tl.float32) * sm_scale
    k_base = kc_ptr + b * stride_cb + g * stride_ch
    v_base = vc_ptr + b * stride_cb + g * stride_ch
    m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((Q_P,), dtype=tl.float32)
    acc = tl.zeros((Q_P, HEAD_DIM), dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < n_valid
        k = tl.load(k_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(y_ptr + (b * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None])


def main():
    res = []
    meta = dict(N_HEADS=NH, HEAD_DIM=HD, GROUP=GROUP, QROWS=GROUP, Q_P=16)
    cmeta = dict(N_HEADS=NH, HEAD_DIM=HD, GROUP=GROUP, Q_P=triton.next_power_of_2(GROUP))
    for label, kv_len, lo, hi in SETS:
        caches, pos, q = make(kv_len, lo, hi)
        nbytes = cache_bytes(pos)
        ys = [torch.empty_like(q) for _ in range(LAYERS)]
        ref = reference(q, *caches[0], pos)
        variants = []
        variants.append(("tl.dot bs128 w4 st3 (kept)", layers(attn_nat, caches, ys, q, pos, kv_len, HD ** -0.5,
                                                               BLOCK_S=128, num_warps=4, num_stages=3, **meta)))
        for bs, w, st in itertools.product((16, 32, 64, 128), (2, 4, 8), (1, 2, 3)):
            variants.append((f"cuda-cores bs{bs} w{w} st{st}", layers(attn_cc, caches, ys, q, pos, kv_len, HD ** -0.5,
                                                                       BLOCK_S=bs, num_warps=w, num_stages=st, **cmeta)))
        for name, fn in variants:
            measure(res, label, name, fn, ys, ref, nbytes)
    save(res, "attn_micro4")
    for label in ("short", "passages", "long"):
        rows = sorted([r for r in res if r["set"] == label], key=lambda r: r["us_per_layer"])
        print("BEST", label, json.dumps(rows[:5]))
        print("KEPT", label, json.dumps([r for r in rows if "kept" in r["variant"]]))


if __name__ == "__main__":
    main()
