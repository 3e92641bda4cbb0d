"""Round 6: the kept kernel with 1 and 2 warps a program (round 1 tried 4 and 8), alone and with 2 or
4 cache splits and the reduce kernel. Run from the checkout's root."""
import itertools, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import attn_micro as am

B, NH, NKV, HD, GROUP, LAYERS, dev = am.B, am.NH, am.NKV, am.HD, am.GROUP, am.LAYERS, am.dev


def main():
    res = []
    for label, kv_len, caches, pos, q, ys, ref, nbytes in am.each_set():
        def base(bs, w, st, splits=1):  # the reduce kernel on one warp a program
            return am.kept(caches, ys, q, pos, kv_len, bs, w, st, splits, reduce_warps=1)
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
