"""Inside the variant's steps (``variant.diff`` applied): each ``MaskUpload.beside`` call's time, the
helper thread's work in it (the new rows' start and the riders' decode step) and when that work
started and ended, and every mask fill's wall time, over closed-loop runs alternating the masks
beside and after. From the checkout's root on the GPU machine, after ``source benchmarks/gpu_env.sh``:

    python3 benchmarks/results/engine-host-profile-h200/beside/timing.py
"""
import statistics
import threading
import time
from pathlib import Path

from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_engine_profile import line, load_model, run_once, schema_requests
from servekit.optimizations.llm import continuous, grammar
from servekit.optimizations.llm.continuous import ContinuousBatcher

runner, plan, tok, stops, comp = load_model(Path("config/models/smollm2.yaml"))
eng = ContinuousBatcher(runner, 32)
eng.warmup()
prompts, _, cons = schema_requests(tok, comp, stops, 256)
calls, fills = [], []
beside, fill = grammar.MaskUpload.beside, grammar.MaskUpload._fill


def timed_beside(self, matchers, dest, work, pool):
    d = {}

    def timed_work():
        d["w0"] = time.perf_counter()
        out = work()
        d["w1"] = time.perf_counter()
        return out
    t0 = time.perf_counter()
    out = beside(self, matchers, dest, timed_work, pool)
    d.update(t0=t0, t1=time.perf_counter(), n=len(matchers))
    calls.append(d)
    return out


def timed_fill(self, matchers, host, caps=()):
    t0 = time.perf_counter()
    fill(self, matchers, host, caps)
    fills.append((t0, time.perf_counter(), threading.current_thread().name))


grammar.MaskUpload.beside, grammar.MaskUpload._fill = timed_beside, timed_fill
timer = PhaseTimer(exclusive=True)
run_once(eng, timer, prompts, cons, "w", 32)
for mode in ("beside", "after", "beside", "after"):
    continuous.BESIDE_ROWS = 8 if mode == "beside" else 10**9
    calls.clear()
    fills.clear()
    r = run_once(eng, timer, prompts, cons, "x", 32)
    print(line(mode, 0, r), flush=True)
    walls = [(b - a) * 1e3 for a, b, _ in fills]
    print(f"  fills {len(fills)}: wall ms median {statistics.median(walls):.3f} mean {statistics.mean(walls):.3f}")
    if calls:
        med = lambda xs: statistics.median(xs)  # noqa: E731
        print(f"  beside calls {len(calls)} (rows median {med([d['n'] for d in calls])}): total ms median "
              f"{med([(d['t1'] - d['t0']) * 1e3 for d in calls]):.3f}, "
              f"work {med([(d['w1'] - d['w0']) * 1e3 for d in calls]):.3f}, "
              f"work starts after {med([(d['w0'] - d['t0']) * 1e3 for d in calls]):.3f}, "
              f"ends before return {med([(d['t1'] - d['w1']) * 1e3 for d in calls]):.3f}")
