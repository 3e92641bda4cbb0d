"""Forced runs from each grammar's cache, on and off, in one process: the same JSON requests through
one continuous engine, its passes alternating between the shipped code ("cached": each row's forced
run through its grammar's ``ForcedRuns``) and the code before it ("computed": ``runs=None``, so every
run is llguidance's ``compute_ff_tokens``). One process and one engine, so the host's speed, which
moves between processes, is the same for both. The structured benchmark's 24 schemas, temperature
0.8, a seed per request, no phase timers. The cache starts empty and fills over the first "cached"
pass; each pass prints its hits and misses.

Run from a checkout (after ``source benchmarks/gpu_env.sh`` on the GPU machine):

    python3 benchmarks/results/forced-runs-cache-h200/same-process.py      # 256 requests, 32 at a time, 12 passes
    ORDER=cccc N=64 AT=16 CFG=config/models/smollm2-cpu.yaml python benchmarks/results/forced-runs-cache-h200/same-process.py

``ORDER``: the passes, c (cached) and p (computed, "plain"); ``CFG``: another model-config (default:
the shipped smollm2.yaml).
"""
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import yaml

from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm import grammar
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.plan import stop_token_ids
from servekit.resources import model_config

runner, plan, model_dir = plan_runner(yaml.safe_load(Path(os.environ.get("CFG") or model_config("smollm2")).read_text())["servekit"])
tok = ChatTokenizer(model_dir)
stops = tuple(stop_token_ids(model_dir, tok))
compiler = grammar.GrammarCompiler(tok, runner.model.config.vocab_size, stops)
N, AT = int(os.environ.get("N", 256)), int(os.environ.get("AT", 32))
b = ContinuousBatcher(runner, min(AT, runner.max_batch))
b.warmup()
prompts, params = [], {"c": [], "p": []}
for i in range(N):
    _, topic, schema = SCHEMAS[i % len(SCHEMAS)]
    prompts.append(tok.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}]))
    c = compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, schema))
    params["c"].append(SamplingParams(max_tokens=128, temperature=0.8, seed=i, stop_token_ids=stops, constraint=c))
    params["p"].append(replace(params["c"][-1], constraint=replace(c, runs=None)))
caches = {id(p.constraint.runs): p.constraint.runs for p in params["c"]}.values()
order = os.environ.get("ORDER", "cppccppccppc")
res = {"c": [], "p": []}
for rep, mode in enumerate(order):
    hits, misses = sum(r.hits for r in caches), sum(r.misses for r in caches)
    queued, steps, toks = 0, 0, 0

    def add_next():
        global queued
        b.add((rep, queued), prompts[queued], params[mode][queued])
        queued += 1

    while queued < min(AT, N):
        add_next()
    t0 = time.perf_counter()
    while b.has_work:
        ups = b.step()
        steps += 1
        for (_, i), u in ups.items():
            toks += len(u.tokens)
            if u.finish_reason is not None and queued < N:
                add_next()
    wall = time.perf_counter() - t0
    res[mode].append(toks / wall)
    print(f"pass {rep} {'cached' if mode == 'c' else 'computed'}: steps {steps} tokens {toks} tok/s {toks / wall:.0f} "
          f"ms/step {wall / steps * 1e3:.3f} runs from the cache {sum(r.hits for r in caches) - hits}, "
          f"computed through it {sum(r.misses for r in caches) - misses}", flush=True)
for m, v in res.items():
    if v:
        print(f"{'cached' if m == 'c' else 'computed'}: mean {statistics.mean(v):.0f} median {statistics.median(v):.0f} "
              f"tok/s over {len(v)} passes: {[round(x) for x in v]}")
