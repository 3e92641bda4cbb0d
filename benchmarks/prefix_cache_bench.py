"""In-process benchmark of the engine's prefix cache (optimizations/llm/prefix_cache.py): the same
requests through two engines on one runner, prefix caching off and on.

A SmolLM2-135M-shaped decoder with random weights in bf16 and the shipped GPU plan's switches
(compiled blocks, CUDA graphs, Triton decode kernels), warmed up as the handler does, driven
directly (random token ids, greedy, stop tokens off):

  followup  --conversations chats of --chat-tokens tokens, each answered (--answer tokens), then
            its follow-up turn (chat + answer + --question new tokens), one request at a time:
            the follow-up's TTFT off and on, the tokens the cache served, and whether the hit's
            tokens equal the miss's (bf16: the reused K/V of the answer came from decode steps,
            which may round otherwise than a prefill);
  system    --streams requests at once sharing a --system-tokens system prompt, each with its own
            --suffix tokens, after one request with that system prompt: time to the last first
            token, off and on;
  costs     the host time of one admission's lookup of a --chat-tokens prompt and the device time
            of copying that many positions of every layer from one row into another.

Times are host wall-clock around ``ContinuousBatcher.step()`` (each step reads its tokens back).
Writes prefix_cache.json into --out.

    python3 -m servekit.benchmarks.prefix_cache_bench --out benchmarks/results/prefix-cache-h100
    python -m servekit.benchmarks.prefix_cache_bench --out /tmp/prefix-cpu --device cpu --small
"""
from __future__ import annotations

import argparse
import dataclasses
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

# The shipped GPU plan's switches (config/models/smollm2.yaml); a small eager one for CPU smoke runs.
PLAN = dict(batch_buckets=(1, 2, 4, 8, 16, 32), kv_buckets=(256, 512, 1024, 2048), compile_prefill=True,
            cuda_graphs=True, kernels="triton")
CPU_PLAN = dict(batch_buckets=(1, 2, 4), kv_buckets=(256, 512))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _run(batcher: ContinuousBatcher, requests: dict[Any, tuple[list[int], int]]) -> dict[Any, tuple[float, list[int], int]]:
    """Add ``requests`` (key -> prompt, max tokens) at once and run them to the end; per key: seconds to
    its first token, its tokens, and the prompt tokens the cache served."""
    t0 = time.perf_counter()
    for key, (prompt, max_tokens) in requests.items():
        batcher.add(key, prompt, SamplingParams(max_tokens=max_tokens))
    out: dict[Any, tuple[float, list[int], int]] = {}
    while batcher.has_work:
        for key, u in batcher.step().items():
            if u.error is not None:
                raise RuntimeError(f"request {key!r} failed: {u.error}")
            if key not in out:
                out[key] = (time.perf_counter() - t0, [], u.cached_tokens)
            out[key][1].extend(u.tokens)
    return out


def _forget(batcher: ContinuousBatcher) -> None:
    """The two engines share the runner's cache rows: the one measured next forgets what the other overwrote."""
    if batcher.prefix is not None:
        batcher.prefix.clear()


def followup(engines: dict[str, ContinuousBatcher], rng: random.Random, vocab: int, n: int, chat: int,
             answer: int, question: int) -> dict[str, Any]:
    res: dict[str, Any] = {"conversations": n, "chat_tokens": chat, "answer_tokens": answer,
                           "question_tokens": question}
    convs = [(_prompt(rng, chat, vocab), _prompt(rng, question, vocab)) for _ in range(n)]
    tokens: dict[str, list[list[int]]] = {}
    for name, b in engines.items():
        _forget(b)
        ttft, cached, tokens[name] = [], [], []
        for i, (text, ask) in enumerate(convs):
            said = _run(b, {"chat": (text, answer)})["chat"][1]
            t, toks, hit = _run(b, {"follow": (text + said + ask, 32)})["follow"]
            ttft.append(1000 * t)
            cached.append(hit)
            tokens[name].append(toks)
        res[name] = {"ttft_ms": [round(t, 2) for t in ttft], "ttft_p50_ms": round(statistics.median(ttft), 2),
                     "cached_tokens": cached}
    res["same_tokens"] = sum(a == b for a, b in zip(tokens["off"], tokens["on"]))
    return res


def system_prompt(engines: dict[str, ContinuousBatcher], rng: random.Random, vocab: int, streams: int, system: int,
                  suffix: int) -> dict[str, Any]:
    head = _prompt(rng, system, vocab)
    requests = {i: (head + _prompt(rng, suffix, vocab), 16) for i in range(streams)}
    res: dict[str, Any] = {"streams": streams, "system_tokens": system, "suffix_tokens": suffix}
    for name, b in engines.items():
        _forget(b)
        _run(b, {"first": (head + _prompt(rng, suffix, vocab), 4)})
        got = _run(b, requests)
        res[name] = {"last_first_token_ms": round(1000 * max(t for t, _, _ in got.values()), 2),
                     "cached_tokens_total": sum(c for _, _, c in got.values())}
    return res


def costs(batcher: ContinuousBatcher, rng: random.Random, vocab: int, n: int) -> dict[str, Any]:
    """Lookup (host) of an ``n``-token prompt whose blocks are cached, and a copy of ``n`` positions
    of every layer's K and V from one cache row into another (device; what a hit by copy adds),
    medians of 20."""
    prompt = _prompt(rng, n, vocab)
    _run(batcher, {"seed": (prompt, 2)})
    lookups = []
    for _ in range(20):
        t0 = time.perf_counter()
        batcher.prefix.lookup(prompt)
        lookups.append(1e6 * (time.perf_counter() - t0))
    caches = [layer.attention.kv_cache for layer in batcher.r.model.layers]
    cuda = batcher.r.device.type == "cuda"
    copies = []
    for _ in range(20):
        start = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        for c in caches:
            c.k_cache[1, :, :n].copy_(c.k_cache[0, :, :n])
            c.v_cache[1, :, :n].copy_(c.v_cache[0, :, :n])
        if cuda:
            end.record()
            torch.cuda.synchronize()
            copies.append(1000 * begin.elapsed_time(end))
        else:
            copies.append(1e6 * (time.perf_counter() - start))
    batcher.prefix.clear()  # row 1 now holds what the index does not name there
    return {"tokens": n, "lookup_us_p50": round(statistics.median(lookups), 1),
            "copy_us_p50": round(statistics.median(copies), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.prefix_cache_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="a tiny model and small counts (CPU smoke run)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=1500)
    p.add_argument("--answer", type=int, default=200)
    p.add_argument("--question", type=int, default=40)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--suffix", type=int, default=50)
    args = p.parse_args(argv)
    if args.small:
        args.conversations, args.chat_tokens, args.answer, args.question = 2, 300, 20, 10
        args.streams, args.system_tokens, args.suffix = 3, 200, 10
    device = torch.device(args.device)
    config = LlamaConfig.tiny(max_position_embeddings=2048) if args.small else LlamaConfig()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = init_random(config, seed=0, dtype=dtype).to(device)
    t0 = time.perf_counter()
    runner = LlamaRunner(model, 2048 if device.type == "cuda" else 512, **(PLAN if device.type == "cuda" else CPU_PLAN))
    runner.warmup()
    engines = {name: ContinuousBatcher(runner, prefill_chunk=512, prefix_caching=name == "on") for name in ("off", "on")}
    for b in engines.values():
        b.warmup()
    results: dict[str, Any] = {"warmup_s": round(time.perf_counter() - t0, 1)}
    vocab = config.vocab_size
    rng = random.Random(0)
    results["followup"] = followup(engines, rng, vocab, args.conversations, args.chat_tokens, args.answer,
                                   args.question)
    print("followup:", json.dumps(results["followup"]), flush=True)
    results["system"] = system_prompt(engines, rng, vocab, min(args.streams, runner.max_batch), args.system_tokens,
                                      args.suffix)
    print("system:", json.dumps(results["system"]), flush=True)
    results["prefix_stats"] = dataclasses.asdict(engines["on"].prefix_stats())
    results["costs"] = costs(engines["on"], rng, vocab, args.chat_tokens)
    print("costs:", json.dumps(results["costs"]), flush=True)
    results["meta"] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                       "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "command": " ".join([Path(sys.executable).name, "-m", "servekit.benchmarks.prefix_cache_bench",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "model": "tiny" if args.small else "SmolLM2-135M shape, random weights"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix_cache.json").write_text(json.dumps(results, indent=2))
    print("wrote", args.out / "prefix_cache.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
