"""The masks filled beside the step's other host work or after it, in one process: the structured
benchmark's schemas closed-loop (256 requests, 32 at a time, temperature 0.8) on SmolLM2's
in-process engine, alternating ``continuous.BESIDE_ROWS`` between 8 (the variant's) and never,
then free requests of the constrained answers' lengths; REPEATS rounds (3 here). Needs
``variant.diff`` applied; from the checkout's root on the GPU machine, after
``source benchmarks/gpu_env.sh``:

    python3 benchmarks/results/engine-host-profile-h200/beside/ab.py 3
"""
import statistics
import sys
from pathlib import Path

import yaml

from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_engine_profile import SCHEMAS, line, matched, run_once
from servekit.optimizations.llm import continuous, grammar
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.plan import stop_token_ids

runner, plan, model_dir = plan_runner(yaml.safe_load(Path("config/models/smollm2.yaml").read_text())["servekit"])
tok = ChatTokenizer(model_dir)
stops = tuple(stop_token_ids(model_dir, tok))
comp = grammar.GrammarCompiler(tok, runner.model.config.vocab_size, stops)
eng = ContinuousBatcher(runner, 32)
eng.warmup()
timer = PhaseTimer(exclusive=True)
prompts, free, cons = [], [], []
for i in range(256):
    _, topic, schema = SCHEMAS[i % len(SCHEMAS)]
    prompts.append(tok.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}]))
    free.append(SamplingParams(max_tokens=128, temperature=0.8, seed=i, stop_token_ids=stops))
    cons.append(SamplingParams(max_tokens=128, temperature=0.8, seed=i, stop_token_ids=stops,
                               constraint=comp.constraint(grammar.GrammarSpec.of(grammar.JSON, schema))))
r = run_once(eng, timer, prompts, cons, "w", 32)
print(line("JSON warm", 0, r), flush=True)
same = matched(free, r["lengths"])
res = {"beside": [], "after": [], "free": []}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for mode in ("beside", "after"):
        continuous.BESIDE_ROWS = 8 if mode == "beside" else 10**9
        r = run_once(eng, timer, prompts, cons, "x", 32)
        res[mode].append(r)
        print(line("JSON " + mode, rep, r), flush=True)
    r = run_once(eng, timer, prompts, same, "x", 32)
    res["free"].append(r)
    print(line("free matched", rep, r), flush=True)
free_tps = statistics.median(x["tok_per_s"] for x in res["free"])
for mode in ("beside", "after"):
    ms = [x["ms_per_step"] for x in res[mode]]
    tps = [x["tok_per_s"] for x in res[mode]]
    print(f"{mode}: ms/step median {statistics.median(ms):.3f} (all {[round(m, 3) for m in ms]}), tokens/s median "
          f"{statistics.median(tps):.0f}, share of free (median {free_tps:.0f}) {statistics.median(tps) / free_tps:.3f}")
print("free ms/step", [round(x["ms_per_step"], 3) for x in res["free"]])
