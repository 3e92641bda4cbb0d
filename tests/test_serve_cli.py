"""`servekit serve` as a user runs it: TorchServe in the foreground with the shipped config (ports
changed), the models of --models loaded at start; it says when each model is ready, after sending
the frontend its first inference request; SIGTERM (as Ctrl-C) stops everything."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from servekit.serve import model_names
from servekit.torchserve import free_ports

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent


def test_model_names_of_torchserves_models_syntax() -> None:
    assert model_names("minilm=minilm.mar") == ["minilm"]
    assert model_names("a=x.mar,b=/store/y.mar c.mar") == ["a", "b", "c"]
    assert model_names("all") == []


def test_serve_announces_each_model_ready_after_warming_its_inference_path(model_store: Path, tmp_path: Path) -> None:
    ports = dict(zip(("8080", "8081", "8082", "7070", "7071"), map(str, free_ports(5))))
    config = (ROOT / "config" / "config.properties").read_text()
    config = re.sub(r"(127\.0\.0\.1:|_port=)(8080|8081|8082|7070|7071)\b", lambda m: m.group(1) + ports[m.group(2)],
                    config)
    (tmp_path / "config.properties").write_text(config)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "servekit", "serve", "--models", "minilm=minilm.mar", "--model-store",
                             str(model_store), "--config", str(tmp_path / "config.properties"), "--run-dir", str(run)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("minilm:"):
                break
        assert lines and lines[-1].startswith("minilm: ready after"), "".join(lines)
        # TorchServe's frontend and worker run in a session of their own: what must not outlive serve.
        assert [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
        assert "inference path warmed: 1.0 200" in lines[-1]
        assert f"inference http://127.0.0.1:{ports['8080']}" in "".join(lines)
        access = (run / "logs" / "access_log.log").read_text()
        assert '"POST /predictions/minilm/1.0/v1/models HTTP/1.1" 200' in access
        # A second server on the same ports: a clear error naming them, nothing left running
        second = tmp_path / "second"
        taken = subprocess.run([sys.executable, "-m", "servekit", "serve", "--models", "minilm=minilm.mar",
                                "--model-store", str(model_store), "--config", str(tmp_path / "config.properties"),
                                "--run-dir", str(second)], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert taken.returncode == 1 and "Traceback" not in taken.stderr, taken.stderr
        assert f"is in use (inference {ports['8080']}, management {ports['8081']}" in taken.stderr
        assert not [p for p in psutil.process_iter(["cmdline"]) if str(second) in " ".join(p.info["cmdline"] or [])]
    finally:
        proc.send_signal(signal.SIGTERM)  # as a service manager stops it; Ctrl-C takes the same path
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    assert [p.pid for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])] == []


def test_serve_without_a_model_store_says_so_without_a_traceback(tmp_path: Path) -> None:
    got = subprocess.run([sys.executable, "-m", "servekit", "serve", "--model-store", str(tmp_path / "nowhere"),
                          "--run-dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert got.returncode == 1 and "Traceback" not in got.stderr, got.stderr
    assert f"model store {tmp_path / 'nowhere'} does not exist; run `servekit archive` first" in got.stderr
