"""Round 3: the slot-major attention kernel of round 2 over an fp8 (e4m3) cache against bf16 (it
converts what it loads to the query's dtype: nothing to convert for bf16)."""
import itertools, json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch
from attn_micro import SETS, cache_bytes, layers, make, measure, reference, save, NH, HD, GROUP, LAYERS
from attn_micro2 import attn_nat


def main():
    res = []
    meta = dict(N_HEADS=NH, HEAD_DIM=HD, GROUP=GROUP, QROWS=GROUP, Q_P=16)
    for label, kv_len, lo, hi in SETS:
        caches, pos, q = make(kv_len, lo, hi)
        c8 = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in caches]
        ys = [torch.empty_like(q) for _ in range(LAYERS)]
        ref = reference(q, *caches[0], pos)
        ref8 = reference(q, c8[0][0].to(q.dtype), c8[0][1].to(q.dtype), pos)
        variants = []
        for bs, w, st in itertools.product((64, 128, 256), (4, 8), (3, 4)):
            kw = dict(BLOCK_S=bs, num_warps=w, num_stages=st, **meta)
            variants.append((f"bf16 bs{bs} w{w} st{st}", layers(attn_nat, caches, ys, q, pos, kv_len, HD ** -0.5, **kw),
                             ref, 2))
            variants.append((f"fp8 bs{bs} w{w} st{st}", layers(attn_nat, c8, ys, q, pos, kv_len, HD ** -0.5, **kw),
                             ref8, 1))
        for name, fn, r, elt in variants:
            measure(res, label, name, fn, ys, r, cache_bytes(pos, elt))
    save(res, "attn_micro3")
    for label in ("short", "passages", "long"):
        for kind in ("bf16", "fp8"):
            rows = sorted([r for r in res if r["set"] == label and r["variant"].startswith(kind)], key=lambda r: r["us_per_layer"])
            print("BEST", label, kind, json.dumps(rows[:3]))


if __name__ == "__main__":
    main()
