"""How much of a constrained engine step the device is busy: SmolLM2's in-process engine (the
shipped ``config/models/smollm2.yaml``; ``--model-dir``: another converted checkpoint under it)
serving the structured benchmark's schemas closed-loop (256 requests, 32 at a time, temperature
0.8), then free requests of the constrained answers' lengths. Each mix first runs ``--repeats``
times plain (its ms per step), then as often with a CUDA event pair around every captured graph's
replay: each graph's device time, summed per step and by kind (the packed forward by token bucket
and path, a split step's forward half, its sampling half, whole decode steps), and each engine
step's wall time by the forward it launched. A step whose device time is well under its wall time
waits on the host. From the checkout's root on the GPU machine, after ``source
benchmarks/gpu_env.sh``:

    python3 benchmarks/results/constrained-device-time-h200/device_time.py [--repeats 2]

Two engine variants, not kept, are compared first where their diff is applied to the checkout
(``git apply``):

- ``--flags ARM ...`` (``flag-variant.diff``): JSON runs alternating between the arms named:
  ``shipped``, ``launch-first`` (a split step with no prompt to prefill launches its forward before
  reading the step before it), ``no-runs-alone`` (the shipped order, no forward for forced runs
  alone: ``RUNS_ALONE_SHARE`` out of reach), ``hold`` (a lone new prompt waits a step for another to
  share its packed forward) and ``hold+launch-first``; then one run of each with events;
- ``--ab`` (``rule-variant.diff``): the same launching first, where warm-up timed the batch's decode
  forward under 2 ms, against reading first, alternating.
"""
import argparse
import collections
import json
import os
import time
from pathlib import Path

import torch

from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_engine_profile import line, load_model, matched, run_once, schema_requests
from servekit.optimizations.llm import continuous, generate, packed
from servekit.optimizations.llm.continuous import ContinuousBatcher

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--repeats", type=int, default=2, help="timed runs of each mix (plain, then with events)")
ap.add_argument("--ab", action="store_true",
                help="first alternate JSON runs reading first and launching first (rule-variant.diff applied)")
ap.add_argument("--flags", nargs="+", default=[], choices=["shipped", "launch-first", "no-runs-alone", "hold",
                                                           "hold+launch-first"],
                help="first alternate JSON runs of these arms (flag-variant.diff applied)")
ap.add_argument("--model-dir", type=Path, help="a converted checkpoint to serve instead of SmolLM2")
args = ap.parse_args()
out = Path(os.environ.get("OUT", "/tmp"))
out.mkdir(parents=True, exist_ok=True)

runner, plan, tok, stops, comp = load_model(Path("config/models/smollm2.yaml"), args.model_dir)
eng = ContinuousBatcher(runner, 32)
# Each variant's arms set attributes its diff adds: without the diff they would all run the shipped
# engine, so refuse instead.
if args.ab and not hasattr(eng, "forward_ms"):
    ap.error("--ab needs rule-variant.diff applied (git apply)")
if args.flags and not hasattr(eng, "hold_prompts"):
    ap.error("--flags needs flag-variant.diff applied (git apply)")
eng.warmup()
timed = getattr(eng, "forward_ms", {})  # rule-variant.diff's warm-up timing
if timed:
    print("decode forward ms by batch bucket:", {b: round(ms, 3) for b, ms in timed.items()}, flush=True)
shipped_share = continuous.RUNS_ALONE_SHARE
timer = PhaseTimer(exclusive=True)
prompts, free, cons = schema_requests(tok, comp, stops, 256)
r = run_once(eng, timer, prompts, cons, "w", 32)
print(line("JSON warm", 0, r), flush=True)
same = matched(free, r["lengths"])

records: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
plain_run = generate.GraphedStep.run


def kind(step: generate.GraphedStep) -> str:
    if isinstance(step, packed._PackedStep):
        path = "fused" if step.n <= step.owner.fused_tokens else "layers"
        return f"packed {step.n} ({path})"
    return type(step).__name__


def timed_run(self: generate.GraphedStep) -> torch.Tensor:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = plain_run(self)
    end.record()
    records.append((kind(self), start, end))
    return result


def with_events(name: str, params: list, rep: int) -> dict:
    """One run with an event pair around every graph replay, and each engine step's wall time with the
    forwards it launched: its device time by kind, and wall ms per step by the forward it launched."""
    records.clear()
    walls: list[tuple[float, list[str]]] = []
    step = eng.step

    def timed_step() -> dict:
        n0, t0 = len(records), time.perf_counter()
        result = step()
        walls.append((time.perf_counter() - t0, [k for k, _, _ in records[n0:]]))
        return result

    generate.GraphedStep.run, eng.step = timed_run, timed_step
    try:
        r = run_once(eng, timer, prompts, params, "x", 32)
    finally:
        generate.GraphedStep.run = plain_run
        del eng.step
    torch.cuda.synchronize()
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for k, start, end in records:
        by_kind[k].append(start.elapsed_time(end))
    busy = sum(sum(v) for v in by_kind.values())
    steps = r["steps"]
    print(line(name + " with events", rep, r), flush=True)
    print(f"  device ms per step {busy / steps:.3f} of {r['ms_per_step']:.3f} wall "
          f"({busy / steps / r['ms_per_step']:.0%} busy)", flush=True)
    for k in sorted(by_kind, key=lambda k: -sum(by_kind[k])):
        v = by_kind[k]
        print(f"    {k:24s} {len(v):5d} launches, {len(v) / steps:.2f} a step, mean {sum(v) / len(v):.3f} ms, "
              f"{sum(v) / steps:.3f} ms a step", flush=True)
    by_step: dict[str, list[float]] = collections.defaultdict(list)
    for wall, kinds in walls:
        forward = [k for k in kinds if k != "SampleStep"]
        by_step[forward[-1].split(" (")[0] if forward else "no forward"].append(wall * 1e3)
    for k in sorted(by_step, key=lambda k: -len(by_step[k])):
        v = by_step[k]
        print(f"    steps launching {k:14s} {len(v):5d}, wall mean {sum(v) / len(v):.3f} ms", flush=True)
    return {"steps": steps, "wall_ms_per_step": r["ms_per_step"], "tok_per_s": r["tok_per_s"],
            "device_ms_per_step": busy / steps,
            "kinds": {k: {"launches": len(v), "mean_ms": sum(v) / len(v)} for k, v in by_kind.items()},
            "steps_by_forward": {k: {"steps": len(v), "wall_mean_ms": sum(v) / len(v)} for k, v in by_step.items()}}


FLAG_ARMS = {"shipped": (False, False, False), "launch-first": (True, False, False),
             "no-runs-alone": (False, False, True), "hold": (False, True, False),
             "hold+launch-first": (True, True, False)}


def set_arm(name: str) -> None:
    """``--ab``: read first (no forward timed) or the rule; ``--flags``: the flag variant's attributes."""
    if name in ("read first", "launch first"):
        eng.forward_ms = timed if name == "launch first" else {}
        return
    eng.launch_first, eng.hold_prompts, no_alone = FLAG_ARMS[name]
    continuous.RUNS_ALONE_SHARE = 1e9 if no_alone else shipped_share


summary: dict = {"decode_forward_ms": timed}
arms = ["read first", "launch first"] if args.ab else args.flags
for rep in range(args.repeats if arms else 0):
    for name in arms:
        set_arm(name)
        r = run_once(eng, timer, prompts, cons, "x", 32)
        print(line(f"JSON {name}", rep, r), flush=True)
        summary.setdefault(f"JSON {name}", []).append(
            {k: r[k] for k in ("steps", "ms_per_step", "tok_per_s", "tokens_per_step")})
for name in arms:
    set_arm(name)
    summary[f"JSON {name} events"] = with_events(f"JSON {name}", cons, 0)
if arms:
    set_arm("launch first" if args.ab else "shipped")
for name, params in (("JSON", cons), ("free, matched lengths", same)):
    for rep in range(args.repeats):
        r = run_once(eng, timer, prompts, params, "x", 32)
        print(line(name + " plain", rep, r), flush=True)
    for rep in range(args.repeats):
        summary[f"{name} {rep}"] = with_events(name, params, rep)
(out / "device_time.json").write_text(json.dumps(summary, indent=1))
