"""The frontend's logging cost per request: TorchServe 0.12's own log4j2 configuration against
servekit's `config/log4j2.xml`.

    python -m servekit.benchmarks.frontend_logs --out benchmarks/results/frontend-logs-cpu

Each round starts a TorchServe with one configuration, registers a handler that answers at once (the
auto-benchmark's `sleep` test handler at 0 ms; 1 worker, batch 16, delay 2 ms) and sends it
open-loop Poisson load. After `--warmup` seconds it measures for `--seconds`: the Java frontend's CPU
time (user + system, from /proc) and the growth of every file in its log folder, each divided by the
requests answered in that time. Rounds alternate between the two configurations. Prints one JSON line
per round and writes `frontend-logs.json` into `--out`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from servekit.benchmarks.bench import archives
from servekit.benchmarks.bench.loadgen import LoadGenerator, LoadSpec
from servekit.torchserve import DEFAULT_LOG_CONFIG, TorchServe

CONFIGS = {"torchserve": None, "servekit": DEFAULT_LOG_CONFIG}


def _sizes(folder: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in folder.glob("*") if f.is_file()}


def one_round(name: str, store: Path, work: Path, rate: float, warmup: float, seconds: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    body = work / "body.jsonl"
    body.write_text('{"text": "x"}\n')
    with TorchServe(work / f"run-{name}", store, log_config=CONFIGS[name]) as ts:
        ts.register("answer.mar", "answer", batch_size=16, max_batch_delay_ms=2, workers=1)
        java = next(p for p in psutil.Process(ts.proc.pid).children(recursive=True) if "java" in p.name())
        gen = LoadGenerator(work / f"lg-{name}", ts.inference_url, "/predictions/answer", body,
                            "application/json", {}, 10, 1024)
        try:
            handle = gen.start(LoadSpec("open", rate), 1, warmup + seconds + 1)
            handle.sleep_until(warmup)
            cpu0, logs0 = java.cpu_times(), _sizes(ts.log_dir)
            handle.sleep_until(warmup + seconds)
            cpu1, logs1, records = java.cpu_times(), _sizes(ts.log_dir), handle.records()
            handle.stop(10)
        finally:
            gen.close()
    # The requests due within the measured seconds (times are seconds since the load's start).
    answered = records[(records[:, 0] >= warmup) & (records[:, 0] < warmup + seconds)]
    n = len(answered)
    ok = int((answered[:, 3] == 200).sum())
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    grown = {k: logs1[k] - logs0.get(k, 0) for k in logs1 if logs1[k] != logs0.get(k, 0)}
    return {"logs": name, "requests": n, "ok": ok, "java_cpu_us_per_request": round(cpu / n * 1e6, 1),
            "log_bytes_per_request": round(sum(grown.values()) / n, 1),
            "log_bytes_per_request_by_file": {k: round(v / n, 1) for k, v in sorted(grown.items())}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.frontend_logs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for frontend-logs.json")
    p.add_argument("--rate", type=float, default=1000.0, help="requests/s (default 1000)")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds per round (default 15)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per configuration, alternating (default 2)")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.seconds <= 0 or args.warmup < 0 or args.rounds < 1:
        p.error("--rate and --seconds must be > 0, --warmup >= 0, --rounds >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = work / "store"
        store.mkdir()
        cfg = archives.variant_config("sleep", None, {"sleep": {"mean_ms": 0, "sd_ms": 0, "seed": 1}}, {})
        archives.build_variant("sleep", "answer", cfg, store, work / "configs")
        for k in range(args.rounds):
            for name in CONFIGS:
                print(f"round {k + 1}/{args.rounds}: {name} log config, {args.rate:g} requests/s", file=sys.stderr)
                r = one_round(name, store, work / f"r{k}", args.rate, args.warmup, args.seconds)
                print(json.dumps(r), flush=True)
                rounds.append(r)
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m servekit.benchmarks.frontend_logs " + " ".join(argv or sys.argv[1:]),
              "machine": {"cpus": psutil.cpu_count(), "python": platform.python_version()},
              "rate": args.rate, "seconds": args.seconds, "rounds": rounds}
    (args.out / "frontend-logs.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
