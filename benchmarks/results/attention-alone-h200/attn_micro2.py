"""Round 2: natural K loads (+tl.trans), TMA descriptors, splits without reduce."""
import itertools, json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton, triton.language as tl
from attn_micro import SETS, cache_bytes, layers, make, measure, reference, save, B, NH, NKV, HD, GROUP, LAYERS, dev
from servekit.optimizations.kernels import triton_decode as td


@triton.jit
def attn_nat(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, sm_scale, stride_cb, stride_ch, stride_cs,
             N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QROWS: tl.constexpr,
             Q_P: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, Q_P)
    r_mask = r < QROWS
    head = g * GROUP + r % GROUP
    pos = tl.load(pos_ptr + b + r * 0, mask=r_mask, other=-1)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (b * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :], mask=r_mask[:, None], other=0.0)
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    k_base = kc_ptr + b * stride_cb + g * stride_ch
    v_base = vc_ptr + b * stride_cb + g * stride_ch
    m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((Q_P,), dtype=tl.float32)
    acc = tl.zeros((Q_P, HEAD_DIM), dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < n_valid
        k = tl.load(k_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * sm_scale
        scores = tl.where((s[None, :] <= pos[:, None]) & s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + s[:, None] * stride_cs + d[None, :], mask=s_mask[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(y_ptr + (b * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None])


@triton.jit
def attn_tma(q_ptr, k_desc, v_desc, pos_ptr, y_ptr, kv_len, sm_scale,
             N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QROWS: tl.constexpr,
             Q_P: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, Q_P)
    r_mask = r < QROWS
    head = g * GROUP + r % GROUP
    pos = tl.load(pos_ptr + b + r * 0, mask=r_mask, other=-1)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (b * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :], mask=r_mask[:, None], other=0.0)
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    m_i = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((Q_P,), dtype=tl.float32)
    acc = tl.zeros((Q_P, HEAD_DIM), dtype=tl.float32)
    for s0 in range(0, n_valid, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        k = k_desc.load([b, g, s0, 0]).reshape(BLOCK_S, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k)) * sm_scale
        scores = tl.where((s[None, :] <= pos[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = v_desc.load([b, g, s0, 0]).reshape(BLOCK_S, HEAD_DIM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(y_ptr + (b * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None])


def main():
    res = []
    meta = dict(N_HEADS=NH, HEAD_DIM=HD, GROUP=GROUP, QROWS=GROUP, Q_P=16)
    bmeta = dict(N_HEADS=NH, N_KV=NKV, HEAD_DIM=HD, D_P=64, GROUP=GROUP, QROWS=GROUP, Q_P=16)
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except Exception as e:
        TensorDescriptor = None
        print("no TensorDescriptor", e)
    for label, kv_len, lo, hi in SETS:
        caches, pos, q = make(kv_len, lo, hi)
        nbytes = cache_bytes(pos)
        ys = [torch.empty_like(q) for _ in range(LAYERS)]
        ref = reference(q, *caches[0], pos)
        variants = []
        def base(bs, w, st):
            def fn():
                for (k, v), y in zip(caches, ys):
                    td._attention_kernel.fn[(B, NKV, 1)](q, k, v, pos, pos, y, y, y, y, kv_len, 1, HD ** -0.5,
                        k.stride(0), k.stride(1), k.stride(2), HAS_ROWS=False, USE_PDL=False, SPLITS=1,
                        BLOCK_S=bs, WARPS=0, num_warps=w, num_stages=st, **bmeta)
            return fn
        variants.append(("base bs128 w4 st3", base(128, 4, 3)))
        for bs, w, st in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
            variants.append((f"nat bs{bs} w{w} st{st}", layers(attn_nat, caches, ys, q, pos, kv_len, HD ** -0.5,
                                                                BLOCK_S=bs, num_warps=w, num_stages=st, **meta)))
        if TensorDescriptor is not None:
            for bs, w, st in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
                descs = [(TensorDescriptor.from_tensor(k, [1, 1, bs, HD]), TensorDescriptor.from_tensor(v, [1, 1, bs, HD]))
                         for k, v in caches]
                def tma(bs=bs, w=w, st=st, descs=descs):
                    for (kd, vd), y in zip(descs, ys):
                        attn_tma[(B, NKV)](q, kd, vd, pos, y, kv_len, HD ** -0.5, BLOCK_S=bs, num_warps=w,
                                           num_stages=st, **meta)
                variants.append((f"tma bs{bs} w{w} st{st}", tma))
        for sp in (2, 4):
            parts = B * NKV * sp * 16
            pm = torch.empty(parts, device=dev); pl = torch.empty(parts, device=dev); pacc = torch.empty(parts, 64, device=dev)
            def only(sp=sp, pm=pm, pl=pl, pacc=pacc):
                for (k, v), y in zip(caches, ys):
                    td._attention_kernel.fn[(B, NKV, sp)](q, k, v, pos, pos, y, pm, pl, pacc, kv_len, 1, HD ** -0.5,
                        k.stride(0), k.stride(1), k.stride(2), HAS_ROWS=False, USE_PDL=False, SPLITS=sp,
                        BLOCK_S=64, WARPS=0, num_warps=4, num_stages=3, **bmeta)
            def red(sp=sp, pm=pm, pl=pl, pacc=pacc):
                for y in ys:
                    td._attention_reduce_kernel[(B, NKV, GROUP)](y, pm, pl, pacc, 1, SPLITS=sp,
                        SPLITS_P=triton.next_power_of_2(sp), USE_PDL=False, **bmeta)
            variants.append((f"splits{sp} kernel only (no reduce; output not checked)", only))
            variants.append((f"splits{sp} reduce only", red))
        for name, fn in variants:
            measure(res, label, name, fn, ys, ref, nbytes)
    save(res, "attn_micro2")
    for label in ("short", "passages", "long"):
        rows = sorted([r for r in res if r["set"] == label], key=lambda r: r["us_per_layer"])
        print("BEST", label, json.dumps(rows[:8]))
        print("BASE", label, json.dumps([r for r in rows if r["variant"].startswith(("base", "splits"))]))


if __name__ == "__main__":
    main()
