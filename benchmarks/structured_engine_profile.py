"""Where a constrained decode step's time goes: the continuous engine in-process (no TorchServe),
the same requests once free and once each under a JSON schema of the structured benchmark; host
time per engine step in each of the engine's phases (reading tokens, filling and loading the
grammar masks, launching the halves of a split step) and tokens/s.

    python3 -m servekit.benchmarks.structured_engine_profile               # GPU, shipped smollm2.yaml
    python -m servekit.benchmarks.structured_engine_profile --config config/models/smollm2-cpu.yaml \\
        --requests 2 --max-tokens 16                                          # CPU smoke run
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.device import DTYPES
from servekit.optimizations.llm import grammar
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.plan import load_llm_runner, parse_llm_plan, stop_token_ids
from servekit.optimizations.models.gguf_weights import smollm2_archive_files
from servekit.resources import model_config

PHASES = {"_read_all": "read tokens", "_load_bias": "load masks", "_sample": "launch sampling",
          "_launch": "launch step/forward", "_prefill": "prefill", "_admit": "admit"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=model_config("smollm2"), help="LLM model-config")
    ap.add_argument("--requests", type=int, default=16, help="requests at once (one per schema, in order)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    plan = parse_llm_plan(yaml.safe_load(args.config.read_text())["servekit"])
    model_dir = smollm2_archive_files(DTYPES[plan.precision])[0].parent
    runner, plan, _ = load_llm_runner(str(model_dir), plan)
    tokenizer = ChatTokenizer(model_dir)
    stops = tuple(stop_token_ids(model_dir, tokenizer))
    compiler = grammar.GrammarCompiler(tokenizer, runner.model.config.vocab_size, stops)
    engine = ContinuousBatcher(runner, min(32, runner.max_batch))
    engine.warmup()
    timer = PhaseTimer()
    for name, label in PHASES.items():
        timer.instrument(engine, name, label)
    timer.instrument(grammar, "fill_masks", "  of which: fill masks")
    print(f"{plan.label()}, {args.requests} requests of at most {args.max_tokens} tokens, temperature 0.8")
    for constrained in (False, True):
        for rep in range(args.repeats):
            timer.seconds.clear()
            for i in range(args.requests):
                _, topic, schema = SCHEMAS[i % len(SCHEMAS)]
                c = compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, schema)) if constrained else None
                engine.add((constrained, rep, i), tokenizer.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}]),
                           SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, stop_token_ids=stops,
                                          constraint=c))
            steps = tokens = 0
            t0 = time.perf_counter()
            while engine.has_work:
                tokens += sum(len(u.tokens) for u in engine.step().values())
                steps += 1
            wall = time.perf_counter() - t0
            phases = ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in sorted(timer.seconds.items()))
            print(f"{'JSON schema' if constrained else 'free'} (run {rep + 1}): {steps} steps, {tokens} tokens, "
                  f"{tokens / wall:.0f} tokens/s, {wall / steps * 1e3:.2f} ms per step; host ms per step: {phases}")


if __name__ == "__main__":
    main()
