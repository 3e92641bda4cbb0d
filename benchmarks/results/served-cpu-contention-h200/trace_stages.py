"""Where a request's time to first token goes, constrained against free, from the trace that
``ttft-trace.diff`` writes (/tmp/trace: the handler's and the engine process's marks, joined by
request key; perf_counter is CLOCK_MONOTONIC, one clock for both processes), or from a run's
``marks.jsonl.gz`` here. The last LAST requests of each kind are the benchmark's closed-loop
streams (each mix runs alone). Writes FOLDER/stages.json.

    python3 trace_stages.py /tmp/trace [LAST]
    python3 trace_stages.py intake/new2 3000"""
import glob
import gzip
import json
import statistics
import sys

STAGES = [("t0", "submitted", "handler: parse, prepare, tokenize (the call's requests)"),
          ("submitted", "recv", "to the engine process's main thread"),
          ("recv", "restored", "main thread: the grammar restored (cached: a matcher)"),
          ("restored", "queued", "to the engine thread: taken in, the matcher's start run"),
          ("queued", "admitted", "waiting for a free row / the next step's admission"),
          ("admitted", "prefill_launched", "admitted -> its prompt's last chunk launched"),
          ("prefill_launched", "sent", "-> first token read and sent"),
          ("sent", "handler_first", "engine sent -> the handler has it"),
          ("t0", "handler_first", "handler TTFT")]

folder = sys.argv[1]
last = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
marks: dict = {}
for path in glob.glob(f"{folder}/*.jsonl") + glob.glob(f"{folder}/*.jsonl.gz"):
    for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
        r = json.loads(line)
        marks.setdefault(tuple(r.pop("key")), {}).update(r)
rows = [m for k, m in marks.items() if k[0] != "warm-up" and "t0" in m and "sent" in m]
rows.sort(key=lambda m: m["t0"])
out = {}
for kind, flag in (("constrained", True), ("free", False)):
    sel = [m for m in rows if m["constrained"] == flag][-last:]
    out[kind] = {f"{a}->{b}": (round(statistics.median(m[b] - m[a] for m in sel) * 1e3, 3),
                               round(statistics.mean(m[b] - m[a] for m in sel) * 1e3, 3)) for a, b, _ in STAGES}
    out[kind]["requests"] = len(sel)
print(f"requests: constrained {out['constrained']['requests']}, free {out['free']['requests']} (ms, median / mean)")
print(f"{'stage':<34} {'constrained':>17} {'free':>17}  what")
for a, b, what in STAGES:
    c, f = out["constrained"][f"{a}->{b}"], out["free"][f"{a}->{b}"]
    print(f"{a + '->' + b:<34} {c[0]:8.3f} /{c[1]:7.3f} {f[0]:8.3f} /{f[1]:7.3f}  {what}")
json.dump(out, open(f"{folder}/stages.json", "w"), indent=1)
