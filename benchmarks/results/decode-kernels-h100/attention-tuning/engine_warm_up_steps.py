"""Scratch A/B: served-like warm-up (runner.warmup at position 0), then steps at real contexts."""
import sys, time, torch
from servekit.benchmarks.decode_kernels import SHAPES
from servekit.optimizations.models.llama import init_random
from servekit.optimizations.llm.generate import LlamaRunner
from servekit.optimizations.llm.sampling import GREEDY, SamplingTensors
from servekit.optimizations.kernels import triton_decode as td
name = sys.argv[1]; cfg = SHAPES[name]
dev = torch.device("cuda")
model = init_random(cfg, seed=0, dtype=torch.bfloat16).to(dev)
runner = LlamaRunner(model, 2048, (1, 4, 16, 32), prefill_buckets=(256,), kv_buckets=(256, 512, 1024, 2048),
                     cuda_graphs=True, kernels="triton")
t0 = time.perf_counter(); runner.warmup(); print("warmup_s", round(time.perf_counter() - t0, 1), flush=True)
for kv in (512, 1024, 2048):
    for b in (1, 16, 32):
        state = runner.states[b]
        start = (kv // 2 + (torch.arange(b, device=dev) * (kv // 2 - 120)) // b).to(torch.int64)
        greedy = SamplingTensors.build([0.0] * b, [0] * b, [1.0] * b, [0] * b, dev)
        step = runner.steps[(b, GREEDY, kv)]
        times = []
        for r in range(5):
            state.load(torch.full((b,), 5, dtype=torch.int64, device=dev), start, greedy)
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(100):
                step.run()
            torch.cuda.synchronize(); times.append((time.perf_counter() - t) / 100 * 1e3)
        times.sort()
        print(f"RES {name} kv {kv} batch {b}: {times[0]:.3f} ms/step (median {times[2]:.3f})", flush=True)
for k, v in td._attention_kernel.cache.items():
    print("CFG", k[:4], v, flush=True)
