"""Host jitter check before a latency benchmark: do independent processes slow down together?

    python -m servekit.benchmarks.host_jitter --work cpu --out DIR
    python -m servekit.benchmarks.host_jitter --work tokenize --model shaped/ms-marco-minilm-l6 --out DIR
    python -m servekit.benchmarks.host_jitter --work score --model shaped/ms-marco-minilm-l6 --rate 50 --out DIR
    python -m servekit.benchmarks.host_jitter --procs 0 --seconds 300 --out DIR &   # beside a benchmark

`--procs` processes (4) each repeat one fixed work unit for `--seconds` (30), back to back or at
`--rate` units/s, and record every unit: its start (wall clock), wall time, the thread's CPU time,
its run-queue wait (/proc/thread-self/schedstat), minor faults and involuntary context switches,
and the time Python's garbage collector ran inside it. The units:
  cpu       a fixed Python loop and a numpy sort calibrated to ~3 ms: no tokenizer, no GPU;
  tokenize  one rerank request (a query and 100 documents of 60-90 words of prose) through
            `ScoreRunner.tokenize` with a CPU plan: the handler's host work, no GPU;
  score     the same request through a `ScoreRunner` on the GPU plan `--plan` (the model-config
            cross-encoder-gpu.yaml by default): tokenize, then the forward (timed apart).
Each process runs as a serving worker does (one torch thread, tokenizer parallelism off).

Meanwhile the parent samples, every 100 ms, /proc/stat (steal, iowait, irq), /proc/vmstat
(compaction, THP, faults, reclaim), /proc/interrupts and every process's CPU ticks, and runs
`vmstat 1` and `top -b`. A unit slower than 3x its process's median is slow; slow units of several
processes that overlap in time are one shared stall: a machine-wide pause, since the processes share
nothing but the host. `summary.json` gives each shared stall with what the samples around it show
(CPU steal, faults, compaction, the processes that ran), the intervals between stalls and, for the
slow units, how much of their extra time was CPU time, run-queue wait or garbage collection.
`--procs 0` only samples the host, for `--seconds` or until SIGTERM. Measured on an H100 host in
benchmarks/results/rerank-200rps-h100 (stall-probe/): a quiet host shows `shared_stalls: 0`.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import re
import resource
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
VMSTAT_KEYS = re.compile(r"^(compact_|thp_|pgfault|pgmajfault|pgscan|pgsteal|allocstall|kswapd|numa_|"
                         r"pgmigrate|nr_tlb|drop_|pgalloc_|pgfree)")
SLOW = 3.0      # a unit this many times its process's median is slow
GAP_S = 0.1     # slow units closer than this belong to one stall


# -- the work units -------------------------------------------------------------------------------
def _cpu_time_ms(fn: Callable[[int], None], n: int) -> float:
    t0 = time.thread_time()
    fn(n)
    return (time.thread_time() - t0) * 1e3


def _cpu_unit(target_ms: float) -> Callable[[], dict[str, float]]:
    """A Python loop and a numpy sort, sized once so that the unit takes about `target_ms`."""
    import numpy as np

    data = np.random.default_rng(0).random(4096)

    def unit(n: int) -> None:
        np.sort(data)
        sum(i * i for i in range(n))

    n = 1000
    while True:  # sized by CPU time, the least of three: a busy host's waits do not count
        took = min(_cpu_time_ms(unit, n) for _ in range(3))
        if took > target_ms / 4:
            n = int(n * target_ms / took)
            break
        n *= 2
    return lambda: (unit(n), {})[1]


def rerank_requests(n: int, documents: int, seed: int) -> list[list[tuple[str, str]]]:
    """`n` requests of one query and `documents` documents of 60, 75 or 90 words of prose (the
    `text: prose` payloads of the rerank sweeps), as (query, document) pairs."""
    import numpy as np

    from servekit.benchmarks.bench.payloads import prose_texts

    rng = np.random.default_rng(seed)
    query = "how do the workers batch the requests of many clients"
    out = []
    for _ in range(n):
        lengths = rng.choice([60, 75, 90], size=documents, p=[0.25, 0.5, 0.25])
        out.append([(query, text) for text in prose_texts(rng, lengths, 90)])
    return out


def _score_unit(work: str, model: Path, plan_path: Path | None, seed: int) -> Callable[[], dict[str, float]]:
    import torch
    import yaml

    from servekit.optimizations.plan import parse_plan
    from servekit.optimizations.score.runner import ScoreRunner
    from servekit.resources import model_config

    raw = yaml.safe_load((plan_path or model_config("cross-encoder-gpu")).read_text())["servekit"]
    gpu = parse_plan(raw)
    if work == "score":
        torch.set_num_threads(1)  # as the handler sets it in a GPU worker
        torch.cuda.set_device(0)
        runner = ScoreRunner(model, gpu)
    else:
        torch.set_num_threads(1)  # the golden-set check at load; nothing else runs the model here
        runner = ScoreRunner(model, parse_plan({"device": "cpu", "warmup": False,
                                                "tokenizer_cache": gpu.tokenizer_cache}))
    requests = rerank_requests(200, 100, seed)
    state = {"k": 0}

    def unit() -> dict[str, float]:
        pairs = requests[state["k"] % len(requests)]
        state["k"] += 1
        t0 = time.perf_counter()
        ids, types, _ = runner.tokenize(pairs)
        if work == "tokenize":
            return {}
        t1 = time.perf_counter()
        runner.scores(runner.logits(ids, types))
        return {"tok_ms": (t1 - t0) * 1e3, "gpu_ms": (time.perf_counter() - t1) * 1e3}
    return unit


def _schedstat() -> tuple[int, int]:
    """This thread's (ns on a CPU, ns waiting on a run queue)."""
    try:
        run, wait, _ = open("/proc/thread-self/schedstat").read().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def worker(k: int, args: dict[str, Any], out: str) -> None:
    """One process: set up the unit, say it is ready, wait for the common start (the `go` file the
    parent writes once every process is ready), run units until the deadline."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    if args["work"] == "cpu":
        unit = _cpu_unit(args["unit_ms"])
    else:
        unit = _score_unit(args["work"], Path(args["model"]), args["plan"] and Path(args["plan"]), k)
    for _ in range(20):  # warm: caches, first-call paths
        unit()
    if args["freeze"]:
        gc.collect()
        gc.freeze()
    gc_spans: list[float] = []
    gc_t = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_t[0] = time.perf_counter()
        else:
            gc_spans.append((time.perf_counter() - gc_t[0]) * 1e3)
    gc.callbacks.append(on_gc)
    Path(out, f"ready-{k}").touch()
    go = Path(out, "go")
    while not go.exists():
        time.sleep(0.005)
    start_at = float(go.read_text())
    while time.time() < start_at:
        time.sleep(0.002)
    deadline = start_at + args["seconds"]
    interval = 1.0 / args["rate"] if args["rate"] else 0.0
    next_t = time.time()
    rows = []
    while True:
        if interval:
            next_t = max(next_t + interval, time.time())
            time.sleep(max(0.0, next_t - time.time()))
        if time.time() >= deadline:
            break
        ru0, (_, wait0), c0 = resource.getrusage(resource.RUSAGE_THREAD), _schedstat(), time.thread_time()
        del gc_spans[:]
        t, p0 = time.time(), time.perf_counter()
        extra = unit()
        wall = (time.perf_counter() - p0) * 1e3
        c1, (_, wait1), ru1 = time.thread_time(), _schedstat(), resource.getrusage(resource.RUSAGE_THREAD)
        rows.append({"t": round(t, 4), "wall_ms": round(wall, 3), "cpu_ms": round((c1 - c0) * 1e3, 3),
                     "runq_ms": round((wait1 - wait0) / 1e6, 3), "minflt": ru1.ru_minflt - ru0.ru_minflt,
                     "majflt": ru1.ru_majflt - ru0.ru_majflt, "nivcsw": ru1.ru_nivcsw - ru0.ru_nivcsw,
                     "gc_ms": round(sum(gc_spans), 3), **{a: round(b, 3) for a, b in extra.items()}})
    Path(out, f"worker-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path(out, f"worker-{k}.pid").write_text(str(os.getpid()))


# -- the host samples -----------------------------------------------------------------------------
def read_host() -> dict[str, Any]:
    """One sample of the host's counters: /proc/stat's CPU ticks, /proc/vmstat's selected
    counters, each interrupt row's total and every process's CPU ticks (pid -> (comm, ticks))."""
    cpu = open("/proc/stat").readline().split()[1:1 + len(STAT_FIELDS)]
    vm = {}
    for line in open("/proc/vmstat"):
        key, value = line.split()
        if VMSTAT_KEYS.match(key):
            vm[key] = int(value)
    irq = {}
    try:
        for line in open("/proc/interrupts").readlines()[1:]:
            parts = line.split()
            counts = [int(x) for x in parts[1:] if x.isdigit()]
            irq[parts[0].rstrip(":")] = sum(counts)
    except OSError:
        pass
    procs = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = open(f"/proc/{entry.name}/stat").read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        procs[entry.name] = (comm, int(fields[11]) + int(fields[12]))
    return {"t": time.time(), "cpu": dict(zip(STAT_FIELDS, map(int, cpu))), "vm": vm, "irq": irq, "procs": procs}


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What changed from sample `a` to sample `b` (zeros left out)."""
    def diff(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
        return {k: v - x.get(k, 0) for k, v in y.items() if v != x.get(k, 0)}
    procs = {f"{comm}:{pid}": ticks - a["procs"].get(pid, (comm, 0))[1]
             for pid, (comm, ticks) in b["procs"].items() if ticks != a["procs"].get(pid, (comm, 0))[1]}
    return {"t0": round(a["t"], 4), "t1": round(b["t"], 4), "cpu": diff(a["cpu"], b["cpu"]),
            "vm": diff(a["vm"], b["vm"]), "irq": diff(a["irq"], b["irq"]), "procs": procs}


# -- the analysis ---------------------------------------------------------------------------------
def stalls(units: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Slow units (wall > SLOW x their process's median) grouped into stalls: units that overlap or
    lie within GAP_S of each other, with the processes they came from."""
    slow = []
    for k, rows in units.items():
        if not rows:
            continue
        med = statistics.median(r["wall_ms"] for r in rows)
        slow += [(r["t"], r["t"] + r["wall_ms"] / 1e3, k, r) for r in rows if r["wall_ms"] > SLOW * med]
    slow.sort(key=lambda s: s[0])
    out: list[dict[str, Any]] = []
    for t0, t1, k, r in slow:
        if out and t0 <= out[-1]["t1"] + GAP_S:
            ev = out[-1]
            ev["t1"] = max(ev["t1"], t1)
        else:
            ev = {"t0": t0, "t1": t1, "units": []}
            out.append(ev)
        ev["units"].append({"proc": k, **r})
    for ev in out:
        ev["procs"] = sorted({u["proc"] for u in ev["units"]})
    return out


def summarize(units: dict[int, list[dict[str, Any]]], samples: list[dict[str, Any]],
              own: set[str] = frozenset()) -> dict[str, Any]:
    """Per process: units, p50/p99/max wall; the shared stalls (slow units of 2+ processes) with the
    host samples that overlap each (CPU ticks by kind, counters, the processes that ran, `own`
    labels, comm:pid, marked as ours), the intervals between them; and where the slow units'
    extra time went (CPU, run-queue wait, garbage collection, faults)."""
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else 0.0

    per_proc = {k: {"units": len(rows), "p50_ms": pct([r["wall_ms"] for r in rows], 0.5),
                    "p99_ms": pct([r["wall_ms"] for r in rows], 0.99),
                    "max_ms": pct([r["wall_ms"] for r in rows], 1.0),
                    "cpu_p50_ms": pct([r["cpu_ms"] for r in rows], 0.5)} for k, rows in units.items()}
    events = stalls(units)
    shared = [ev for ev in events if len(ev["procs"]) >= 2]
    out_events = []
    for ev in shared:
        near = [s for s in samples if s["t1"] >= ev["t0"] - 0.05 and s["t0"] <= ev["t1"] + 0.05]
        span = sum(s["t1"] - s["t0"] for s in near) or 1.0
        cpu: dict[str, int] = {}
        vm: dict[str, int] = {}
        procs: dict[str, int] = {}
        for s in near:
            for src, dst in ((s["cpu"], cpu), (s["vm"], vm), (s["procs"], procs)):
                for key, v in src.items():
                    dst[key] = dst.get(key, 0) + v
        busy = sorted(procs.items(), key=lambda kv: -kv[1])[:8]
        slow = ev["units"]
        out_events.append({
            "t": round(ev["t0"], 3), "dur_ms": round((ev["t1"] - ev["t0"]) * 1e3, 1), "procs": ev["procs"],
            "worst_ms": max(u["wall_ms"] for u in slow),
            "wall_over_cpu": round(sum(u["wall_ms"] for u in slow) / max(1e-3, sum(u["cpu_ms"] for u in slow)), 2),
            "runq_ms": round(sum(u["runq_ms"] for u in slow), 2), "gc_ms": round(sum(u["gc_ms"] for u in slow), 2),
            "minflt": sum(u["minflt"] for u in slow),
            "host_window_s": round(span, 3), "host_cpu_ticks": cpu,
            "host_vm": {k: v for k, v in vm.items() if k.startswith(("compact", "thp", "pgmajfault", "allocstall",
                                                                     "pgscan", "pgmigrate"))},
            "busy": [f"{'ours ' if name in own else ''}{name}={ticks}" for name, ticks in busy]})
    starts = [ev["t"] for ev in out_events]
    gaps = [round(b - a, 3) for a, b in zip(starts, starts[1:])]
    slow_units = [u for ev in events for u in ev["units"]]
    med = {k: statistics.median(r["wall_ms"] for r in rows) for k, rows in units.items() if rows}
    med_cpu = {k: statistics.median(r["cpu_ms"] for r in rows) for k, rows in units.items() if rows}
    extra = sum(u["wall_ms"] - med[u["proc"]] for u in slow_units)
    total = {f: sum(s["cpu"].get(f, 0) for s in samples) for f in STAT_FIELDS}
    ticks = sum(total.values()) or 1
    return {
        "per_proc": per_proc, "slow_units": len(slow_units), "stalls": len(events), "shared_stalls": len(shared),
        "shared_interval_s": {"median": pct(gaps, 0.5), "p10": pct(gaps, 0.1), "p90": pct(gaps, 0.9)},
        "slow_extra_ms": round(extra, 1),
        "slow_extra_split": {
            "cpu_ms": round(sum(u["cpu_ms"] - med_cpu[u["proc"]] for u in slow_units), 1),
            "runq_ms": round(sum(u["runq_ms"] for u in slow_units), 1),
            "gc_ms": round(sum(u["gc_ms"] for u in slow_units), 1)},
        "host_cpu_share": {f: round(v / ticks, 4) for f, v in total.items()},
        "events": out_events}


# -- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")  # a fresh interpreter per process, as TorchServe starts its workers
    for stale in [*out.glob("ready-*"), out / "go"]:
        stale.unlink(missing_ok=True)
    cfg = {"work": args.work, "unit_ms": args.unit_ms, "model": args.model, "plan": args.plan,
           "seconds": args.seconds, "rate": args.rate, "freeze": args.freeze}
    procs = [ctx.Process(target=worker, args=(k, cfg, str(out))) for k in range(args.procs)]
    for p in procs:
        p.start()
    t_setup = time.time()
    while len(list(out.glob("ready-*"))) < args.procs:
        if any(p.exitcode is not None for p in procs) or time.time() - t_setup > args.setup_s:
            for p in procs:
                p.kill()
            raise SystemExit(f"the workers were not ready (exit codes {[p.exitcode for p in procs]})")
        time.sleep(0.2)
    (out / "go.tmp").write_text(str(time.time() + 1.0))
    (out / "go.tmp").rename(out / "go")
    tools = [subprocess.Popen(cmd, stdout=open(out / name, "w"), stderr=subprocess.STDOUT)
             for cmd, name in ((["vmstat", "-w", "1", str(int(args.seconds) + 3)], "vmstat.log"),
                               (["top", "-b", "-d", "0.5", "-w", "200", "-n", str(int(args.seconds * 2) + 4)], "top.log"))]
    samples = []
    prev = read_host()
    t_end = time.time() + args.seconds  # with --procs 0: the host samples alone, beside another run
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # stopped early: keep what was sampled
    while not stop and (any(p.is_alive() for p in procs) or (not procs and time.time() < t_end)):
        time.sleep(max(0.0, args.sample_s - (time.time() - prev["t"])))
        cur = read_host()
        samples.append(delta(prev, cur))
        prev = cur
    for tool in tools:
        try:
            tool.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tool.kill()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"workers exited with {[p.exitcode for p in procs]}")
    (out / "host.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    units = {k: [json.loads(line) for line in (out / f"worker-{k}.jsonl").read_text().splitlines()]
             for k in range(args.procs)}
    own = set()
    for k in range(args.procs):
        pid = (out / f"worker-{k}.pid").read_text()
        own |= {name for s in samples for name in s["procs"] if name.endswith(f":{pid}")}
    summary = {"work": args.work, "procs": args.procs, "seconds": args.seconds, "rate": args.rate,
               **summarize(units, samples, own)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", choices=("cpu", "tokenize", "score"), default="cpu")
    ap.add_argument("--procs", type=int, default=4, help="0: sample the host only, for --seconds")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=0.0, help="units/s per process; 0: back to back")
    ap.add_argument("--unit-ms", type=float, default=3.0, help="the cpu unit's size")
    ap.add_argument("--model", help="a cross-encoder folder (tokenize, score)")
    ap.add_argument("--plan", help="a model-config YAML whose servekit section is the GPU plan (score)")
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() once set up, as the handler does")
    ap.add_argument("--setup-s", type=float, default=600.0, help="the most time the processes get to set up")
    ap.add_argument("--sample-s", type=float, default=0.1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.work != "cpu" and not args.model:
        ap.error("--model is needed for --work tokenize and score")
    s = run(args)
    print(json.dumps({k: v for k, v in s.items() if k != "events"}, indent=1))
    for ev in s["events"][:40]:
        print(json.dumps(ev))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
