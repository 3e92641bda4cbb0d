"""Where the engine thread's time goes in a constrained step: py-spy, attached at 100 Hz without
pausing the process (``--nonblocking``), over SmolLM2's in-process engine (the shipped
``config/models/smollm2.yaml``) serving the structured benchmark's schemas closed-loop (256
requests, 32 at a time, temperature 0.8), then free requests of the constrained answers' lengths.
Each mix first runs twice unprofiled (its plain ms per step), then repeatedly for ``SPY_S`` seconds
(25 by default) with py-spy recording raw stacks into ``$OUT/spy-json.txt`` and ``spy-free.txt``.
``--idle`` also records the threads' idle samples. From the checkout's root on the GPU machine,
after ``source benchmarks/gpu_env.sh`` (py-spy comes with the GPU pack):

    python3 benchmarks/results/engine-host-profile-h200/profile_step.py 100 [--idle]

``aggregate.py`` turns the stacks into milliseconds per step by function.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_engine_profile import line, load_model, matched, run_once, schema_requests
from servekit.optimizations.llm.continuous import ContinuousBatcher

out = Path(os.environ.get("OUT", "/tmp"))
runner, plan, tok, stops, comp = load_model(Path("config/models/smollm2.yaml"))
eng = ContinuousBatcher(runner, 32)
eng.warmup()
timer = PhaseTimer(exclusive=True)
prompts, free, cons = schema_requests(tok, comp, stops, 256)
r = run_once(eng, timer, prompts, cons, "w", 32)
print(line("JSON warm", 0, r), flush=True)
same = matched(free, r["lengths"])
rate = sys.argv[1] if len(sys.argv) > 1 else "100"
for name, params in (("json", cons), ("free", same)):
    for rep in range(2):
        r = run_once(eng, timer, prompts, params, "x", 32)
        print(line(name + " plain", rep, r), flush=True)
    extra = ["--idle"] if "--idle" in sys.argv else []
    spy = subprocess.Popen([shutil.which("py-spy"), "record", "--pid", str(os.getpid()), "--rate", rate, "--nonblocking",
                            "--format", "raw", *extra, "--output", str(out / f"spy-{name}.txt")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    time.sleep(2)  # attached
    t0, steps = time.time(), 0
    while time.time() - t0 < float(os.environ.get("SPY_S", "25")):
        r = run_once(eng, timer, prompts, params, "x", 32)
        steps += r["steps"]
        print(line(name + " spied", 0, r), flush=True)
    spy.send_signal(2)
    spy.wait(timeout=60)
    print(name, "spied steps", steps, flush=True)
