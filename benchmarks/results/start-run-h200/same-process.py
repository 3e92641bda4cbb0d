"""The start run, on and off, in one process: the same JSON requests through one continuous engine,
its passes alternating between the shipped code ("new": a grammar's start run fed with the prompt)
and the code before it ("before": ``ContinuousBatcher._start_run`` a no-op, so the first step samples
the run's first token under a one-token mask and the forward after it feeds the rest). One process
and one engine: the host speed that moved between processes (``lifetimes/``) is the same for both.
The structured benchmark's 24 schemas, temperature 0.8, a seed per request, no phase timers.

Run from a checkout (after ``source benchmarks/gpu_env.sh`` on the GPU machine):

    python3 benchmarks/results/start-run-h200/same-process.py          # 256 requests, 32 at a time, 12 passes
    ORDER=nbbn N=64 AT=16 python3 benchmarks/results/start-run-h200/same-process.py

``ORDER``: the passes, n (new) and b (before); ``CFG``: another model-config (default: the shipped
smollm2.yaml).
"""
import os
import statistics
import time
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
b = ContinuousBatcher(runner, min(32, runner.max_batch))
b.warmup()
real_start = b._start_run
prompts, params = [], []
for i in range(N):
    _, topic, schema = SCHEMAS[i % len(SCHEMAS)]
    prompts.append(tok.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}]))
    params.append(SamplingParams(max_tokens=128, temperature=0.8, seed=i, stop_token_ids=stops,
                                 constraint=compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, schema))))
order = os.environ.get("ORDER", "nbbnnbbnnbbn")
res = {"n": [], "b": []}
for rep, mode in enumerate(order):
    b._start_run = real_start if mode == "n" else (lambda s: None)
    queued, steps, toks = 0, 0, 0
    def add_next():
        global queued
        b.add((rep, queued), prompts[queued], params[queued])
        queued += 1
    while queued < AT:
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
    print(f"pass {rep} {'new' if mode == 'n' else 'before'}: steps {steps} tokens {toks} tok/s {toks / wall:.0f} ms/step {wall / steps * 1e3:.3f}", flush=True)
for m, v in res.items():
    if v:
        print(f"{'new' if m == 'n' else 'before'}: mean {statistics.mean(v):.0f} median {statistics.median(v):.0f} tok/s over {len(v)} passes: {[round(x) for x in v]}")
