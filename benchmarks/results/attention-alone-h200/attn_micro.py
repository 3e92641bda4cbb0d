"""Batch-32 decode attention alone (round 1): the kept kernel's configurations, cache splits with the
reduce kernel, and a variant with two online softmaxes a program; 30 launches (one per layer, each
over its own cache) in one CUDA graph. With DEV=cpu TRITON_INTERPRET=1 LAYERS=1 the rounds' kernels
can be imported and called on the CPU (fp32) to check them against ``reference``; ``main()`` times
them and needs the GPU."""
import itertools, json, os
import torch, triton, triton.language as tl
from servekit.optimizations.kernels import triton_decode as td

dev = torch.device(os.environ.get("DEV", "cuda"))
B, NH, NKV, HD = 32, 9, 3, 64
GROUP = NH // NKV
DT = torch.float32 if os.environ.get("DEV") == "cpu" else torch.bfloat16
LAYERS = int(os.environ.get("LAYERS", 30))


@triton.jit
def attn2(q_ptr, kc_ptr, vc_ptr, pos_ptr, y_ptr, kv_len, T, sm_scale, stride_cb, stride_ch, stride_cs,
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
    q = tl.load(q_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    crow = b
    last = tl.max(pos, axis=0)
    n_valid = tl.where(last < kv_len, last + 1, 0)
    k_base = kc_ptr + crow * stride_cb + g * stride_ch
    v_base = vc_ptr + crow * stride_cb + g * stride_ch
    m_a = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_a = tl.zeros((Q_P,), dtype=tl.float32)
    acc_a = tl.zeros((Q_P, D_P), dtype=tl.float32)
    m_b = tl.full((Q_P,), -1e30, dtype=tl.float32)
    l_b = tl.zeros((Q_P,), dtype=tl.float32)
    acc_b = tl.zeros((Q_P, D_P), dtype=tl.float32)
    for s0 in range(0, n_valid, 2 * BLOCK_S):
        sa = s0 + tl.arange(0, BLOCK_S)
        sb = sa + BLOCK_S
        ma_ = sa < n_valid
        mb_ = sb < n_valid
        ka = tl.load(k_base + sa[None, :] * stride_cs + d[:, None], mask=d_mask[:, None] & ma_[None, :], other=0.0)
        kb = tl.load(k_base + sb[None, :] * stride_cs + d[:, None], mask=d_mask[:, None] & mb_[None, :], other=0.0)
        va = tl.load(v_base + sa[:, None] * stride_cs + d[None, :], mask=ma_[:, None] & d_mask[None, :], other=0.0)
        vb = tl.load(v_base + sb[:, None] * stride_cs + d[None, :], mask=mb_[:, None] & d_mask[None, :], other=0.0)
        sc_a = tl.dot(q, ka) * sm_scale
        sc_b = tl.dot(q, kb) * sm_scale
        sc_a = tl.where((sa[None, :] <= pos[:, None]) & ma_[None, :], sc_a, float("-inf"))
        sc_b = tl.where((sb[None, :] <= pos[:, None]) & mb_[None, :], sc_b, float("-inf"))
        mna = tl.maximum(m_a, tl.max(sc_a, axis=1))
        mnb = tl.maximum(m_b, tl.max(sc_b, axis=1))
        al_a = tl.exp(m_a - mna)
        al_b = tl.exp(m_b - mnb)
        p_a = tl.exp(sc_a - mna[:, None])
        p_b = tl.exp(sc_b - mnb[:, None])
        l_a = l_a * al_a + tl.sum(p_a, axis=1)
        l_b = l_b * al_b + tl.sum(p_b, axis=1)
        acc_a = acc_a * al_a[:, None] + tl.dot(p_a.to(va.dtype), va)
        acc_b = acc_b * al_b[:, None] + tl.dot(p_b.to(vb.dtype), vb)
        m_a = mna
        m_b = mnb
    m = tl.maximum(m_a, m_b)
    wa = tl.exp(m_a - m)
    wb = tl.exp(m_b - m)
    l = l_a * wa + l_b * wb
    acc = acc_a * wa[:, None] + acc_b * wb[:, None]
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(y_ptr + (tok * (N_HEADS * HEAD_DIM) + head * HEAD_DIM)[:, None] + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def make(kv_len, lo, hi, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    caches = [(torch.randn(B + 1, NKV, kv_len, HD, device=dev, dtype=DT, generator=g),
               torch.randn(B + 1, NKV, kv_len, HD, device=dev, dtype=DT, generator=g)) for _ in range(LAYERS)]
    pos = torch.linspace(lo, hi, B, device=dev).round().long()
    q = torch.randn(B, NH * HD, device=dev, dtype=DT, generator=g)
    return caches, pos, q


def reference(q, k, v, pos):
    out = torch.empty_like(q)
    for b in range(B):
        n = int(pos[b]) + 1
        qq = q[b].view(NH, HD).float()
        kk = k[b, :, :n].float().repeat_interleave(GROUP, 0)
        vv = v[b, :, :n].float().repeat_interleave(GROUP, 0)
        a = torch.softmax((qq[:, None, :] @ kk.transpose(1, 2)).squeeze(1) * HD ** -0.5, -1)
        out[b] = (a[:, None, :] @ vv).squeeze(1).reshape(-1).to(q.dtype)
    return out


def graph_time(fn, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    gr.replay(); torch.cuda.synchronize()
    best = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            gr.replay()
        e1.record(); torch.cuda.synchronize()
        best.append(e0.elapsed_time(e1) / reps / LAYERS * 1e3)
    best.sort()
    return best[len(best) // 2]


# (set, kv bucket, lowest and highest position of the 32 rows)
SETS = (("short", 512, 188, 444), ("passages", 1024, 450, 956), ("long", 2048, 1024, 2000))


def cache_bytes(pos, elt=2):
    """Bytes of k and v the rows at ``pos`` read a layer, ``elt`` bytes an element."""
    return sum(int(p) + 1 for p in pos.tolist()) * NKV * HD * 2 * elt


def measure(res, label, name, fn, ys, ref, nbytes):
    """Run ``fn`` once, compare its first layer's output (``ys[0]``) with ``ref``, time it; its row
    into ``res`` and printed (a failure printed instead)."""
    try:
        fn(); torch.cuda.synchronize()
        err = (ys[0].float() - ref.float()).abs().max().item()
        us = graph_time(fn)
    except Exception as e:
        print(label, name, "FAILED", repr(e)[:300], flush=True)
        return
    row = dict(set=label, variant=name, us_per_layer=round(us, 2), tb_s=round(nbytes / us / 1e6, 2), max_err=round(err, 4))
    res.append(row)
    print(json.dumps(row), flush=True)


def save(res, name):
    json.dump(res, open(f"{os.environ.get('OUT', '/tmp')}/{name}.json", "w"), indent=1)


# The constants every round's kernels take: SmolLM2's attention shape, one token a row.
META = dict(N_HEADS=NH, N_KV=NKV, HEAD_DIM=HD, D_P=64, GROUP=GROUP, QROWS=GROUP, Q_P=16)


def each_set():
    """For each of ``SETS``: its label, kv bucket, the layers' caches, the rows' positions, q, the
    layers' outputs, the fp32 reference of the first layer's output and the bytes a layer reads."""
    for label, kv_len, lo, hi in SETS:
        caches, pos, q = make(kv_len, lo, hi)
        yield (label, kv_len, caches, pos, q, [torch.empty_like(q) for _ in range(LAYERS)],
               reference(q, *caches[0], pos), cache_bytes(pos))


def kept(caches, ys, q, pos, kv_len, bs=128, w=4, st=3, splits=1, reduce_warps=4):
    """The kept kernel (``td._attention_kernel`` without its autotuner, its warps sharing each block)
    over ``caches`` into ``ys``, a launch a layer; with ``splits``, the reduce kernel after each."""
    parts = B * NKV * splits * META["Q_P"]
    pm, pl, pacc = (torch.empty(parts, device=dev), torch.empty(parts, device=dev),
                    torch.empty(parts, META["D_P"], device=dev))
    def fn():
        for (k, v), y in zip(caches, ys):
            td._attention_kernel.fn[(B, NKV, splits)](q, k, v, pos, pos, y, pm, pl, pacc, kv_len, 1, HD ** -0.5,
                k.stride(0), k.stride(1), k.stride(2), HAS_ROWS=False, USE_PDL=False, SPLITS=splits,
                BLOCK_S=bs, WARPS=0, num_warps=w, num_stages=st, **META)
            if splits > 1:
                td._attention_reduce_kernel[(B, NKV, GROUP)](y, pm, pl, pacc, 1, SPLITS=splits,
                    SPLITS_P=triton.next_power_of_2(splits), USE_PDL=False, num_warps=reduce_warps, **META)
    return fn


def layers(kernel, caches, ys, q, pos, kv_len, *scalars, **kw):
    """``kernel``, a round's attention variant whose arguments are (q, k, v, positions, out, kv bucket,
    ``scalars``, the cache's three strides), launched once a layer over ``caches`` into ``ys``, one
    program per (row, kv head); ``kw``: its constexprs and launch options."""
    def fn():
        for (k, v), y in zip(caches, ys):
            kernel[(B, NKV)](q, k, v, pos, y, kv_len, *scalars, k.stride(0), k.stride(1), k.stride(2), **kw)
    return fn


def main():
    res = []
    for label, kv_len, caches, pos, q, ys, ref, nbytes in each_set():
        def base(bs, w, st, splits=1):
            return kept(caches, ys, q, pos, kv_len, bs, w, st, splits)
        def two(bs, w, st):
            return layers(attn2, caches, ys, q, pos, kv_len, 1, HD ** -0.5, BLOCK_S=bs, num_warps=w,
                          num_stages=st, **META)
        variants = []
        for bs, w, st in itertools.product((32, 64, 128, 256), (4, 8), (2, 3, 4)):
            variants.append((f"base bs{bs} w{w} st{st}", base(bs, w, st)))
        for bs, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3)):
            variants.append((f"two bs{bs} w{w} st{st}", two(bs, w, st)))
        for sp in (2, 3, 4):
            variants.append((f"base bs64 w4 st3 splits{sp}", base(64, 4, 3, sp)))
        for name, fn in variants:
            measure(res, label, name, fn, ys, ref, nbytes)
    save(res, "attn_micro")
    for label in ("short", "passages", "long"):
        rows = sorted([r for r in res if r["set"] == label], key=lambda r: r["us_per_layer"])
        print("BEST", label, rows[:6])
        print("CURRENT-LIKE", label, [r for r in rows if r["variant"] in ("base bs64 w4 st3", "base bs128 w4 st3", "base bs32 w4 st3")])


if __name__ == "__main__":
    main()
