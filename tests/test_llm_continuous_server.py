"""Live TorchServe with a SmolLM2 archive under continuous batching (`continuousBatching: true`, CPU
plan with speculative decoding, heads trained by conftest's fixture): requests join the running
generation, each gets its solo greedy text (speculating or not), a short request is not stuck behind
a long one, a client that goes away frees its slot, bad requests get their own 4xx, acceptance is
reported.

The archives hold conftest's `tiny_smollm2` (SmolLM2's tokenizer and chat template, a tiny random
model): these are the engine's and the protocol's behaviours, not SmolLM2's answers. A step of the
tiny model costs a few ms where SmolLM2-135M's cost tens, so the plan's context is longer here: the
long requests that the timing checks race against still outlast the short ones many times over."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch
import yaml

from servekit.archive import LLM, SPECS, ArchiveSpec, build_archive
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.models.llama import load_llama
from servekit.resources import model_config
from servekit.torchserve import TorchServe

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.server

BATCH = 4
CONTEXT = 4096  # the plan's max_seq_len (SmolLM2's CPU plan: 1024)
LONG = 3500  # max_tokens of a long request: seconds of decoding even for the tiny model


def cb_config(batch: int) -> dict:
    """SmolLM2's CPU plan with continuous batching over `batch` requests and room for LONG tokens."""
    config = yaml.safe_load(model_config("smollm2-cpu").read_text())
    config.update({"continuousBatching": True, "batchSize": batch, "maxBatchDelay": 1})
    config["servekit"]["max_seq_len"] = CONTEXT
    config["servekit"]["buckets"]["kv_lens"] = [256, 512, 1024, 2048, CONTEXT]
    config["servekit"]["limits"]["max_tokens"] = LONG
    return config


@pytest.fixture(scope="module")
def server(tiny_smollm2: list[Path], tiny_smollm2_heads: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    tmp = tmp_path_factory.mktemp("llm-cb")
    config = cb_config(BATCH)
    # Up to 2 running requests speculate; with 3 or 4 the batch decodes with plain steps.
    config["servekit"]["speculation"] = {"heads": "speculator", "n_heads": 3, "max_batch": 2}
    (tmp / "cb.yaml").write_text(yaml.safe_dump(config))
    spec = ArchiveSpec(LLM, SPECS["smollm2"].handler, tmp / "cb.yaml", lambda: tiny_smollm2)
    build_archive("smollm2", tmp / "store", compress=False, spec=spec, speculator=tiny_smollm2_heads)
    with TorchServe(tmp / "ts", tmp / "store") as ts:
        ts.register("smollm2.mar", "smollm2", batch_size=BATCH, max_batch_delay_ms=1, workers=1, timeout=240)
        yield ts


@pytest.fixture(scope="module")
def reference(tiny_smollm2: list[Path]):
    weights = tiny_smollm2[0].parent
    tok = ChatTokenizer(weights)
    runner = LlamaRunner(load_llama(weights, "cpu", torch.float32), max_seq_len=1024, batch_buckets=(1,),
                         prefill_buckets=(32, 64, 128, 256, 512, 1024), kv_buckets=(256, 512, 1024))
    stops = (tok.eos_token_id, tok.token_id("<|endoftext|>"))

    def complete(messages: list[dict], max_tokens: int) -> str:
        out = generate(runner, [tok.encode_chat(messages)],
                       [SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)])[0]
        return tok.decode(out.tokens[:-1] if out.finish_reason == "stop" else out.tokens)

    return complete


@pytest.fixture(scope="module")
def client(server: TorchServe):
    return openai.OpenAI(base_url=f"{server.inference_url}/predictions/smollm2/1.0/v1", api_key="unused",
                         max_retries=0, timeout=300)


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_concurrent_requests_joining_at_different_times_get_their_solo_texts(client, reference) -> None:
    cases = [("Write a short poem about rivers.", 48, True), ("What is 2 + 2?", 12, False),
             ("Name the planets of the solar system.", 40, True), ("Say hello.", 6, False),
             ("List three colors.", 20, True), ("Why is the sky blue?", 30, False)]
    results: dict[int, str] = {}

    def one(i: int, text: str, n: int, stream: bool) -> None:
        time.sleep(0.3 * i)  # arrivals spread over the others' generation
        kw = dict(model="smollm2", messages=_msgs(text), max_tokens=n, temperature=0)
        if stream:
            results[i] = "".join(c.choices[0].delta.content or "" for c in
                                 client.chat.completions.create(stream=True, **kw) if c.choices)
        else:
            results[i] = client.chat.completions.create(**kw).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results.get(i) for i in range(len(cases))] == [reference(_msgs(t), n) for t, n, _ in cases]


def test_a_short_request_is_not_stuck_behind_a_long_one(client) -> None:
    """Static batching answered the short request after the long one ended; continuous batching
    admits it at the next decode step. The long one is still decoding a second after the short one
    ended, and is then dropped by its client (a disconnect frees its slot), not waited for."""
    long_done: list[float] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def long() -> None:
        with client.chat.completions.create(model="smollm2", messages=_msgs("Tell a long story about a dragon."),
                                            max_tokens=LONG, temperature=0, stream=True) as stream:
            for _ in stream:
                if stop.is_set():
                    return
        long_done.append(time.perf_counter() - t0)

    thread = threading.Thread(target=long)
    thread.start()
    time.sleep(2.0)  # the long one is decoding
    t1 = time.perf_counter()
    first = None
    for c in client.chat.completions.create(model="smollm2", messages=_msgs("Say hi."), max_tokens=4, temperature=0,
                                            stream=True):
        if first is None and c.choices and c.choices[0].delta.content:
            first = time.perf_counter() - t1
    time.sleep(1.0)
    still_decoding = not long_done  # the short one ended at least a second before the long one
    stop.set()
    thread.join(300)
    assert first is not None and still_decoding
    assert first < 2.0, f"first token after {first:.2f} s"


def _raw_stream(server: TorchServe, text: str, max_tokens: int) -> socket.socket:
    body = json.dumps({"messages": _msgs(text), "max_tokens": max_tokens, "temperature": 0, "stream": True})
    host, port = server.inference_url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall((f"POST /predictions/smollm2/1.0/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    return s


def _metric(server: TorchServe, name: str) -> float:
    text = urllib.request.urlopen(f"{server.metrics_url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_client_that_disconnects_frees_its_slot(server: TorchServe, client) -> None:
    """BATCH streams of LONG tokens fill every slot; their clients go away after a few chunks. A
    request sent afterwards is answered at once instead of after LONG more tokens of each."""
    socks = [_raw_stream(server, f"Count from 1 to 1000, stream {i}.", LONG) for i in range(BATCH)]
    for s in socks:
        got = b""
        while got.count(b"data: ") < 3:
            got += s.recv(4096)
    for s in socks:
        s.close()
    t0 = time.perf_counter()
    r = client.chat.completions.create(model="smollm2", messages=_msgs("Say hi."), max_tokens=4, temperature=0)
    took = time.perf_counter() - t0
    assert r.choices[0].message.content
    # LONG steps of 4 rows take 7 s or more even for the tiny model; freed slots: under a second.
    assert took < 4.0, f"took {took:.1f} s"
    deadline = time.monotonic() + 15
    while _metric(server, "servekit_llm_running_seqs") != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(server, "servekit_llm_running_seqs") == 0


def test_bad_requests_logprobs_and_n_under_continuous_batching(server: TorchServe, client) -> None:
    req = urllib.request.Request(f"{server.inference_url}/predictions/smollm2/1.0/v1/chat/completions",
                                 data=json.dumps({"messages": _msgs("hi"), "temperature": 3}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and "'temperature' must be in" in json.loads(e.value.read())["error"]["message"]
    r = client.chat.completions.create(model="smollm2", messages=_msgs("Name a fruit."), max_tokens=6,
                                       temperature=1.0, seed=3, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert b"".join(bytes(t.bytes) for t in c.logprobs.content).decode() == c.message.content
    alone = client.chat.completions.create(model="smollm2", messages=_msgs("Name a fruit."), max_tokens=6,
                                           temperature=1.0, seed=4)
    assert alone.choices[0].message.content == r.choices[1].message.content  # choice k: seed + k
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_speculation_in_the_running_batch_is_exact_and_reports_acceptance(server: TorchServe, client,
                                                                          reference) -> None:
    """A lone greedy stream speculates (several tokens per step, the heads' prompt): its text is
    the plain greedy text, and the acceptance counters grow as a verify step's would."""
    msgs = _msgs("Count to three.")  # a prompt the fixture's heads trained on
    proposed = _metric(server, "servekit_spec_proposed_total")
    accepted = _metric(server, "servekit_spec_accepted_total")
    text = "".join(c.choices[0].delta.content or "" for c in
                   client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=32, temperature=0,
                                                  stream=True) if c.choices)
    assert text == reference(msgs, 32)
    deadline = time.monotonic() + 15
    while _metric(server, "servekit_spec_proposed_total") == proposed and time.monotonic() < deadline:
        time.sleep(0.3)
    new_proposed = _metric(server, "servekit_spec_proposed_total") - proposed
    new_accepted = _metric(server, "servekit_spec_accepted_total") - accepted
    assert new_proposed > 0 and new_accepted > 0, (new_proposed, new_accepted)
    assert new_accepted <= new_proposed


@pytest.fixture(scope="module")
def full_server(tiny_smollm2: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    """One request running at a time (batchSize 1) and TorchServe's queue holding 2 more."""
    tmp = tmp_path_factory.mktemp("llm-cb-full")
    (tmp / "cb.yaml").write_text(yaml.safe_dump(cb_config(1)))
    spec = ArchiveSpec(LLM, SPECS["smollm2"].handler, tmp / "cb.yaml", lambda: tiny_smollm2)
    build_archive("smollm2", tmp / "store", compress=False, spec=spec)
    with TorchServe(tmp / "ts", tmp / "store", extra_props={"job_queue_size": "2"}) as ts:
        ts.register("smollm2.mar", "smollm2", batch_size=1, max_batch_delay_ms=1, workers=1, timeout=240)
        yield ts


def _set_workers(server: TorchServe, n: int) -> None:
    """The management API's own scaling, as a user's curl sends it (servekit's client refuses n > 1)."""
    req = urllib.request.Request(f"{server.management_url}/models/smollm2?min_worker={n}&max_worker={n}"
                                 "&synchronous=true", method="PUT")
    urllib.request.urlopen(req, timeout=240).read()
    server.api.wait_workers("smollm2", n, timeout=120)
    assert [w["status"] for w in server.api.workers("smollm2")] == ["READY"] * n


def test_a_second_worker_stalls_running_requests_so_servekit_refuses_it(server: TorchServe, client) -> None:
    """TorchServe 0.12 under continuous batching: an idle worker waits for the next request while
    holding the model's queue lock, which a busy worker needs before each next call of its handler
    (``handlers/common.py``, CONTINUOUS_ONE_WORKER). Scaled to two workers by hand, a lone streamed
    request stops after its first chunks while the other worker idles; servekit's client refuses
    the second worker before TorchServe sees it."""
    from servekit.torchserve import OneWorkerOnly

    with pytest.raises(OneWorkerOnly, match="serves one worker per model"):
        server.scale("smollm2", 2)
    assert [w["status"] for w in server.api.workers("smollm2")] == ["READY"]
    with pytest.raises(OneWorkerOnly, match="smollm2_two: 2 workers asked for"):  # registered, refused, removed
        server.register("smollm2.mar", "smollm2_two", batch_size=BATCH, max_batch_delay_ms=1, workers=2)
    assert server.api.describe("smollm2_two") is None

    _set_workers(server, 2)
    chunks, done = [], threading.Event()

    def lone() -> None:
        try:
            with client.with_options(timeout=30).chat.completions.create(
                    model="smollm2", messages=_msgs("Count to fifty."), max_tokens=40, stream=True,
                    extra_body={"ignore_eos": True}) as s:
                for c in s:  # each chunk as it comes
                    chunks.append(c)
            done.set()
        except Exception:  # the stalled stream times out, or ends when its worker is scaled away
            pass

    worker = threading.Thread(target=lone)
    try:
        worker.start()
        # 40 tokens of the tiny model take well under a second; here the answer waits.
        assert not done.wait(3.0), "the lone request finished: TorchServe no longer stalls it behind an idle worker"
        assert 0 < len(chunks) < 40  # its first chunks came, then nothing
    finally:
        _set_workers(server, 1)
        worker.join(60)
    r = client.chat.completions.create(model="smollm2", messages=_msgs("Name a fruit."), max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_a_full_server_answers_503_at_once_and_serves_what_it_queued(full_server: TorchServe) -> None:
    """A long stream holds the one running place; two requests then wait in TorchServe's queue and the
    next two find it full. The long one is streamed so that the test knows it runs before sending the
    others, and it must still be running when they are answered: otherwise the queue had room again."""
    url = f"{full_server.inference_url}/predictions/smollm2/1.0/v1/chat/completions"
    answers: dict[int, tuple[int, float, float, dict]] = {}

    def post(k: int) -> None:
        body = json.dumps({"messages": _msgs("Say hi."), "max_tokens": 4, "temperature": 0}).encode()
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}),
                                        timeout=300) as r:
                status, body = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            status, body = e.code, json.loads(e.read())
        answers[k] = (status, time.perf_counter() - t0, time.perf_counter(), body)

    s = _raw_stream(full_server, "Count from 1 to 1000.", LONG)
    got = b""
    while got.count(b"data: ") < 3:  # the long one runs
        got += s.recv(4096)
    threads = []
    for k in range(1, 5):  # 1 and 2 wait in the queue; 3 and 4 find it full
        threads.append(threading.Thread(target=post, args=(k,)))
        threads[-1].start()
        time.sleep(0.15)
    for t in threads[2:]:
        t.join(60)
    s.settimeout(300)
    while b"0\r\n\r\n" not in got[-16:]:  # the chunked response's end
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    long_ended = time.perf_counter()
    s.close()
    for t in threads:
        t.join(300)
    assert max(answers[k][2] for k in (3, 4)) < long_ended, "the long stream ended before the queue was full"
    assert [answers[k][0] for k in range(1, 5)] == [200, 200, 503, 503], answers
    for k in (3, 4):  # refused at once, in TorchServe's own shape (see docs/reliability.md)
        status, took, _, body = answers[k]
        assert took < 2.0 and body["type"] == "ServiceUnavailableException", answers[k]
    assert got.count(b"data: ") > 50
    assert all(answers[k][3]["choices"][0]["message"]["content"] for k in (1, 2))


def test_an_engine_process_that_dies_fails_its_requests_and_the_worker_is_replaced(full_server: TorchServe) -> None:
    """The engine runs in a process of its own beside the worker. Killed mid-stream, its stream ends
    with an error event, the worker exits, and TorchServe's next worker (with a new engine) serves."""
    import psutil

    worker = full_server.api.workers("smollm2")[0]["pid"]
    engines = [p for p in psutil.Process(worker).children() if "engine_process" in " ".join(p.cmdline())]
    assert len(engines) == 1, engines
    s = _raw_stream(full_server, "Count from 1 to 1000.", LONG)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    engines[0].kill()
    deadline = time.monotonic() + 60
    while b"0\r\n\r\n" not in got and time.monotonic() < deadline:  # the chunked response's end
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    s.close()
    assert b"the engine process ended (exit code -9); the worker restarts" in got, got[-600:]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        workers = full_server.api.workers("smollm2")
        if workers and workers[0].get("pid") not in (None, worker) and workers[0].get("status") == "READY":
            break
        time.sleep(1)
    else:
        pytest.fail(f"no new worker: {full_server.api.workers('smollm2')}")
    assert not psutil.pid_exists(engines[0].pid) or engines[0].status() == psutil.STATUS_ZOMBIE
    url = f"{full_server.inference_url}/predictions/smollm2/1.0/v1/chat/completions"
    body = json.dumps({"messages": _msgs("Say hi."), "max_tokens": 4, "temperature": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=120) as r:
        assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"]
