"""How a packed prefill forward and a decode step combine: the engine's captured decode step (batch
1 and 32) and its captured packed prefill (prompts of several lengths, into the cache's spare row),
each alone, one after the other, on two CUDA streams, and as the engine runs them now, the decoding
rows riding in the packed forward (one token each, from the decode state) followed by the captured
sampling half of their batch; in ms per iteration, the rows held at one position. ``--fused-tokens``
compares engines whose short packed forwards run the fused decode kernels up to different sizes.

    python3 -m servekit.benchmarks.prefill_overlap                      # GPU, shipped smollm2.yaml
    python3 -m servekit.benchmarks.prefill_overlap --fused-tokens 0 256 --prompt-tokens 1 16 48 120 200
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from servekit.optimizations.buckets import pick_bucket
from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.optimizations.llm.continuous import FUSED_PACKED_TOKENS, ContinuousBatcher
from servekit.optimizations.llm.packed import Chunk
from servekit.optimizations.llm.sampling import GREEDY
from servekit.resources import model_config


def ms_per_call(fn: Callable[[], object], iters: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=model_config("smollm2"), help="LLM model-config (SmolLM2's weights)")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[16, 48, 120, 400])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="decode batch buckets")
    p.add_argument("--position", type=int, default=300, help="the decode rows' position (their kv bucket)")
    p.add_argument("--fused-tokens", type=int, nargs="+", default=[FUSED_PACKED_TOKENS],
                   help="packed forwards of up to this many tokens through the fused decode kernels "
                        "(kernels: triton), one engine each (0: never)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: the comparison is of two CUDA streams")
    runner, plan, _ = plan_runner(yaml.safe_load(args.config.read_text())["servekit"])
    kv = pick_bucket(args.position + 1, runner.kv_buckets)
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    rows = []
    engines = [(n, ContinuousBatcher(runner, min(32, runner.max_batch), fused_tokens=n)) for n in args.fused_tokens]
    for _, engine in engines:
        engine.warmup()
    for (fused_tokens, engine), tokens in itertools.product(engines, args.prompt_tokens):
        chunks = [Chunk([runner.pad_id] * tokens, 0, runner.model.spare_row, True)]
        for b in args.batches:
            positions = runner.states[b].input_pos
            step, sampling = runner.steps[(b, GREEDY, kv)], runner.sample_steps[(b, GREEDY)]
            # The prompt's request holds one of the engine's rows: at most all the others decode beside it.
            riders = [Chunk([runner.pad_id], args.position, row, True, from_state=True)
                      for row in range(min(b, engine.max_num_seqs - 1))]

            def decode() -> None:
                positions.fill_(args.position)  # a step advances them: every iteration at the same one
                step.run()

            def both() -> None:
                decode()
                engine.packed.run(chunks)

            def two_streams() -> None:
                side.wait_stream(main_stream)
                decode()
                with torch.cuda.stream(side):
                    engine.packed.run(chunks)
                main_stream.wait_stream(side)

            def mixed() -> None:
                positions.fill_(args.position)
                engine.packed.run(chunks + riders)
                sampling.run()

            row = {"fused_tokens": fused_tokens, "prompt_tokens": tokens, "batch": b,
                   "mixed_bucket": pick_bucket(tokens + len(riders), engine.packed.buckets),
                   "decode_ms": ms_per_call(decode, args.iters),
                   "prefill_ms": ms_per_call(lambda: engine.packed.run(chunks), args.iters),
                   "one_after_the_other_ms": ms_per_call(both, args.iters),
                   "two_streams_ms": ms_per_call(two_streams, args.iters),
                   "mixed_ms": ms_per_call(mixed, args.iters)}
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(f"fused up to {fused_tokens} tokens, prompt {tokens} tokens, decode batch {b} (mixed bucket "
                  f"{row['mixed_bucket']}): decode {row['decode_ms']:.3f} ms, prefill "
                  f"{row['prefill_ms']:.3f}, one after the other {row['one_after_the_other_ms']:.3f}, "
                  f"on two streams {row['two_streams_ms']:.3f}, mixed {row['mixed_ms']:.3f}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"plan": plan.label(), "kv_bucket": kv, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
