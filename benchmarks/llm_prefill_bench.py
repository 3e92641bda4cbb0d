"""In-process prefill benchmark of the continuous-batching engine on prompts of real lengths.

A SmolLM2-135M-shaped decoder (the ``LlamaConfig`` defaults: 30 layers, 576 wide, 9 heads / 3 KV
heads, vocab 49152) with random weights in bf16, built with the shipped GPU plan's switches and
buckets (config/models/smollm2.yaml), warmed up as the handler's ``initialize()`` does, then driven
directly (no TorchServe, no tokenizer: prompts are random token ids, stop tokens off, so every
request generates exactly ``max_tokens``):

  (a) ttft-600     one 600-token prompt at a time: TTFT of the first request against later ones
                   (lengths around 600, each one new to the engine);
  (b) prefill-32   32 prompts of 600 tokens at once, 16 max tokens: prompt tokens/s until the last
                   first token, requests/s until the last one ends;
  (c) passages-32  32 closed-loop streams of 450-700-token prompts, 256 max tokens: tokens/s in
                   total, TTFT p50/p99;
  (d) short-32     the same with 20-60-token prompts (no regression on short prompts), and one
                   short stream alone (tokens/s per sequence).

Times are host wall-clock around ``ContinuousBatcher.step()`` (each step reads its tokens back, so
a token counts when the host has it). Prints and writes ``llm_prefill.json`` into ``--out``.

    python3 -m servekit.benchmarks.llm_prefill_bench --out benchmarks/results/llm-prefill-h100/after
    python -m servekit.benchmarks.llm_prefill_bench --out /tmp/prefill-cpu --device cpu --small
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.models.llama import LlamaConfig, init_random

# The shipped GPU plan (config/models/smollm2.yaml).
PLAN = dict(max_seq_len=2048, batch_buckets=(1, 2, 4, 8, 16, 32), prefill_buckets=(32, 64, 128, 256, 512, 1024, 2048),
            kv_buckets=(256, 512, 1024, 2048), compile_prefill=True, compile_decode=False, cuda_graphs=True,
            kernels="triton")
CPU_PLAN = dict(max_seq_len=1024, batch_buckets=(1, 2, 4), prefill_buckets=(32, 64, 128, 256, 512, 1024),
                kv_buckets=(256, 512, 1024))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Driver:
    """Runs requests through the batcher, recording when each was added, got its first token and ended."""

    def __init__(self, batcher: ContinuousBatcher) -> None:
        self.b = batcher
        self.added: dict[Any, float] = {}
        self.first: dict[Any, float] = {}
        self.ended: dict[Any, float] = {}
        self.tokens = 0

    def add(self, key: Any, prompt: list[int], max_tokens: int) -> None:
        self.b.add(key, prompt, SamplingParams(max_tokens=max_tokens))
        self.added[key] = time.perf_counter()

    def step(self) -> list[Any]:
        """One engine step; returns the keys that ended in it."""
        updates = self.b.step()
        now = time.perf_counter()
        ended = []
        for key, u in updates.items():
            if u.error is not None:
                raise RuntimeError(f"request {key!r} failed: {u.error}")
            if u.tokens and key not in self.first:
                self.first[key] = now
            self.tokens += len(u.tokens)
            if u.finish_reason is not None:
                self.ended[key] = now
                ended.append(key)
        return ended

    def drain(self) -> None:
        while self.b.has_work:
            self.step()

    def ttft_ms(self, keys: list[Any]) -> list[float]:
        return [1000 * (self.first[k] - self.added[k]) for k in keys]


def ttft_single(batcher: ContinuousBatcher, rng: random.Random, vocab: int, lengths: list[int]) -> dict[str, Any]:
    d = Driver(batcher)
    for i, n in enumerate(lengths):
        d.add(("single", i), _prompt(rng, n, vocab), 16)
        d.drain()
    ttft = d.ttft_ms([("single", i) for i in range(len(lengths))])
    return {"lengths": lengths, "ttft_ms": [round(t, 2) for t in ttft], "first_ms": round(ttft[0], 2),
            "later_p50_ms": round(statistics.median(ttft[1:]), 2), "later_max_ms": round(max(ttft[1:]), 2)}


def burst(batcher: ContinuousBatcher, rng: random.Random, vocab: int, n: int, length: int, max_tokens: int,
          tag: str) -> dict[str, Any]:
    d = Driver(batcher)
    keys = [(tag, i) for i in range(n)]
    prompts = [_prompt(rng, length, vocab) for _ in keys]  # made before the clock starts (~10 ms for 32)
    t0 = time.perf_counter()
    for k, prompt in zip(keys, prompts):
        d.add(k, prompt, max_tokens)
    d.drain()
    last_first = max(d.first.values()) - t0
    wall = max(d.ended.values()) - t0
    ttft = d.ttft_ms(keys)
    return {"requests": n, "prompt_tokens": n * length, "max_tokens": max_tokens,
            "prompt_tokens_per_s": round(n * length / last_first), "requests_per_s": round(n / wall, 1),
            "all_first_tokens_ms": round(1000 * last_first, 1), "wall_ms": round(1000 * wall, 1),
            "ttft_p50_ms": round(_pct(ttft, 0.5), 2), "ttft_p99_ms": round(_pct(ttft, 0.99), 2)}


def streams(batcher: ContinuousBatcher, rng: random.Random, vocab: int, n_streams: int, per_stream: int,
            lengths: tuple[int, int], max_tokens: int, tag: str, spread: float = 0.0) -> dict[str, Any]:
    """``n_streams`` closed-loop clients, each sending ``per_stream`` requests one after another.
    ``spread``: answers of ``max_tokens`` down to ``(1 - spread) * max_tokens`` tokens (uniform), so
    that requests end and the next ones arrive at different steps, beside rows still decoding, as
    in serving; 0: every answer ``max_tokens`` long (the streams end together, and their next
    requests arrive as one burst)."""
    d = Driver(batcher)
    left = {s: per_stream for s in range(n_streams)}
    count = 0
    # Every prompt made before the clock starts: making one takes longer than some engine steps.
    prompts = [_prompt(rng, rng.randint(*lengths), vocab) for _ in range(n_streams * per_stream)]
    answers = [rng.randint(max(2, round((1 - spread) * max_tokens)), max_tokens) if spread else max_tokens
               for _ in prompts]

    def send(stream: int) -> None:
        nonlocal count
        d.add((tag, stream, count), prompts[count], answers[count])
        count += 1
        left[stream] -= 1

    t0 = time.perf_counter()
    for s in range(n_streams):
        send(s)
    while batcher.has_work:
        for key in d.step():
            if left[key[1]]:
                send(key[1])
    wall = time.perf_counter() - t0
    ttft = d.ttft_ms(list(d.added))
    tpot = [1000 * (d.ended[k] - d.first[k]) / (answers[k[2]] - 1) for k in d.added if answers[k[2]] > 1]
    return {"streams": n_streams, "requests": count, "prompt_lengths": list(lengths), "max_tokens": max_tokens,
            "answer_spread": spread,
            "tokens_per_s": round(d.tokens / wall), "wall_s": round(wall, 2),
            "ttft_p50_ms": round(_pct(ttft, 0.5), 2), "ttft_p99_ms": round(_pct(ttft, 0.99), 2),
            "ttft_max_ms": round(max(ttft), 2),
            "tpot_p50_ms": round(_pct(tpot, 0.5), 3) if tpot else None}


def attention_paths(batcher: ContinuousBatcher, repeats: int = 10) -> dict[str, Any]:
    """ms per packed prefill forward for a few packings, by attention path: the torch reference
    (per-request loop, eager), the Triton kernel eager, and the engine's own (captured) forward."""
    from servekit.optimizations.llm.packed import Chunk, PackedPrefill

    model, dev = batcher.r.model, batcher.r.device
    budget = batcher.max_num_batched_tokens
    packings = {"1x2048": [(2048, 0)], "4x512": [(512, 0)] * 4, "32x64": [(64, 0)] * 32,
                "512_at_1024+3x512": [(512, 1024)] + [(512, 0)] * 3}
    engines = {"torch-eager": PackedPrefill(model, budget, batcher.max_num_seqs, attention="torch"),
               "triton-eager": PackedPrefill(model, budget, batcher.max_num_seqs, attention="triton"),
               "engine": batcher.packed}
    out: dict[str, Any] = {}
    for name, lengths in packings.items():
        if sum(n for n, _ in lengths) > budget:
            continue
        chunks = [Chunk([5] * n, start, row, True) for row, (n, start) in enumerate(lengths)]
        out[name] = {}
        for label, engine in engines.items():
            if label == "engine" and not getattr(engine, "graphs", False):
                continue
            engine.run(chunks)
            torch.cuda.synchronize(dev)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.run(chunks)
                torch.cuda.synchronize(dev)
                times.append(1000 * (time.perf_counter() - t0))
            out[name][label] = round(statistics.median(times), 3)
    return out


KERNEL_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma")), ("attention", ("_packed_attention",)),
                ("fused (inductor)", ("triton_",)))


def _kind(kernel: str) -> str:
    return next((kind for kind, marks in KERNEL_KINDS for mark in marks if mark in kernel), "other")


def profile_packed(batcher: ContinuousBatcher, out: Path) -> dict[str, Any]:
    """GPU time of the engine's own packed forward (the captured graph the engine replays, compiled
    layers included), by kernel and by kind, for a few packings. Writes ``packed_profile.txt``."""
    from torch.profiler import ProfilerActivity, profile

    from servekit.optimizations.llm.packed import Chunk

    engine = batcher.packed
    packings = {"4x512": [(512, 0)] * 4, "1x2048": [(2048, 0)], "tails+3x512": [(150, 512)] * 3 + [(512, 0)] * 3}
    tables, summary = [], {}
    for name, lengths in packings.items():
        if sum(n for n, _ in lengths) > engine.max_tokens:
            continue
        chunks = [Chunk([5] * n, start, row, True) for row, (n, start) in enumerate(lengths)]
        engine.run(chunks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.run(chunks)
            torch.cuda.synchronize()
        by_kind: dict[str, float] = {}
        for e in prof.key_averages():
            us = e.device_time_total / 5 if hasattr(e, "device_time_total") else e.cuda_time_total / 5
            by_kind[_kind(e.key)] = by_kind.get(_kind(e.key), 0.0) + us
        total = sum(by_kind.values())
        summary[name] = {"tokens": sum(n for n, _ in lengths), "gpu_us": round(total),
                         **{k: round(v) for k, v in sorted(by_kind.items())}}
        tables.append(f"## {name} ({summary[name]['tokens']} tokens), GPU time of one forward by kind (us): "
                      f"{json.dumps(summary[name])}\n"
                      + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    (out / "packed_profile.txt").write_text("\n\n".join(tables))
    return summary


def bucket_costs(batcher: ContinuousBatcher, repeats: int = 20) -> dict[int, float]:
    """ms per replay of each captured token bucket, filled by 512-token chunks: the fixed cost of a
    packed forward against its cost per token."""
    from servekit.optimizations.llm.packed import Chunk

    engine, out = batcher.packed, {}
    for n in getattr(engine, "buckets", ()):
        lengths = [512] * (n // 512) + ([n % 512] if n % 512 else [])
        chunks = [Chunk([5] * m, 0, row, True) for row, m in enumerate(lengths)]
        engine.run(chunks)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            engine.run(chunks)
        torch.cuda.synchronize()
        out[n] = round(1000 * (time.perf_counter() - t0) / repeats, 3)
    return out


def build(device: torch.device, small: bool, budget: int | None) -> tuple[ContinuousBatcher, dict[str, Any]]:
    config = LlamaConfig.tiny(max_position_embeddings=2048) if small else LlamaConfig()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = init_random(config, seed=0, dtype=dtype).to(device)
    plan = dict(PLAN if device.type == "cuda" else CPU_PLAN)
    t0 = time.perf_counter()
    runner = LlamaRunner(model, plan.pop("max_seq_len"), pad_id=0, **plan)
    phases = runner.warmup()
    kw: dict[str, Any] = {"prefill_chunk": 512}
    if budget is not None and "max_num_batched_tokens" in inspect.signature(ContinuousBatcher).parameters:
        kw["max_num_batched_tokens"] = budget
    batcher = ContinuousBatcher(runner, runner.max_batch, **kw)
    engine_warmup = batcher.warmup()
    warm = {"runner_phases_s": {k: round(v, 2) for k, v in phases.items()},
            "engine_warmup": engine_warmup if isinstance(engine_warmup, dict) else round(engine_warmup, 2),
            "total_s": round(time.perf_counter() - t0, 1), "engine_kwargs": kw}
    return batcher, warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.llm_prefill_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny model and small counts (CPU smoke run)")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (engines that have it)")
    p.add_argument("--per-stream", type=int, default=2, help="requests per closed-loop stream in (c) and (d)")
    p.add_argument("--single-requests", type=int, default=2, help="requests of the one-stream short run in (d)")
    p.add_argument("--answer-spread", type=float, default=0.0,
                   help="in (c) and (d), answers from (1 - spread) x max tokens up to max tokens (uniform), so that "
                        "requests arrive beside rows still decoding; 0: every answer max tokens long")
    p.add_argument("--label", default="", help="free text saved with the results (e.g. baseline)")
    p.add_argument("--profile", action="store_true",
                   help="also profile the engine's packed forward by kernel and time each token bucket")
    p.add_argument("--forward-only", action="store_true",
                   help="only the packed forward's measures (attention paths, profile, buckets), not (a)-(d)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    batcher, warm = build(device, args.small, args.budget)
    vocab = batcher.r.model.config.vocab_size
    print("warm-up:", json.dumps(warm), flush=True)
    rng = random.Random(0)
    n, short_max = (4, 16) if args.small else (32, 128)
    results: dict[str, Any] = {"warmup": warm}
    if device.type == "cuda" and hasattr(batcher, "packed"):
        results["attention_paths_ms"] = attention_paths(batcher)
        print("attention paths (ms per packed forward):", json.dumps(results["attention_paths_ms"]), flush=True)
        if args.profile:
            args.out.mkdir(parents=True, exist_ok=True)
            results["packed_profile_us"] = profile_packed(batcher, args.out)
            print("packed forward, GPU us by kind:", json.dumps(results["packed_profile_us"]), flush=True)
            results["bucket_ms"] = bucket_costs(batcher)
            print("ms per captured bucket:", json.dumps(results["bucket_ms"]), flush=True)
    if args.forward_only:
        return _write(results, args, argv, device)
    results["ttft_600"] = ttft_single(batcher, rng, vocab, [600, 613, 587, 644, 600, 571, 600])
    print("(a) ttft-600:", json.dumps(results["ttft_600"]), flush=True)
    results["prefill_32"] = [burst(batcher, rng, vocab, n, 600, 16, f"burst{r}") for r in range(2)]
    print("(b) prefill-32:", json.dumps(results["prefill_32"]), flush=True)
    results["passages_32"] = streams(batcher, rng, vocab, n, args.per_stream, (450, 700), 64 if args.small else 256,
                                     "passages", args.answer_spread)
    print("(c) passages-32:", json.dumps(results["passages_32"]), flush=True)
    results["short_32"] = streams(batcher, rng, vocab, n, args.per_stream, (20, 60), short_max, "short",
                                  args.answer_spread)
    results["short_1"] = streams(batcher, rng, vocab, 1, args.single_requests, (20, 60), short_max, "short1")
    results["short_1"]["tokens_per_s_per_sequence"] = results["short_1"]["tokens_per_s"]
    print("(d) short-32:", json.dumps(results["short_32"]), "short-1:", json.dumps(results["short_1"]), flush=True)
    return _write(results, args, argv, device)


def _write(results: dict[str, Any], args: argparse.Namespace, argv: list[str] | None, device: torch.device) -> int:
    results["meta"] = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                       "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "command": " ".join([Path(sys.executable).name, "-m", "servekit.benchmarks.llm_prefill_bench",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "label": args.label, "model": "SmolLM2-135M shape, random weights" if not args.small else "tiny"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_prefill.json").write_text(json.dumps(results, indent=2))
    print("wrote", args.out / "llm_prefill.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
