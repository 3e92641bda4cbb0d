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

from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_engine_profile import line, load_model, matched, run_once, schema_requests
from servekit.optimizations.llm import continuous
from servekit.optimizations.llm.continuous import ContinuousBatcher

runner, plan, tok, stops, comp = load_model(Path("config/models/smollm2.yaml"))
eng = ContinuousBatcher(runner, 32)
eng.warmup()
timer = PhaseTimer(exclusive=True)
prompts, free, cons = schema_requests(tok, comp, stops, 256)
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
