"""Every thread's CPU time and run-queue wait on this host over a window, from the kernel's
schedstat (/proc/PID/task/TID/schedstat: ns on a CPU, ns runnable but waiting for one, slices),
with the context switches each thread made, and the host's busy cores (/proc/stat).

    python3 threads.py SECONDS OUT.json        # prints the busiest threads, writes them all

A thread that waits long on the run queue while it has work is held back by the other threads on
the host, whatever its own code costs."""
import json
import os
import sys
import time


def cpu_busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def snapshot() -> dict:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            for tid in os.listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                with open(f"{base}/comm") as f:
                    comm = f.read().strip()
                with open(f"{base}/schedstat") as f:
                    run, wait, slices = (int(x) for x in f.read().split())
                with open(f"{base}/status") as f:
                    st = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
                out[(pid, tid)] = dict(pid=int(pid), tid=int(tid), comm=comm, cmd=cmd, run=run, wait=wait,
                                       slices=slices, vol=int(st["voluntary_ctxt_switches"]),
                                       invol=int(st["nonvoluntary_ctxt_switches"]))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


def main() -> None:
    seconds, path = float(sys.argv[1]), sys.argv[2]
    b0, a0 = snapshot(), cpu_busy()
    t0 = time.monotonic()
    time.sleep(seconds)
    b1, a1 = snapshot(), cpu_busy()
    wall = time.monotonic() - t0
    rows = []
    for key, e in b1.items():
        s = b0.get(key)
        if s is None:
            continue
        d = {k: e[k] - s[k] for k in ("run", "wait", "slices", "vol", "invol")}
        if d["run"] == 0 and d["wait"] == 0:
            continue
        rows.append(dict(pid=e["pid"], tid=e["tid"], comm=e["comm"], cmd=e["cmd"],
                         run_share=d["run"] / 1e9 / wall, wait_share=d["wait"] / 1e9 / wall,
                         slices=d["slices"], voluntary=d["vol"], involuntary=d["invol"]))
    rows.sort(key=lambda r: -r["run_share"])
    ncpu = os.cpu_count()
    busy = (a1[0] - a0[0]) / max(1, a1[1] - a0[1]) * ncpu
    summary = dict(seconds=round(wall, 2), cpus=ncpu, busy_cpus=round(busy, 2),
                   threads_running_sum=round(sum(r["run_share"] for r in rows), 2),
                   threads_waiting_sum=round(sum(r["wait_share"] for r in rows), 2))
    with open(path, "w") as f:
        json.dump(dict(summary=summary, threads=rows), f, indent=1)
    print(json.dumps(summary))
    print(f"{'run%':>6} {'wait%':>6} {'invol/s':>8} {'vol/s':>8}  pid/tid comm  [process]")
    for r in rows[:28]:
        print(f"{100 * r['run_share']:6.1f} {100 * r['wait_share']:6.1f} {r['involuntary'] / wall:8.0f} "
              f"{r['voluntary'] / wall:8.0f}  {r['pid']}/{r['tid']} {r['comm']}  [{r['cmd'][:60]}]")


if __name__ == "__main__":
    main()
