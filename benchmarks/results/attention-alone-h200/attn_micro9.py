"""Round 9: is a block's step the wait for its cache? The kept kernel over 30 layers' own caches (as
every round: from memory) against 30 launches over one layer's cache (17 MB over passages, held in
the H200's 50 MB L2 after the first), and with deeper pipelines (more blocks in flight). Run from
the checkout's root."""
import itertools, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch
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

        def kept(layer_caches, bs=128, w=4, st=3):
            def fn():
                for (k, v), y in zip(layer_caches, ys):
                    td._attention_kernel.fn[(B, NKV, 1)](q, k, v, pos, pos, y, y, y, y, kv_len, 1, HD ** -0.5,
                        k.stride(0), k.stride(1), k.stride(2), HAS_ROWS=False, USE_PDL=False, SPLITS=1,
                        BLOCK_S=bs, num_warps=w, num_stages=st, **meta)
            return fn

        one = [caches[0]] * LAYERS
        variants = [("kept, own caches", kept(caches)), ("kept, one cache (L2)", kept(one))]
        for bs, st in itertools.product((32, 64, 128), (5, 6, 8)):
            variants.append((f"own caches bs{bs} w4 st{st}", kept(caches, bs, 4, st)))
            variants.append((f"one cache bs{bs} w4 st{st}", kept(one, bs, 4, st)))
        for name, fn in variants:
            am.measure(res, label, name, fn, ys, ref, nbytes)
    am.save(res, "attn_micro9")


if __name__ == "__main__":
    main()
