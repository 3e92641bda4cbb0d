"""What sampling adds to a decode step: the engine's captured decode steps for each sampling mode
(greedy, temperature, top-k/top-p, logprobs), and the two halves a grammar row's split step runs
(the forward, then the sampling with the packed masks), in device µs per step (CUDA events around
200 graph replays each). Beside the forward half: the packed forward that takes its place when the
rows ride in it (one token each), and when half of them feed a run of four forced tokens instead.

    python3 -m servekit.benchmarks.sampling_cost --out DIR       # GPU, the shipped smollm2.yaml

Random inputs are fine: the steps' cost does not depend on the values. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.packed import Chunk
from servekit.optimizations.llm.sampling import PLAIN_MODES
from servekit.resources import model_config


def device_us(fn: Callable[[], object], iters: int = 200) -> float:
    """Device time per call of ``fn`` (graph replays queued back to back), in µs."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=model_config("smollm2"), help="LLM model-config")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="decode batch buckets to time")
    ap.add_argument("--kv", type=int, nargs="+", default=[256, 512], help="kv-length buckets to time")
    ap.add_argument("--out", type=Path, help="folder for sampling_cost.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device: it times captured decode steps")
    runner, plan, _ = plan_runner(yaml.safe_load(args.config.read_text())["servekit"])
    t0 = time.perf_counter()
    engine = ContinuousBatcher(runner, runner.max_batch)
    engine.warmup()  # every step captured, as initialize() does
    print(f"{plan.label()}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    missing = [b for b in args.batches if b not in runner.batch_buckets] + [k for k in args.kv if k not in runner.kv_buckets]
    if missing:
        ap.error(f"not buckets of this plan: {missing} (batch {list(runner.batch_buckets)}, kv {list(runner.kv_buckets)})")
    rows = []
    for b in args.batches:
        for kv in args.kv:
            fwd = device_us(lambda: runner.forward_steps[(b, kv)].run())
            pos = kv // 2  # the rows' positions, inside the kv bucket
            riders = [Chunk([0], pos, row, True, from_state=True) for row in range(b)]
            runs = [Chunk([5, 6, 7, 8], pos, row, True) if row % 2 else riders[row] for row in range(b)]
            packed = {"packed_riders_us": round(device_us(lambda: engine.packed.run(riders)), 1),
                      "packed_half_runs_of_4_us": round(device_us(lambda: engine.packed.run(runs)), 1)}
            print(f"batch {b:>3} kv {kv:>5} packed forward instead: rows riding {packed['packed_riders_us']:8.1f} µs, "
                  f"half of them feeding 4 forced tokens {packed['packed_half_runs_of_4_us']:8.1f}", flush=True)
            for mode in PLAIN_MODES:
                whole = device_us(lambda: runner.steps[(b, mode, kv)].run())
                half = device_us(lambda: runner.sample_steps[(b, mode)].run())
                rows.append({"batch": b, "kv": kv, "mode": mode, "step_us": round(whole, 1),
                             "forward_half_us": round(fwd, 1), "sampling_half_us": round(half, 1), **packed})
                print(f"batch {b:>3} kv {kv:>5} {mode:<7} step {whole:8.1f} µs | split: forward {fwd:8.1f}, "
                      f"sampling with masks {half:7.1f}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        command = ["python3 -m servekit.benchmarks.sampling_cost", *(argv if argv is not None else sys.argv[1:])]
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
                "date": time.strftime("%Y-%m-%d"), "plan": plan.label(), "command": " ".join(command)}
        (args.out / "sampling_cost.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
