"""JSON requests through the continuous engine in-process, counted by the step: steps, tokens, how many
steps a request lives from its add to its finish, the packed forwards, and the steps whose grammar
rows' forced runs waited (no prompt to prefill and too few run tokens for a forward of their own:
``continuous.RUNS_ALONE_SHARE``). The structured benchmark's 24 schemas, temperature 0.8, a seed per
request, as ``structured_engine_profile`` sends them, without its phase timers.

Run from a checkout (after ``source benchmarks/gpu_env.sh`` on the GPU machine), ``REPEATS`` passes:

    N=32 AT=32 python3 benchmarks/results/start-run-h200/lifetimes.py 6    # one round: 32 at once
    N=256 AT=32 python3 benchmarks/results/start-run-h200/lifetimes.py 2   # closed loop: 256, 32 at a time
    SHARE=0 N=32 AT=32 python3 ... 6                                       # every forced run fed

``CFG``: another model-config (default: the shipped smollm2.yaml); ``MODEL``: another converted
checkpoint (default: SmolLM2).
"""
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm import continuous, grammar
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.plan import stop_token_ids
from servekit.resources import model_config

config = Path(os.environ.get("CFG") or model_config("smollm2"))
runner, plan, model_dir = plan_runner(yaml.safe_load(config.read_text())["servekit"],
                                      Path(os.environ["MODEL"]) if os.environ.get("MODEL") else None)
tok = ChatTokenizer(model_dir)
stops = tuple(stop_token_ids(model_dir, tok))
compiler = grammar.GrammarCompiler(tok, runner.model.config.vocab_size, stops)
if os.environ.get("SHARE"):
    continuous.RUNS_ALONE_SHARE = float(os.environ["SHARE"])
N, AT = int(os.environ.get("N", 256)), int(os.environ.get("AT", 32))
print("tree", os.getcwd(), "share", getattr(continuous, "RUNS_ALONE_SHARE", None), "N", N, "AT", AT, flush=True)
b = ContinuousBatcher(runner, min(32, runner.max_batch))
b.warmup()
stats = {"packed": 0, "runs_unfed": 0, "run_tokens_unfed": 0, "packed_big": 0, "packed_tokens": 0}
real_run, real_prefill = b.packed.run, b._prefill


def run(chunks):
    stats["packed"] += 1
    n = sum(len(c.tokens) for c in chunks)
    stats["packed_tokens"] += n
    stats["packed_big"] += n > b.packed.fused_tokens  # run by the packed layers, not the fused decode blocks
    return real_run(chunks)


def prefill(updates, decoding):
    before, jumps = stats["packed"], dict(b._jumps)
    out = real_prefill(updates, decoding)
    if jumps and stats["packed"] == before:  # the runs waited
        stats["runs_unfed"] += 1
        stats["run_tokens_unfed"] += sum(len(r) - 1 for r in jumps.values())
    return out


b.packed.run, b._prefill = run, prefill
prompts, params = [], []
for i in range(N):
    _, topic, schema = SCHEMAS[i % len(SCHEMAS)]
    prompts.append(tok.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}]))
    params.append(SamplingParams(max_tokens=128, temperature=0.8, seed=i, stop_token_ids=stops,
                                 constraint=compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, schema))))
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for k in stats:
        stats[k] = 0
    queued, steps, added, life, toks, firsts, first_len = 0, 0, {}, [], 0, {}, []

    def add_next() -> None:
        global queued
        b.add((rep, queued), prompts[queued], params[queued])
        added[queued] = steps
        queued += 1

    while queued < AT:
        add_next()
    t0 = time.perf_counter()
    while b.has_work:
        ups = b.step()
        steps += 1
        for (_, i), u in ups.items():
            toks += len(u.tokens)
            if u.tokens and i not in firsts:
                firsts[i] = steps
                first_len.append(len(u.tokens))
            if u.finish_reason is not None:
                life.append(steps - added[i])
                if queued < N:
                    add_next()
    wall = time.perf_counter() - t0
    ttf = [firsts[i] - added[i] for i in firsts]
    print(f"rep {rep}: steps {steps} tokens {toks} tok/s {toks / wall:.0f} ms/step {wall / steps * 1e3:.2f} "
          f"lifetime mean {statistics.mean(life):.2f} steps; steps to first token mean {statistics.mean(ttf):.2f}; "
          f"first update tokens mean {statistics.mean(first_len):.2f}; {stats}", flush=True)
