"""`python -m servekit.probe` against a stand-in management API (the real one: test_k8s_pod_live.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from servekit.torchserve import free_port
from http_double import HttpDouble, JsonHandler

ROOT = Path(__file__).resolve().parent.parent


class FakeManagement(HttpDouble):
    """Answers GET /models/<name> from `self.models` (worker states) and the batch settings it was
    registered with, records POST/PUT calls."""

    def __init__(self, port: int = 0) -> None:
        self.models: dict[str, list[str]] = {}
        self.settings: dict[str, dict] = {}
        self.calls: list[tuple[str, str, dict]] = []
        self.fail_register: tuple[int, str] | None = None
        outer = self

        class Handler(JsonHandler):
            def do_GET(self):
                path = urllib.parse.urlparse(self.path).path
                if path == "/models":
                    return self.reply(200, {"models": [{"modelName": m} for m in outer.models]})
                name = urllib.parse.unquote(path.removeprefix("/models/"))
                if name not in outer.models:
                    return self.reply(404, {"code": 404, "type": "ModelNotFoundException",
                                            "message": f"Model not found: {name}"})
                workers = [{"id": str(9000 + i), "status": s} for i, s in enumerate(outer.models[name])]
                self.reply(200, [{"modelName": name, "modelVersion": "1.0", "workers": workers,
                                  **outer.settings.get(name, {})}])

            def do_POST(self):
                url = urllib.parse.urlparse(self.path)
                params = dict(urllib.parse.parse_qsl(url.query))
                outer.calls.append(("POST", url.path, params))
                if outer.fail_register:
                    return self.reply(outer.fail_register[0], {"message": outer.fail_register[1]})
                outer.models.setdefault(params["model_name"], ["UNLOADING"])
                outer.settings[params["model_name"]] = {
                    key: int(params[p]) for key, p in (("batchSize", "batch_size"), ("maxBatchDelay", "max_batch_delay"))
                    if p in params}
                self.reply(200, {"status": "Model registered"})

            def do_PUT(self):
                url = urllib.parse.urlparse(self.path)
                outer.calls.append(("PUT", url.path, dict(urllib.parse.parse_qsl(url.query))))
                self.reply(202, {"status": "Processing worker updates..."})

        super().__init__(Handler, port)


@pytest.fixture
def api():
    fake = FakeManagement()
    yield fake
    fake.close()


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servekit.probe", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def config(tmp_path: Path, management: str, models: dict | None = None) -> Path:
    path = tmp_path / "config.properties"
    models = models if models is not None else {
        "minilm": {"1.0": {"marName": "minilm.mar", "minWorkers": 2, "maxWorkers": 2, "batchSize": 16,
                           "maxBatchDelay": 5, "responseTimeout": 120}}}
    path.write_text(f"# pod config\ninference_address=http://0.0.0.0:8080\nmanagement_address={management}\n"
                    f"models={json.dumps(models)}\n")
    return path


@pytest.mark.parametrize("states, ok", [
    (["READY"], True), (["UNLOADING", "READY"], True), (["UNLOADING"], False), (["STOPPED"], False), ([], False),
])
def test_ready_only_with_a_ready_worker(api, states, ok):
    api.models["minilm"] = states
    proc = probe("ready", "--model", "minilm", "--management", api.url)
    assert proc.returncode == (0 if ok else 1), proc.stdout + proc.stderr
    assert ("READY" in proc.stdout) if ok else ("no READY worker" in proc.stderr)


def test_ready_reads_the_management_address_from_the_config(api, tmp_path):
    api.models["minilm"] = ["READY"]
    assert probe("ready", "--model", "minilm", "--config", str(config(tmp_path, api.url))).returncode == 0
    api.models["minilm"] = ["UNLOADING"]
    assert probe("ready", "--model", "minilm", "--config", str(config(tmp_path, api.url))).returncode == 1


def test_not_ready_when_unregistered_or_down(api):
    proc = probe("ready", "--model", "other", "--management", api.url)
    assert proc.returncode == 1 and "not registered" in proc.stderr
    closed = f"http://127.0.0.1:{free_port()}"
    proc = probe("ready", "--model", "minilm", "--management", closed)
    assert proc.returncode == 1 and "unreachable" in proc.stderr and "Traceback" not in proc.stderr


def test_probe_imports_nothing_heavy():
    """Kubelet runs it every few seconds: standard library only."""
    code = ("import sys, time; t = time.perf_counter(); import servekit.probe; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'numpy', 'yaml', 'ts', 'requests', 'niquests', 'handlers', 'optimizations'}); "
            "print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_register_uses_the_models_line(api, tmp_path):
    proc = probe("register", "--config", str(config(tmp_path, api.url)))
    assert proc.returncode == 0, proc.stderr
    assert "minilm: batch_size=16 max_batch_delay=5 workers=2" in proc.stdout
    (post, path, params), (put, put_path, workers) = api.calls
    assert (post, path, put, put_path) == ("POST", "/models", "PUT", "/models/minilm")
    assert params == {"url": "minilm.mar", "model_name": "minilm", "synchronous": "false", "initial_workers": "2",
                      "batch_size": "16", "max_batch_delay": "5", "response_timeout": "120"}
    assert workers == {"min_worker": "2", "max_worker": "2", "synchronous": "false"}


def test_register_waits_for_the_management_api(tmp_path):
    port = free_port()
    path = config(tmp_path, f"http://127.0.0.1:{port}")
    proc = subprocess.Popen([sys.executable, "-m", "servekit.probe", "register", "--config", str(path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert proc.poll() is None, "register gave up while the server was still starting"
        fake = FakeManagement(port)  # the server comes up on the configured port
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            fake.close()
        assert proc.returncode == 0, err
        assert [c[0] for c in fake.calls] == ["POST", "PUT"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_register_reports_failures_without_traceback(api, tmp_path):
    api.fail_register = (500, "Failed to load model")
    proc = probe("register", "--config", str(config(tmp_path, api.url)))
    assert proc.returncode == 1 and "registering minilm.mar as minilm failed (500)" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = probe("register", "--config", str(config(tmp_path, api.url, {"m": {"1.0": {"batchSize": 1}}})))
    assert proc.returncode == 1 and "needs marName" in proc.stderr
    proc = probe("register", "--config", str(config(tmp_path, f"http://127.0.0.1:{free_port()}")),
                 "--deadline", "1")
    assert proc.returncode == 1 and "did not answer within 1s" in proc.stderr
    (tmp_path / "empty.properties").write_text("inference_address=http://0.0.0.0:8080\n")
    proc = probe("register", "--config", str(tmp_path / "empty.properties"))
    assert proc.returncode == 1 and "no `models` line" in proc.stderr
