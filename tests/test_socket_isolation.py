"""Two TorchServes on one machine at once: each keeps its own worker sockets and pid file.

TorchServe numbers every server's worker ports from 9000 and puts the socket at
`$TEMP/.ts.sock.<port>`; a starting worker deletes any socket file of its name. Both servers'
first workers below get port 9000, so only their private temp folders keep them apart. Were the
folders shared, a worker starting between the other server's worker binding its socket and that
server's frontend connecting to it would take the socket over, and that frontend would send its
requests to the wrong model. The race depends on timing, so the socket locations are what the
first test asserts; the second checks that both servers keep answering with their own models.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import requests

from servekit.archive import build_archive
from servekit.benchmarks.bench.archives import BENCH_SPECS
from servekit.torchserve import ServerError, TorchServe, check_socket_dir, group_alive

pytestmark = pytest.mark.server


def worker_sockets(ts: TorchServe) -> list[Path]:
    """The `--sock-name` of every live worker process of `ts` (its process group)."""
    sockets = []
    for pid in group_alive(ts.proc.pid):
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if "--sock-name" in cmd:
            sockets.append(Path(cmd[cmd.index("--sock-name") + 1]))
    return sockets


@pytest.fixture(scope="module")
def two_servers(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TorchServe, TorchServe]]:
    """An embedding server (minilm) and a sleep-handler server, started and registered concurrently."""
    sleep_store = tmp_path_factory.mktemp("sleep_store")
    build_archive("sleep", sleep_store, compress=False, spec=BENCH_SPECS["sleep"])
    embed = TorchServe(tmp_path_factory.mktemp("embed_run"), model_store)
    sleep = TorchServe(tmp_path_factory.mktemp("sleep_run"), sleep_store)
    jobs = ((embed, "minilm.mar", "minilm"), (sleep, "sleep.mar", "sleep"))
    try:
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(lambda ts=ts, mar=mar, name=name: ts.start().register(mar, name, workers=1))
                            for ts, mar, name in jobs]:
                started.result()
        yield embed, sleep
    finally:
        embed.stop()
        sleep.stop()


def test_each_server_keeps_its_worker_socket_in_its_own_temp(two_servers: tuple[TorchServe, TorchServe]) -> None:
    embed, sleep = two_servers
    (embed_socket,) = worker_sockets(embed)
    (sleep_socket,) = worker_sockets(sleep)
    assert embed_socket.name == sleep_socket.name == ".ts.sock.9000"  # the same name: only the folder differs
    assert embed_socket.parent == embed.temp_dir and embed_socket.is_socket()
    assert sleep_socket.parent == sleep.temp_dir and sleep_socket.is_socket()
    # Each launcher's pid file names its own frontend (a shared one stops a second server starting).
    for ts in two_servers:
        frontend = int((ts.temp_dir / ".model_server.pid").read_text())
        assert frontend in group_alive(ts.proc.pid)


def test_each_server_answers_with_its_own_model(two_servers: tuple[TorchServe, TorchServe]) -> None:
    embed, sleep = two_servers
    for _ in range(3):  # interleaved: a replaced socket would send one server's request to the other's worker
        r = requests.post(f"{embed.inference_url}/predictions/minilm", json={"text": "hello world"}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["embeddings"][0]) == 384
        r = requests.post(f"{sleep.inference_url}/predictions/sleep", json={"sleep_ms": 3}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json() == {"slept_ms": 3.0, "batch": 1}
    # Neither server knows the other's model.
    assert requests.post(f"{embed.inference_url}/predictions/sleep", json={}, timeout=60).status_code == 404
    assert requests.post(f"{sleep.inference_url}/predictions/minilm", json={}, timeout=60).status_code == 404


def test_a_run_folder_too_deep_for_a_socket_is_refused_by_name(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ServerError, match=r"too deep for TorchServe's worker sockets: .*\.ts\.sock\..*--run-dir"):
        check_socket_dir(deep)
    check_socket_dir(tmp_path)  # pytest's own folders are well inside the limit
