"""Round 6: the kept kernel with 1 and 2 warps a program (round 1 tried 4 and 8), alone and with 2 or
4 cache splits and the reduce kernel. Run from the checkout's root."""
import itertools, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton
import attn_micro as am
from servekit.optimizations.kernels import triton_decode as td

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


def main():
    res = []
    q_p, d_p = 16, 64
    meta = dict(N_HEADS=NH, N_KV=NKV, HEAD_DIM=HD, D_P=d_p, GROUP=GROUP, QROWS=GROUP, Q_P=q_p)
    for label, kv_len, lo, hi in am.SETS:
        caches, pos, q = am.make(kv_len, lo, hi)
        nbytes = am.cache_bytes(pos)
        ys = [torch.empty_like(q) for _ in range(LAYERS)]
        ref = am.reference(q, *caches[0], pos)

        def base(bs, w, st, splits=1):
            parts = B * NKV * splits * q_p
            pm = torch.empty(parts, device=dev); pl = torch.empty(parts, device=dev); pacc = torch.empty(parts, d_p, device=dev)
            def fn():
                for (k, v), y in zip(caches, ys):
                    td._attention_kernel.fn[(B, NKV, splits)](q, k, v, pos, pos, y, pm, pl, pacc, kv_len, 1, HD ** -0.5,
                        k.stride(0), k.stride(1), k.stride(2), HAS_ROWS=False, USE_PDL=False, SPLITS=splits,
                        BLOCK_S=bs, num_warps=w, num_stages=st, **meta)
                    if splits > 1:
                        td._attention_reduce_kernel[(B, NKV, GROUP)](y, pm, pl, pacc, 1, SPLITS=splits,
                            SPLITS_P=triton.next_power_of_2(splits), USE_PDL=False, num_warps=1, **meta)
            return fn
        variants = [("kept bs128 w4 st3", base(128, 4, 3))]
        for bs, w, st in itertools.product((32, 64, 128, 256), (1, 2), (2, 3, 4)):
            variants.append((f"bs{bs} w{w} st{st}", base(bs, w, st)))
        for sp, bs, w in itertools.product((2, 4), (64, 128), (1, 2)):
            variants.append((f"splits{sp} bs{bs} w{w} st3", base(bs, w, 3, sp)))
        for name, fn in variants:
            am.measure(res, label, name, fn, ys, ref, nbytes)
    am.save(res, "attn_micro6")


if __name__ == "__main__":
    main()
