"""Round 9: is a block's step the wait for its cache? The kept kernel over 30 layers' own caches (as
every round: from memory) against 30 launches over one layer's cache (17 MB over passages, held in
the H200's 50 MB L2 after the first), and with deeper pipelines (more blocks in flight). Run from
the checkout's root."""
import itertools, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import attn_micro as am

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


def main():
    res = []
    for label, kv_len, caches, pos, q, ys, ref, nbytes in am.each_set():
        def kept(layer_caches, bs=128, w=4, st=3):
            return am.kept(layer_caches, ys, q, pos, kv_len, bs, w, st)

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
