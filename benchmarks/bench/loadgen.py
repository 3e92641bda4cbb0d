"""Controller of the load-generator processes (benchmarks/bench/loadgen_worker.py).

The processes start once per run (locust's import costs seconds) and take one command per load
point. Records stream back through files, so the measuring side can judge windows while the load
keeps running, and stop it as soon as the point is stable.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from servekit.benchmarks.bench.stats import LLM_FIELDS, NFIELDS



@dataclass(frozen=True)
class LoadSpec:
    """One load point: `level` is requests/s (open) or users (closed)."""

    mode: str
    level: float
    arrival: str = "poisson"

    def label(self) -> str:
        return f"{self.level:g} rps" if self.mode == "open" else f"{int(self.level)} users"


class LoadGenError(RuntimeError):
    pass


class LoadGenerator:
    """A pool of worker processes; `start(point)` returns a handle that streams records."""

    def __init__(self, folder: Path, host: str, path: str, bodies: Path, content_type: str,
                 headers: dict[str, str], timeout_s: float, max_inflight: int, seed: int = 0,
                 stream: str = "none") -> None:
        self.folder = Path(folder)
        self.host, self.path, self.bodies = host, path, bodies
        self.content_type, self.headers = content_type, headers
        self.stream = stream  # "sse": answers are server-sent events, records get (first, last, tokens)
        self.nfields = len(LLM_FIELDS) if stream == "sse" else NFIELDS
        self.timeout_s, self.max_inflight, self.seed = timeout_s, max_inflight, seed
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[Path] = []
        self.seq = 0

    def ensure(self, n: int, timeout: float = 120.0) -> None:
        """Have exactly `n` worker processes running and ready."""
        if len(self.procs) == n and all(p.poll() is None for p in self.procs):
            return
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for k in range(n):
            d = self.folder / f"w{k}"
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            log = open(d / "worker.log", "ab")
            # Own session: Ctrl-C in the terminal reaches the controller only, which stops these.
            self.procs.append(subprocess.Popen([sys.executable, "-m", "servekit.benchmarks.bench.loadgen_worker", str(d)],
                                               cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            log.close()
            self.dirs.append(d)
        self.seq = 0
        deadline = time.monotonic() + timeout
        while not all((d / "ready").exists() for d in self.dirs):
            for p, d in zip(self.procs, self.dirs):
                if p.poll() is not None:
                    raise LoadGenError(f"load generator exited with {p.returncode}: "
                                       + (d / "worker.log").read_text(errors="replace")[-2000:])
            if time.monotonic() > deadline:
                raise LoadGenError(f"load generator processes not ready within {timeout:.0f}s")
            time.sleep(0.05)

    def _write(self, d: Path, spec: dict[str, Any]) -> None:
        tmp = d / f".cmd-{self.seq}.tmp"
        tmp.write_text(json.dumps(spec))
        tmp.rename(d / f"cmd-{self.seq}.json")

    def start(self, load: LoadSpec, processes: int, max_duration_s: float) -> "Handle":
        self.ensure(processes)
        start_epoch = time.time() + 0.3
        for k, d in enumerate(self.dirs):
            spec = {"action": "run", "mode": load.mode, "arrival": load.arrival, "host": self.host,
                    "path": self.path, "bodies": str(self.bodies), "content_type": self.content_type,
                    "headers": self.headers, "stream": self.stream, "timeout_s": self.timeout_s,
                    "max_inflight": self.max_inflight,
                    "start_epoch": start_epoch, "max_duration_s": max_duration_s,
                    "seed": self.seed * 1000003 + self.seq * 101 + k}
            if load.mode == "open":
                spec["rate"] = load.level / processes
            else:
                users = int(load.level)
                spec["users"] = users // processes + (1 if k < users % processes else 0)
            self._write(d, spec)
        h = Handle(self, self.seq, start_epoch)
        self.seq += 1
        return h

    def close(self) -> None:
        for d in self.dirs:
            try:
                self._write(d, {"action": "exit"})
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs, self.dirs = [], []


class Handle:
    """A running load point."""

    def __init__(self, gen: LoadGenerator, seq: int, start_epoch: float) -> None:
        self.gen, self.seq, self.start_epoch = gen, seq, start_epoch
        self.stopped = False

    def elapsed(self) -> float:
        return time.time() - self.start_epoch

    def sleep_until(self, t: float) -> None:
        """Sleep until `t` seconds after the start; raise if a worker died."""
        while True:
            left = t - self.elapsed()
            for p, d in zip(self.gen.procs, self.gen.dirs):
                if p.poll() is not None:
                    raise LoadGenError(f"load generator exited with {p.returncode}: "
                                       + (d / "worker.log").read_text(errors="replace")[-2000:])
            if left <= 0:
                return
            time.sleep(min(left, 0.1))

    def records(self) -> np.ndarray:
        rows = []
        width = self.gen.nfields
        for d in self.gen.dirs:
            path = d / f"rec-{self.seq}.bin"
            if path.exists():
                data = path.read_bytes()
                usable = len(data) // (8 * width) * (8 * width)
                rows.append(np.frombuffer(data[:usable], dtype=np.float64).reshape(-1, width))
        if not rows:
            return np.zeros((0, width))
        r = np.concatenate(rows)
        return r[np.argsort(r[:, 0], kind="stable")]

    def stop(self, timeout: float) -> dict[str, int]:
        """Stop sending, wait for in-flight requests, return the workers' counters."""
        for d in self.gen.dirs:
            (d / f"stop-{self.seq}").write_text("")
        deadline = time.monotonic() + timeout + 5
        done = [d / f"done-{self.seq}" for d in self.gen.dirs]
        while not all(p.exists() for p in done):
            if time.monotonic() > deadline:
                raise LoadGenError("load generator did not finish its in-flight requests in time")
            time.sleep(0.05)
        self.stopped = True
        totals = {"sent": 0, "unfinished": 0}
        for p in done:
            for k, v in json.loads(p.read_text()).items():
                totals[k] = totals.get(k, 0) + int(v)
        return totals


def processes_for(load: LoadSpec, fixed: int | None, rps_per_process: float, users_per_process: int) -> int:
    if fixed:
        return fixed
    cap = max(1, (os.cpu_count() or 2) // 2)
    need = load.level / rps_per_process if load.mode == "open" else load.level / users_per_process
    return int(min(cap, max(1, math.ceil(need))))
