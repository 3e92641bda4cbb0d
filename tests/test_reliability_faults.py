"""Faults on a TorchServe of its own: out of memory in inference, a killed worker, a restart.

The archive is test-only (`servekit.benchmarks.faults.build_faulty_archive`): the production handler whose
inference raises torch.OutOfMemoryError for a batch holding a marker word, with `too_long: reject`
and small buckets so that a worker (re)starts quickly on CPU. Nothing of it is in the production handler.
The LLM's worker death under continuous batching is tried on the same server, with SmolLM2's CPU plan.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
import yaml

from servekit.benchmarks.faults import (OOM_MARKER, build_faulty_archive, check_with_good, faulty_cases,
                               kill_worker_under_load, oom_isolation, reference_embedder, restart_from_store,
                               worker_identity)
from servekit.torchserve import TorchServe

pytestmark = pytest.mark.server
MODEL = "minilm_faulty"
BUCKETS = {"batch_sizes": [1, 2, 4, 8], "seq_lens": [16, 32, 64, 128]}


@pytest.fixture(scope="module")
def reference():
    return reference_embedder()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory):
    """{'ts': the running server}; the restart test replaces it, teardown stops whichever runs."""
    tmp = tmp_path_factory.mktemp("faults")
    store = tmp / "store"
    build_faulty_archive(store, tmp / "build", BUCKETS, MODEL)
    holder = {"ts": TorchServe(tmp / "run", store).start(), "tmp": tmp}
    try:
        holder["ts"].register(f"{MODEL}.mar", MODEL)
        yield holder
    finally:
        holder["ts"].stop()


def test_out_of_memory_fails_alone_and_the_worker_stays(faulty, reference):
    ts = faulty["ts"]
    r = oom_isolation(ts, MODEL, reference, rounds=2)
    assert r["marker_statuses"] == [507, 507], r
    assert r["marker_messages"] and all("out of memory" in m for m in r["marker_messages"]), r
    assert r["valid_lost"] == 0, r
    assert r["worker_same"], r
    assert r["passed"], r


def test_marker_alone_gets_507_json(faulty):
    ts = faulty["ts"]
    r = requests.post(f"{ts.inference_url}/predictions/{MODEL}", json={"text": f"x {OOM_MARKER}"}, timeout=60)
    assert r.status_code == 507
    assert r.json()["error"]["code"] == "out_of_memory"


def test_text_over_the_largest_bucket_is_rejected_with_413(faulty, reference):
    ts = faulty["ts"]
    case = faulty_cases(BUCKETS["seq_lens"][-1])[0]
    r = check_with_good(ts, MODEL, case, reference)
    assert r["status"] == 413 and r["names_problem"], r
    assert r["good_statuses"] == [200, 200, 200] and r["good_correct"], r
    assert r["worker_same"], r


def test_killed_worker_is_replaced_and_only_in_flight_requests_fail(faulty):
    ts = faulty["ts"]
    r = kill_worker_under_load(ts, MODEL, concurrency=4, before_s=2.0, after_s=1.0, timeout=180,
                               client_timeout=20.0)
    assert r["worker_ready_s"] is not None and r["recovery_s"] is not None, r
    assert r["worker_after"] and r["worker_after"][0][1] != r["worker_before"][0][1], r
    # Closed-loop clients have at most one request each in flight: those in the dead worker's batch
    # get TorchServe's 507 "Worker died."; those it was assembling into a batch get no answer (a
    # TorchServe 0.12 bug, hence the client timeout); the queued ones wait for the new worker.
    assert r["failed_in_flight_at_kill"] <= 4, r
    assert r["failed_sent_after_ready"] == 0, r
    assert set(r["failed_statuses"]) <= {"500", "503", "507", "no_answer"}, r
    assert r["requests"] > r["failed"], r


def _raw_exchange(port: int, path: str, body: dict, out: dict, chunks_seen: threading.Event) -> None:
    """One HTTP/1.1 POST on a socket of its own, recording exactly what came back and how the
    connection ended (client libraries hide a chunked body cut short). `chunks_seen` is set once two
    server-sent events have arrived."""
    data = json.dumps(body).encode()
    got, length = b"", None
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout) as e:
                out["end"] = type(e).__name__
                break
            if not chunk:
                out["end"] = "closed"
                break
            got += chunk
            head, sep, rest = got.partition(b"\r\n\r\n")
            if sep and length is None:
                length = next((int(v) for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
                               if k.strip().lower() == b"content-length"), -1)
            if rest.count(b"data: ") >= 2:
                chunks_seen.set()
            if sep and ((length >= 0 and len(rest) >= length) or (length < 0 and rest.endswith(b"0\r\n\r\n"))):
                out["end"] = "complete"
                break
    out["ended_at"] = time.monotonic()
    head, _, out["body"] = got.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    out["status"] = int(lines[0].split()[1]) if lines[0].startswith("HTTP/1.1") else None
    out["headers"] = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}


LLM_PATH = "/predictions/smollm2_death/1.0/v1/chat/completions"


@pytest.fixture(scope="module")
def llm_on_faulty(faulty, tmp_path_factory):
    """SmolLM2 with its CPU plan (continuous batching, a small context) registered beside the
    embedding model; the name it is served under."""
    from servekit.archive import LLM, SPECS, ArchiveSpec, build_archive
    from servekit.optimizations.models.gguf_weights import smollm2_archive_files
    from servekit.resources import model_config

    ts = faulty["ts"]
    work = tmp_path_factory.mktemp("llm-faults")
    cfg = yaml.safe_load(model_config("smollm2-cpu").read_text())
    assert cfg["continuousBatching"] is True
    cfg["servekit"].update({"max_seq_len": 256, "limits": {"max_tokens": 200, "default_max_tokens": 16},
                            "buckets": {"batch_sizes": [1, 2, 4], "prompt_lens": [32, 64], "kv_lens": [256]}})
    (work / "llm.yaml").write_text(yaml.safe_dump(cfg))
    spec = ArchiveSpec(LLM, SPECS["smollm2"].handler, work / "llm.yaml", lambda: smollm2_archive_files(torch.bfloat16))
    build_archive("smollm2", ts.model_store, archive_name="smollm2_death", compress=False, spec=spec)
    ts.register("smollm2_death.mar", "smollm2_death", timeout=300)
    yield "smollm2_death"
    if faulty["ts"] is ts:  # not stopped by the restart test
        ts.unregister("smollm2_death")


@pytest.mark.parametrize("ctype", ["application/json", "text/plain"])
def test_llm_duplicate_keys_get_a_400_naming_the_key(faulty, llm_on_faulty, ctype):
    """The LLM worker too gets bodies unparsed: a duplicate key is refused, not resolved to its last value."""
    url = faulty["ts"].inference_url + LLM_PATH
    dup = b'{"messages": [{"role": "user", "content": "Hi: there", "role": "system"}], "max_tokens": 2}'
    r = requests.post(url, data=dup, headers={"Content-Type": ctype}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_key", r.text[:300]
    assert "duplicate key 'role'" in r.json()["error"]["message"]
    ok = b'{"messages": [{"role": "user", "content": "Time: 10:30"}], "max_tokens": 2}'
    assert requests.post(url, data=ok, headers={"Content-Type": ctype}, timeout=120).status_code == 200


@contextlib.contextmanager
def _gateway(upstream: str) -> Iterator[int]:
    """`servekit gateway` in front of `upstream` on a free loopback port; yields the port."""
    proc = subprocess.Popen([sys.executable, "-m", "servekit.cli", "gateway", "--upstream", upstream, "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert m, line
        yield int(m.group(1))
    finally:
        proc.terminate()
        proc.wait(30)


def test_llm_worker_death_under_continuous_batching_is_visible_to_clients(faulty, llm_on_faulty):
    """A streamed and a non-streamed chat completion are generating when the worker is killed, and a
    second stream through `servekit gateway`. Neither may look like a whole answer, nor hang: the direct
    stream stops without `data: [DONE]` (its 200 head went out with the first chunk) and the connection
    ends; the gateway's stream ends properly with a final `worker_died` error event and no
    `ts_stream_next` header; the non-streamed one, whose head the handler holds back until it finishes
    (see docs/reliability.md), gets TorchServe's 5xx JSON. The new worker answers the retries."""
    ts = faulty["ts"]
    path = LLM_PATH
    chat = {"messages": [{"role": "user", "content": "Write a long story about a sailor and the sea."}],
            "max_tokens": 200, "temperature": 0}
    answers = {"stream": {}, "gateway": {}, "whole": {}}
    seen = {k: threading.Event() for k in answers}
    with _gateway(ts.inference_url) as gateway_port:
        ports = {"stream": ts.ports.inference, "gateway": gateway_port, "whole": ts.ports.inference}
        bodies = {"stream": {**chat, "stream": True}, "gateway": {**chat, "stream": True}, "whole": chat}
        threads = [threading.Thread(target=_raw_exchange, args=(ports[k], path, bodies[k], answers[k], seen[k]))
                   for k in answers]
        for t in threads:
            t.start()
        # Sent together, so generating together: two events of each stream mean all three are running.
        assert seen["stream"].wait(120) and seen["gateway"].wait(60), answers
        pid = ts.api.workers(llm_on_faulty)[0]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(90)
        stream, via, whole = answers["stream"], answers["gateway"], answers["whole"]
        assert stream["status"] == 200 and stream["headers"]["content-type"] == "text/event-stream", stream
        assert b"data: {" in stream["body"] and b"data: [DONE]" not in stream["body"], stream
        assert stream["end"] != "complete" and stream["ended_at"] - killed < 30, stream
        assert "ts_stream_next" in stream["headers"], stream  # TorchServe's own flag, which the gateway drops
        assert via["status"] == 200 and via["headers"]["content-type"] == "text/event-stream", via
        assert "ts_stream_next" not in via["headers"], via
        assert via["end"] == "complete" and via["ended_at"] - killed < 30, via
        assert via["body"].count(b"data: {") >= 3 and b"data: [DONE]" not in via["body"], via
        # The last event, written as one chunk right before the terminating one, is the error.
        last, _, rest = via["body"].rpartition(b"data: ")[2].partition(b"\n\n")
        assert rest == b"\r\n0\r\n\r\n", via
        error = json.loads(last)["error"]
        assert (error["code"], error["type"]) == ("worker_died", "server_error"), error
        assert whole["status"] >= 500 and b"Worker died" in whole["body"], whole
        assert "ts_stream_next" not in whole["headers"], whole
        assert whole["ended_at"] - killed < 30, whole
        deadline = time.monotonic() + 300  # the frontend reports the dead worker READY for a moment
        while not any(w.get("pid") not in (None, pid) and w.get("status") == "READY"
                      for w in ts.api.workers(llm_on_faulty)):
            assert time.monotonic() < deadline, ts.api.workers(llm_on_faulty)
            time.sleep(0.5)
        r = requests.post(ts.inference_url + path, json={**chat, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text[:300]
        # Answered once finished, as one plain response: never a chunk marked for a stream.
        assert "content-length" in r.headers and "ts_stream_next" not in r.headers, r.headers
        # A stream that ends well passes the gateway whole.
        r = requests.post(f"http://127.0.0.1:{gateway_port}{path}", json={**chat, "max_tokens": 4, "stream": True},
                          timeout=120)
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n"), r.content[-300:]
        assert b'"error"' not in r.content and "ts_stream_next" not in r.headers, r.headers


def test_restart_loads_models_from_the_store(faulty, reference):
    ts = faulty["ts"]
    new, r = restart_from_store(ts, {MODEL: f"{MODEL}.mar"}, Path(faulty["tmp"]) / "run2", reference)
    faulty["ts"] = new
    assert r["passed"], r
    assert worker_identity(new, MODEL), "no worker after restart"
    # The plan and batch settings came from the archive's model-config, not from a register call.
    desc = requests.get(f"{new.management_url}/models/{MODEL}", timeout=10).json()[0]
    assert desc["batchSize"] == 8 and desc["maxBatchDelay"] == 50
