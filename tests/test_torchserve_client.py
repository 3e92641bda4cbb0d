"""The one management-API client (servekit.torchserve.ManagementClient) against a real TorchServe:
what a taken model name does, the model-config precedence, scaling to exactly N workers."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from servekit.archive import build_archive
from servekit.benchmarks.bench.archives import BENCH_SPECS
from servekit.handlers.common import WARM_UP_HEADER
from servekit.torchserve import (ManagementClient, Ports, PortTaken, Registration, ServerError, TorchServe, free_ports,
                                 group_alive)

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def sleep_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two archives of the sleep test handler (no model weights: seconds to build and load):
    `sleep.mar` as shipped, `sleep2.mar` whose model-config asks for 2 workers and batch 4."""
    store = tmp_path_factory.mktemp("client_store")
    spec = BENCH_SPECS["sleep"]
    build_archive("sleep", store, compress=False, spec=spec)
    cfg = yaml.safe_load(spec.config.read_text())
    cfg.update({"minWorkers": 2, "maxWorkers": 2, "batchSize": 4, "maxBatchDelay": 7})
    path = store.parent / "sleep2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    build_archive("sleep", store, config=path, archive_name="sleep2", compress=False, spec=spec)
    return store


@pytest.fixture(scope="module")
def server(sleep_store: Path, tmp_path_factory: pytest.TempPathFactory):
    with TorchServe(tmp_path_factory.mktemp("client_run"), sleep_store) as ts:
        yield ts


def states(api: ManagementClient, model: str) -> list[str]:
    return sorted(w["status"] for w in api.workers(model))


def test_a_taken_name_errors_is_kept_or_is_replaced_as_asked(server: TorchServe) -> None:
    api = server.api
    api.register(Registration("sleep.mar", "s1", batch_size=2, max_batch_delay_ms=3), timeout=120)
    with pytest.raises(ServerError, match=r"registering sleep.mar as s1 failed \(409\)"):
        api.register(Registration("sleep.mar", "s1"), timeout=120)
    api.register(Registration("sleep.mar", "s1", batch_size=2, max_batch_delay_ms=3), if_exists="keep", timeout=120)
    assert states(api, "s1") == ["READY"]
    api.register(Registration("sleep.mar", "s1", batch_size=8, max_batch_delay_ms=9), if_exists="replace",
                 timeout=120)
    (described,) = api.describe("s1")
    assert (described["batchSize"], described["maxBatchDelay"]) == (8, 9)
    api.unregister("s1")
    assert api.describe("s1") is None
    api.unregister("s1")  # unknown: nothing to do, no error
    with pytest.raises(ValueError, match="if_exists"):
        api.register(Registration("sleep.mar", "s1"), if_exists="overwrite")


def test_the_asked_settings_are_the_served_ones(server: TorchServe) -> None:
    """The archive asks for 2 workers and batch 4 / 7 ms: the call's batch settings win (TorchServe
    0.12), the archive's worker count would win over initial_workers, so register() sets it; and a
    mismatch between what is asked and what is served is an error naming the model-config."""
    api = server.api
    api.register(Registration("sleep2.mar", "s2", workers=1, batch_size=3, max_batch_delay_ms=11), timeout=120)
    (described,) = api.describe("s2")
    assert (described["batchSize"], described["maxBatchDelay"]) == (3, 11)
    assert states(api, "s2") == ["READY"]  # one worker, as asked, not the archive's two
    with pytest.raises(ServerError, match=r"asked for batchSize=5 but TorchServe serves batchSize=3.*model-config"):
        api.check_settings(Registration("sleep2.mar", "s2", batch_size=5))
    api.scale("s2", 2, timeout=120)
    assert states(api, "s2") == ["READY", "READY"]
    api.scale("s2", 1, timeout=120)  # returns once the extra worker is gone
    assert states(api, "s2") == ["READY"]
    api.unregister("s2")



def test_a_script_stopped_by_sigterm_stops_its_server_and_runs_its_finally_blocks(sleep_store: Path,
                                                                                    tmp_path: Path) -> None:
    """`timeout` and CI limits stop a script with SIGTERM. TorchServe runs in a session of its own, so a
    script killed outright would leave it running: once a TorchServe has started, SIGTERM is an
    exit through the script's `with` and `finally` blocks (exit code 143), and the server is gone."""
    script = (f"import pathlib, time\nfrom servekit.torchserve import TorchServe\n"
              f"with TorchServe(pathlib.Path({str(tmp_path / 'run')!r}), pathlib.Path({str(sleep_store)!r})) as ts:\n"
              f"    try:\n        print(ts.proc.pid, flush=True)\n        time.sleep(120)\n"
              f"    finally:\n        print('finally', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        group = int(proc.stdout.readline())
        assert group_alive(group)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out.strip() == "finally" and proc.returncode == 143
    assert not group_alive(group)

    # A handler the script set itself is kept.
    own = ("import signal, time\nfrom servekit.torchserve import stop_on_sigterm\n"
           "signal.signal(signal.SIGTERM, lambda *_: print('own', flush=True))\nstop_on_sigterm()\n"
           "print('ready', flush=True)\ntime.sleep(1)\n")
    proc = subprocess.Popen([sys.executable, "-c", own], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "own" and proc.returncode == 0

def test_wait_ready_names_the_worker_states_on_timeout(server: TorchServe) -> None:
    api = server.api
    api.register(Registration("sleep.mar", "s3"), wait=False)
    with pytest.raises(ServerError, match=r"s3: 5 READY worker\(s\) not reached within 0s \(workers: "):
        api.wait_ready("s3", workers=5, timeout=0)
    api.unregister("s3")
    with pytest.raises(ServerError, match="unreachable"):
        ManagementClient("http://127.0.0.1:9").describe("s3")


class _Healthy(BaseHTTPRequestHandler):
    """Another server: answers every GET as TorchServe's /ping does."""

    def do_GET(self) -> None:
        body = json.dumps({"status": "Healthy"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[int]:
    """A port that another HTTP server holds and answers /ping on."""
    other = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    yield other.server_address[1]
    other.shutdown()
    other.server_close()


def test_another_server_answering_on_a_chosen_port_is_not_taken_for_this_one(other_server: int,
                                                                              tmp_path: Path) -> None:
    """Ports given to the harness, one of them held by another server that answers /ping: start()
    does not take that answer for its own frontend; it fails naming the port taken."""
    store = tmp_path / "store"
    store.mkdir()
    ts = TorchServe(tmp_path / "run", store, ports=Ports(other_server, *free_ports(4)))
    with pytest.raises(PortTaken, match="Address already in use"):
        ts.start(timeout=60)
    assert ts.proc is None


def test_picked_ports_taken_before_the_server_binds_them_are_picked_again(other_server: int, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """A free port the harness picked is taken by another server before TorchServe binds it (a
    server starting beside it, as parallel tests do): the start goes on with other ports."""
    picks = iter([Ports(other_server, *free_ports(4))])
    real = Ports.free
    monkeypatch.setattr(Ports, "free", classmethod(lambda cls: next(picks, None) or real()))
    store = tmp_path / "store"
    store.mkdir()
    with TorchServe(tmp_path / "run", store) as ts:
        assert ts.ports.inference != other_server
        assert ManagementClient(ts.management_url).describe("absent") is None  # its own API answers
    assert "Address already in use" in (tmp_path / "run" / "logs" / "server.out").read_text()


def _meeting_server(streams: int) -> ThreadingHTTPServer:
    """An HTTP server whose POSTs answer 200 only once ``streams`` of them are in flight together
    (each waits for the others up to 2 s, else 503), recording each body and warm-up header."""

    class Meeting(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.seen.append((body, self.headers.get(WARM_UP_HEADER)))
            try:
                server.barrier.wait(timeout=2)
                status = 200
            except threading.BrokenBarrierError:
                status = 503
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Meeting)
    server.barrier, server.seen = threading.Barrier(streams), []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("streams, meet", [(4, 4), (4, 5)])
def test_a_warm_up_burst_sends_its_chats_at_once(streams: int, meet: int) -> None:
    """The LLM warm-up's burst (servekit.torchserve._chat_burst): ``streams`` streamed chats of
    distinct prompts in flight together, marked as the warm-up's; a server that needs one more
    in flight than were sent never answers them all 200, and the burst says so."""
    from servekit.torchserve import WARM_UP_BURST_TOKENS, _chat_burst

    server = _meeting_server(meet)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/predictions/m/1.0/v1/chat/completions"
        ok = _chat_burst(url, {"Content-Type": "application/json", WARM_UP_HEADER: "1"}, streams, timeout=20)
    finally:
        server.shutdown()
        server.server_close()
    assert ok is (streams >= meet)
    assert len(server.seen) == streams and all(marked == "1" for _, marked in server.seen)
    bodies = [body for body, _ in server.seen]
    assert all(b["stream"] is True and b["max_tokens"] == WARM_UP_BURST_TOKENS for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == streams
