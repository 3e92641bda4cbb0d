"""One load-generator process: locust (gevent) users driving HTTP requests, every request recorded raw.

Started by `servekit.benchmarks.bench.loadgen.LoadGenerator`, never by hand. It lives for a whole run and
takes commands through files in its folder, so locust's import (and gevent's monkey patching)
happens once per process and never touches the controlling process:

    ready          written once imported: {"pid", "gc_frozen_objects"}
    cmd-<n>.json   {"action": "run", ...spec...} or {"action": "exit"}
    stop-<n>       stop sending; finish in-flight requests; then write done-<n>
    rec-<n>.bin    records appended as float64 rows (intended, start, end, status, payload), plus
                   (first, last, tokens) for streamed requests
    done-<n>       written last; holds a JSON line with the process's own counters

Closed loop: `users` locust users, each sending its next request when the previous one returns.
Open loop: requests go out on a precomputed arrival schedule (Poisson or constant), each in its
own greenlet, and nobody waits for answers; `intended` is the scheduled time, so a request
delayed by the server or by this process still counts from when it was due. Plain (not streamed)
open-loop requests go through geventhttpclient's connection pool directly, the HTTP client under
locust's FastHttpSession: the session's response wrapping and request events cost ~90 of ~325 us
of this process's CPU per request (2-core VM), and at tens of thousands of requests/s the load
generators share the host's cores with the server they measure.

Streamed requests (`"stream": "sse"`): the answer's server-sent events are read as they arrive
(servekit.benchmarks.bench.sse) and the request ends at `data: [DONE]`; the connection is then closed,
since TorchServe holds the rest of the response until the whole batch has finished. The request
timeout covers the whole stream, not only each read.
"""
from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import numpy as np  # noqa: E402
from gevent.pool import Pool  # noqa: E402
from geventhttpclient import HTTPClient  # noqa: E402
from geventhttpclient.url import URL  # noqa: E402
from locust import User, constant, task  # noqa: E402
from locust.contrib.fasthttp import FastHttpSession  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.exception import StopUser  # noqa: E402

from servekit.benchmarks.bench.sse import StreamTally, read_events  # noqa: E402
from servekit.benchmarks.bench.stats import CONNECTION_ERROR, INCOMPLETE_STREAM  # noqa: E402
from servekit.optimizations.heap import freeze_heap  # noqa: E402

POLL_S = 0.02
FLUSH_S = 0.2


class Run:
    """State of one `run` command."""

    def __init__(self, spec: dict, folder: Path, seq: int) -> None:
        self.spec = spec
        self.seq = seq
        self.folder = folder
        self.bodies = [line.encode() for line in Path(spec["bodies"]).read_text().splitlines() if line.strip()]
        self.rng = np.random.default_rng(spec["seed"])
        self.order = self.rng.permutation(len(self.bodies))
        self.next_body = 0
        self.streamed = spec.get("stream") == "sse"
        self.records: list[tuple[float, ...]] = []
        self.stopping = False
        self.inflight = 0
        self.sent = 0
        self.headers = {"Content-Type": spec["content_type"], **spec.get("headers", {})}
        # Times are seconds since the run's start epoch (time.time()), measured with perf_counter.
        self.perf0 = time.perf_counter() + (spec["start_epoch"] - time.time())
        self.out = open(folder / f"rec-{seq}.bin", "ab")

    def now(self) -> float:
        return time.perf_counter() - self.perf0

    def pick(self) -> tuple[int, bytes]:
        i = int(self.order[self.next_body % len(self.order)])
        self.next_body += 1
        return i, self.bodies[i]

    def send(self, client: FastHttpSession | HTTPClient, intended: float | None) -> None:
        i, body = self.pick()
        self.inflight += 1
        self.sent += 1
        start = self.now()
        tally = StreamTally() if self.streamed else None
        try:
            if tally is not None:
                status = self.post_streamed(client, body, tally)
            elif isinstance(client, HTTPClient):
                status = self.post_plain(client, body)
            else:
                status = self.post(client, body)
        except (Exception, gevent.Timeout):  # connection refused/reset, timeout
            status = CONNECTION_ERROR
        end = self.now()
        self.inflight -= 1
        row = (start if intended is None else intended, start, end, float(status), float(i))
        self.records.append(row if tally is None else row + tally.fields())

    def post(self, client: FastHttpSession, body: bytes) -> int:
        with client.request("POST", self.spec["path"], data=body, headers=self.headers,
                            catch_response=True, name="bench") as resp:
            resp.success()  # locust's own statistics are not used
            return int(resp.status_code or 0)

    def post_plain(self, client: HTTPClient, body: bytes) -> int:
        with client.request("POST", self.spec["path"], body=body, headers=self.headers) as resp:
            resp.read()  # the whole answer, as a client would; the connection goes back to the pool
            return int(resp.status_code or 0)

    def post_streamed(self, client: FastHttpSession, body: bytes, tally: StreamTally) -> int:
        # A slow stream never trips the per-read network timeout: bound the whole request.
        with gevent.Timeout(self.spec["timeout_s"]):
            with client.request("POST", self.spec["path"], data=body, headers=self.headers, stream=True,
                                catch_response=True, name="bench") as resp:
                resp.success()
                status = int(resp.status_code or 0)
                if not status:  # no response at all
                    return CONNECTION_ERROR
                try:
                    if 200 <= status < 300:
                        read_events(resp.stream, tally, self.now)
                except ValueError:  # an event that is not JSON
                    return INCOMPLETE_STREAM
                finally:
                    resp.release()  # closes the connection unless the response was read to its end
        return status if not 200 <= status < 300 or tally.complete else INCOMPLETE_STREAM

    def flush(self) -> None:
        if self.records:
            rows, self.records = self.records, []
            self.out.write(np.asarray(rows, dtype=np.float64).tobytes())
            self.out.flush()


def make_session(env: Environment, run: Run, user: User | None, concurrency: int) -> FastHttpSession:
    t = run.spec["timeout_s"]
    return FastHttpSession(run.spec["host"], env.events.request, user, concurrency=concurrency,
                           network_timeout=t, connection_timeout=t, max_retries=0)


def closed_loop(run: Run) -> None:
    class ClosedUser(User):
        wait_time = constant(0)

        def __init__(self, environment: Environment) -> None:
            super().__init__(environment)
            self.client = make_session(environment, run, self, 1)

        @task
        def one(self) -> None:
            if run.stopping:
                raise StopUser()
            run.send(self.client, None)

    env = Environment(user_classes=[ClosedUser], host=run.spec["host"], catch_exceptions=True)
    runner = env.create_local_runner()
    delay = run.spec["start_epoch"] - time.time()
    if delay > 0:
        gevent.sleep(delay)
    users = run.spec["users"]
    runner.start(users, spawn_rate=max(users * 20, 1000))
    wait_stop(run)
    deadline = time.monotonic() + run.spec["timeout_s"] + 1
    while run.inflight and time.monotonic() < deadline:
        gevent.sleep(POLL_S)
    runner.quit()


def open_loop(run: Run) -> None:
    if run.streamed:
        env = Environment(user_classes=[], host=run.spec["host"], catch_exceptions=True)
        client: FastHttpSession | HTTPClient = make_session(env, run, None, run.spec["max_inflight"])
    else:
        t = run.spec["timeout_s"]
        client = HTTPClient.from_url(URL(run.spec["host"]), concurrency=run.spec["max_inflight"],
                                     network_timeout=t, connection_timeout=t)
    pool = Pool(run.spec["max_inflight"] + 16)
    rate = run.spec["rate"]
    horizon = run.spec["max_duration_s"]
    if run.spec["arrival"] == "poisson":
        from servekit.benchmarks.bench.stats import poisson_schedule
        schedule = poisson_schedule(rate, horizon, run.rng)
    else:
        from servekit.benchmarks.bench.stats import constant_schedule
        schedule = constant_schedule(rate, horizon, phase=float(run.rng.random()))
    for t in schedule:
        if run.stopping:
            break
        delay = t - run.now()
        if delay > 0:
            gevent.sleep(delay)
            if run.stopping:
                break
        pool.spawn(run.send, client, float(t))
    wait_stop(run)
    pool.join(timeout=run.spec["timeout_s"] + 1)
    pool.kill()
    if isinstance(client, HTTPClient):
        client.close()


def wait_stop(run: Run) -> None:
    while not run.stopping:
        gevent.sleep(POLL_S)


def watcher(run: Run) -> None:
    stop = run.folder / f"stop-{run.seq}"
    deadline = run.spec["start_epoch"] + run.spec["max_duration_s"]
    last_flush = time.monotonic()
    while True:
        if not run.stopping and (stop.exists() or time.time() > deadline):
            run.stopping = True
        if time.monotonic() - last_flush >= FLUSH_S:
            run.flush()
            last_flush = time.monotonic()
        gevent.sleep(POLL_S)


def main(folder: str) -> int:
    folder_p = Path(folder)
    # The imports (locust, gevent, numpy) leave ~60k objects that each full garbage collection would
    # walk: 33-40 ms on the busy 2-core VM, a pause that delays this process's sends and reads alike
    # and so lands in the latencies it records. Nothing imported is ever freed: exempt it.
    frozen = freeze_heap()
    # Written whole, then renamed: the parent takes the file's existence for readiness, and a
    # reader between its creation and its write saw it empty.
    (folder_p / "ready.tmp").write_text(json.dumps({"pid": os.getpid(), "gc_frozen_objects": frozen}))
    os.replace(folder_p / "ready.tmp", folder_p / "ready")
    seq = 0
    while True:
        cmd = folder_p / f"cmd-{seq}.json"
        if not cmd.exists():
            if os.getppid() == 1:  # the controller died: do not linger
                return 0
            gevent.sleep(POLL_S)
            continue
        try:
            spec = json.loads(cmd.read_text())
        except ValueError:  # written but not complete yet
            gevent.sleep(POLL_S)
            continue
        if spec["action"] == "exit":
            return 0
        run = Run(spec, folder_p, seq)
        w = gevent.spawn(watcher, run)
        try:
            (closed_loop if spec["mode"] == "closed" else open_loop)(run)
        finally:
            w.kill()
            run.flush()
            run.out.close()
            # Written aside then renamed: the controller reads done-<n> as soon as it exists.
            tmp = folder_p / f".done-{seq}.tmp"
            tmp.write_text(json.dumps({"sent": run.sent, "unfinished": run.inflight}))
            tmp.rename(folder_p / f"done-{seq}")
        seq += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
