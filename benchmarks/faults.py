"""Fault injection against a live TorchServe: bad input, a killed worker, out of memory, a restart.

    python -m servekit.benchmarks.faults --out benchmarks/results

builds `minilm.mar` and a test-only `minilm_faulty.mar` (the production handler whose inference raises
`torch.OutOfMemoryError` for any batch holding a marker word, with `too_long: reject`), starts its own
TorchServe and runs:
  1. the bad-input matrix: every kind in `bad_inputs()` sent together with three valid requests, so
     that TorchServe batches them; the valid ones must get the right vectors, the worker must live;
  2. out of memory: the marker request fails alone with 507, its batch-mates are answered;
  3. a worker killed (SIGKILL) under load: requests lost, seconds until answers succeed again;
  4. a TorchServe restart with the models loaded from the store (`--models`): seconds until ready.
It writes `reliability-faults.json` / `.md` and `reliability-summary.json` (merging
`reliability-soak.json` when the folder has one). The test suite imports these functions.
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as dt
import gzip
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import requests
import yaml

from servekit.resources import config_dir, model_config
from servekit.torchserve import TorchServe, read_properties

VERSION = "1.0"
OOM_MARKER = "xqzoommarker"

# -- the valid requests sent beside every bad one ------------------------------------------------------
GOOD_TEXTS = ["A valid request batched with a bad one must still be answered.",
              "hello world",
              "TorchServe batches requests from many clients into a single forward pass.",
              "Reliability is measured, not assumed."]


def good_requests(model: str) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(path, JSON body, texts) of three valid requests: plain, OpenAI float and OpenAI base64."""
    return [(f"/predictions/{model}", {"text": GOOD_TEXTS[:2]}, GOOD_TEXTS[:2]),
            (f"/predictions/{model}/{VERSION}/v1/embeddings", {"input": GOOD_TEXTS[2]}, GOOD_TEXTS[2:3]),
            (f"/predictions/{model}/{VERSION}/v1/embeddings", {"input": [GOOD_TEXTS[3]], "encoding_format": "base64"},
             GOOD_TEXTS[3:4])]


def vectors(answer: Any) -> np.ndarray:
    """Embeddings from a plain or OpenAI (float or base64) answer, as a (n, dim) array."""
    if "embeddings" in answer:
        return np.asarray(answer["embeddings"], dtype=np.float32)
    rows = [d["embedding"] for d in answer["data"]]
    if rows and isinstance(rows[0], str):
        return np.stack([np.frombuffer(base64.b64decode(r), dtype="<f4") for r in rows])
    return np.asarray(rows, dtype=np.float32)


def reference_embedder(texts: list[str] | None = None) -> Callable[[list[str]], np.ndarray]:
    """In-process reference: the same runner and plan as the archive (eager, no warm-up), on CPU."""
    from servekit.archive import minilm_weights
    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import parse_plan

    raw = yaml.safe_load(model_config("minilm").read_text())["servekit"]
    plan = dataclasses.replace(parse_plan(raw), device="cpu", warmup=False)
    runner = EmbeddingRunner(minilm_weights()[0].parent, plan, golden_texts=texts or GOOD_TEXTS)
    cache: dict[tuple[str, ...], np.ndarray] = {}

    def embed(batch: list[str]) -> np.ndarray:
        key = tuple(batch)
        if key not in cache:
            cache[key] = runner.embed(list(batch)).numpy()
        return cache[key]

    return embed


# -- the bad-input matrix -------------------------------------------------------------------------------
@dataclass(frozen=True)
class BadInput:
    name: str
    kind: str            # what is wrong, in words
    body: bytes
    status: int          # the answer it must get
    expect: str          # a fragment of the answer's message, code or type naming the problem ("" = no body)
    content_type: str | None = "application/json"
    path: str = "/predictions/{model}"
    method: str = "POST"
    answered_by: str = "handler"   # or "torchserve": the frontend answers before any worker sees it

    def url(self, base: str, model: str) -> str:
        return base + self.path.format(model=model, version=VERSION)


OPENAI = "/predictions/{model}/{version}/v1/embeddings"
# config.properties' max_request_size: bodies up to it reach the handler (its JSON 413s), beyond it
# TorchServe answers an empty 413 itself.
MAX_REQUEST_SIZE = int(read_properties(config_dir() / "config.properties").get("max_request_size", 6_553_500))


def _j(value: Any) -> bytes:
    return json.dumps(value).encode()


def bad_inputs() -> list[BadInput]:
    B = BadInput
    return [
        B("malformed_json", "malformed JSON (unterminated string)", b'{"text": "hel', 400, "malformed JSON"),
        B("malformed_json_openai", "malformed JSON (trailing comma), OpenAI route", b'{"input": ["a",]}', 400,
          "malformed JSON", path=OPENAI),
        B("wrong_type_int", "wrong type: 'text' is a number", _j({"text": 5}), 400, "must be a string"),
        B("wrong_type_object", "wrong type: 'input' is an object", _j({"input": {"a": 1}}), 400,
          "must be a string", path=OPENAI),
        B("wrong_type_list_item", "wrong type: null inside the list", _j({"text": ["ok", None]}), 400,
          "'text[1]' must be a string"),
        B("token_arrays", "token ids outside the model's vocabulary", _j({"input": [101, 7592, 10**7]}), 400,
          "outside this model's vocabulary", path=OPENAI),
        B("top_level_number", "body is a bare JSON number", b"42", 400, "must be a string or a list"),
        B("missing_field_openai", "missing field 'input'", _j({"model": "minilm"}), 400,
          "missing required field 'input'", path=OPENAI),
        B("missing_field_plain", "missing field 'text' (typo 'texts')", _j({"texts": ["a"]}), 400,
          "missing required field 'text'"),
        B("unknown_field", "unknown field", _j({"input": "a", "temperature": 0.5}), 400,
          "unknown field 'temperature'", path=OPENAI),
        B("empty_list", "empty input list", _j({"input": []}), 400, "empty list", path=OPENAI),
        B("empty_string", "empty string", _j({"input": ""}), 400, "empty string", path=OPENAI),
        B("blank_string", "whitespace-only string in a list", _j({"text": ["ok", "   "]}), 400, "empty string"),
        B("empty_body", "empty body", b"", 400, "empty request body"),
        B("null_body", "JSON null body", b"null", 400, "empty request body"),
        B("huge_list", "10 000 texts in one request", _j({"input": ["a"] * 10_000}), 413, "at most 2048",
          path=OPENAI),
        B("text_too_long", "one text of 100 001 characters", _j({"text": "a" * 100_001}), 413,
          "the limit is 100000"),
        B("body_6mb", "6 MB body", _j({"text": "a " * 3_000_000}), 413,
          "the limit is 100000"),
        B("body_10mb", "10 MB body: over TorchServe's default limit (6.5 MB), under servekit's max_request_size",
          _j({"text": "a " * 5_000_000}), 413, "the limit is 100000"),
        B("body_over_limit", f"body over max_request_size ({MAX_REQUEST_SIZE // 2**20} MiB)",
          b"a" * (MAX_REQUEST_SIZE + 1), 413, "", content_type="text/plain", answered_by="torchserve"),
        B("invalid_utf8_text", "invalid UTF-8 in a text/plain body", b"caf\xe9 \xff", 400, "not valid UTF-8",
          content_type="text/plain"),
        B("invalid_utf8_json", "invalid UTF-8 inside a JSON string", b'{"text": "caf\xe9"}', 400,
          "not valid UTF-8"),
        B("binary_garbage", "binary garbage (application/octet-stream)", bytes(range(256)) * 64, 400,
          "not valid UTF-8", content_type="application/octet-stream"),
        B("lone_surrogate", "JSON escape of an unpaired UTF-16 surrogate", b'{"input": ["ok", "\\ud800"]}', 400,
          "unpaired surrogate", path=OPENAI),
        B("wrong_content_type_png", "wrong content type (image/png) with image bytes",
          b"\x89PNG\r\n\x1a\n" + bytes(200), 400, "not valid UTF-8", content_type="image/png"),
        B("curl_d_json", "JSON sent form-encoded (curl -d without -H 'Content-Type: application/json')",
          b'{"text": "hello"}', 400, "form-encoded body", content_type="application/x-www-form-urlencoded"),
        B("form_fields", "form fields (text=hello)", b"text=hello", 415, "form fields are not supported",
          content_type="application/x-www-form-urlencoded"),
        B("multipart", "multipart/form-data field",
          b'--xx\r\nContent-Disposition: form-data; name="text"\r\n\r\nhello\r\n--xx--\r\n', 415,
          "form fields are not supported", content_type="multipart/form-data; boundary=xx"),
        B("nan", "NaN where a number is expected", b'{"input": "a", "dimensions": NaN}', 400,
          "NaN and Infinity are not allowed", path=OPENAI),
        B("infinity", "Infinity (1e999) where a number is expected", b'{"input": "a", "dimensions": 1e999}', 400,
          "NaN and Infinity are not allowed", path=OPENAI),
        B("wrong_dimensions", "dimensions above the model's", _j({"input": "a", "dimensions": 385}), 400,
          "'dimensions' must be between 1 and 384", path=OPENAI),
        B("bool_dimensions", "boolean where an integer is expected", _j({"input": "a", "dimensions": True}), 400,
          "'dimensions' must be an integer", path=OPENAI),
        B("huge_int_dimensions", "dimensions an integer of 5,000 digits (beyond Python's int parsing limit)",
          b'{"input": "a", "dimensions": ' + b"9" * 5000 + b"}", 400, "invalid JSON value", path=OPENAI),
        B("huge_dimensions", "dimensions 10**30", _j({"input": "a", "dimensions": 10**30}), 400,
          "'dimensions' must be between 1 and", path=OPENAI),
        B("bad_encoding_format", "unknown encoding_format", _j({"input": "a", "encoding_format": "int8"}), 400,
          "'encoding_format' must be", path=OPENAI),
        B("nested_100", "JSON nested 100 levels", b'{"text": ' + b"[" * 100 + b"]" * 100 + b"}", 400,
          "nested deeper than 32"),
        B("nested_100k", "JSON nested 100 000 levels", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        B("unknown_route", "unknown route suffix", _j({"input": "a"}), 404, "unknown route",
          path="/predictions/{model}/{version}/v2/embeddings"),
        B("missing_version", "OpenAI route without the version", _j({"input": "a"}), 404,
          "ModelVersionNotFoundException", path="/predictions/{model}/v1/embeddings", answered_by="torchserve"),
        B("unknown_model", "unknown model", _j({"text": "a"}), 404, "ModelNotFoundException",
          path="/predictions/no_such_model", answered_by="torchserve"),
        B("unknown_version", "unknown model version", _j({"text": "a"}), 404, "ModelVersionNotFoundException",
          path="/predictions/{model}/9.9", answered_by="torchserve"),
        B("wrong_method", "GET instead of POST (no body)", b"", 400, "empty request body", method="GET",
          content_type=None),
        B("gzip_body", "gzip-compressed JSON (Content-Encoding: gzip, which TorchServe does not undo)",
          gzip.compress(_j({"text": "hello"})), 415, "Content-Encoding is not supported"),
        B("comment_then_json", "a '//' comment line before a JSON body, sent as text/plain",
          b'// note\n{"text": "hello"}', 400, "JSON has no comments", content_type="text/plain"),
        B("bom_then_comment", "a UTF-8 byte order mark, then a '/*' comment", b'\xef\xbb\xbf/* x */ {"input": "a"}', 400,
          "JSON has no comments", path=OPENAI),
        B("echo_1mb_value", "a 1 MB value echoed by the error ('encoding_format')",
          _j({"input": "a", "encoding_format": "x" * 1_000_000}), 400, "truncated: 1000002 characters", path=OPENAI),
        B("echo_1mb_key", "a 1 MB unknown field name", _j({"input": "a", "k" * 1_000_000: 1}), 400,
          "truncated: 1000002 characters", path=OPENAI),
    ]


# -- sending ---------------------------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    body: bytes
    content_type: str | None
    seconds: float

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def send_together(calls: list[tuple[str, str, bytes, str | None]], timeout: float = 120.0) -> list[Answer]:
    """Send (method, url, body, content type) calls at the same instant from separate threads."""
    barrier = threading.Barrier(len(calls))
    out: list[Answer | None] = [None] * len(calls)

    def one(k: int) -> None:
        method, url, body, ctype = calls[k]
        headers = {"Content-Type": ctype} if ctype else {}
        barrier.wait()
        t0 = time.monotonic()
        try:
            r = requests.request(method, url, data=body, headers=headers, timeout=timeout)
            out[k] = Answer(r.status_code, r.content, r.headers.get("content-type"), time.monotonic() - t0)
        except requests.RequestException as e:
            out[k] = Answer(-1, repr(e).encode(), None, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out  # type: ignore[return-value]


def worker_identity(ts: TorchServe, model: str) -> list[tuple[str, int | None]]:
    return sorted((str(w.get("id")), w.get("pid")) for w in ts.api.workers(model))


def handler_counter(ts: TorchServe, name: str, model: str) -> float:
    """Sum of a handler counter on TorchServe's Prometheus endpoint (0 before its first update)."""
    try:
        text = requests.get(f"{ts.metrics_url}/metrics", timeout=10).text
    except requests.RequestException:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'ModelName="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _message(answer: Answer) -> str:
    """The part of an error answer that names the problem (ours or TorchServe's own format)."""
    body = answer.json()
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        e = body["error"]
        return f"{e.get('message')} [{e.get('type')}/{e.get('code')}]"
    if isinstance(body, dict) and "message" in body:
        return f"{body.get('message')} [{body.get('type')}]"
    return answer.body[:200].decode("utf-8", "replace")


def check_with_good(ts: TorchServe, model: str, bad: BadInput, reference: Callable[[list[str]], np.ndarray],
                    workers_before: list | None = None) -> dict[str, Any]:
    """Send `bad` together with the three valid requests; report what each got and whether the worker lived."""
    goods = good_requests(model)
    calls = [(bad.method, bad.url(ts.inference_url, model), bad.body, bad.content_type)]
    calls += [("POST", ts.inference_url + path, _j(body), "application/json") for path, body, _ in goods]
    workers_before = workers_before or worker_identity(ts, model)
    batches0 = handler_counter(ts, "servekit_batches_total", model)
    answers = send_together(calls)
    bad_answer, good_answers = answers[0], answers[1:]
    diffs, good_ok = [], []
    for (path, body, texts), a in zip(goods, good_answers):
        ok = a.status == 200
        if ok:
            got = vectors(a.json())
            diff = float(np.abs(got - reference(texts)).max()) if got.shape == (len(texts), 384) else float("inf")
            diffs.append(diff)
            ok = diff < 1e-4
        good_ok.append(ok)
    # Both counters move only after the worker has reported the batch: wait for the valid ones.
    batches1 = batches0
    for _ in range(20):
        batches1 = handler_counter(ts, "servekit_batches_total", model)
        if batches1 > batches0:
            break
        time.sleep(0.1)
    message = _message(bad_answer)
    body = bad_answer.json()
    json_error = isinstance(body, dict) and (isinstance(body.get("error"), dict) or "message" in body)
    named = bad.expect.lower() in message.lower() if bad.expect else True
    workers_after = worker_identity(ts, model)
    return {
        "name": bad.name, "kind": bad.kind, "answered_by": bad.answered_by,
        "expected_status": bad.status, "status": bad_answer.status, "message": message[:300],
        "json_error": json_error, "names_problem": named,
        "good_statuses": [a.status for a in good_answers], "good_correct": all(good_ok),
        "good_max_abs_diff": max(diffs) if diffs else None,
        "batches_used": batches1 - batches0,
        "worker_same": workers_before == workers_after and bool(workers_after),
        "passed": (bad_answer.status == bad.status and named and (json_error or bad.expect == "")
                   and all(good_ok) and workers_before == workers_after),
    }


# -- the test-only faulty archive ----------------------------------------------------------------------------
FAULTY_HANDLER = f'''"""Test-only handler (built by benchmarks/faults.py, never shipped): the production embedding
handler whose inference raises torch.OutOfMemoryError for any batch holding the word {OOM_MARKER!r}."""
import torch

from servekit.handlers.embedding_handler import EmbeddingHandler

MARKER = {OOM_MARKER!r}


class OomOnMarkerHandler(EmbeddingHandler):
    def initialize(self, context):
        super().initialize(context)
        marker = self.runner.tokenizer.encode(MARKER, add_special_tokens=False).ids
        embed_ids = self.runner.embed_ids

        def embed_ids_or_oom(seqs, chunks=None):
            n = len(marker)
            if any(list(s[k:k + n]) == marker for s in seqs for k in range(len(s) - n + 1)):
                raise torch.OutOfMemoryError("simulated out of memory: the batch holds the marker word")
            return embed_ids(seqs, chunks)

        self.runner.embed_ids = embed_ids_or_oom
'''


FAULTY_LLM_HANDLER = f'''"""Test-only handler (built by benchmarks/faults.py, never shipped): the production LLM handler
whose engine raises torch.OutOfMemoryError for any prefill holding a prompt with {OOM_MARKER!r}."""
import torch

from servekit.handlers import llm_handler

MARKER = {OOM_MARKER!r}


def oom_on_marker(batcher, tokenizer):
    """Called in the engine process with its batcher, before it serves."""
    run = batcher.packed.run

    def run_or_oom(chunks):
        if any(MARKER in tokenizer.decode(c.tokens) for c in chunks):
            raise torch.OutOfMemoryError("simulated out of memory: the prefill holds the marker word")
        return run(chunks)

    batcher.packed.run = run_or_oom


class OomOnMarkerService(llm_handler.LlmService):
    engine_hook = f"{{__name__}}:oom_on_marker"


llm_handler._service = OomOnMarkerService()
handle = llm_handler.handle
'''


def build_faulty_llm_archive(store: Path, work: Path, config: Path, name: str = "smollm2_faulty",
                             weights: list[Path] | None = None) -> Path:
    """`<store>/<name>.mar`: SmolLM2 (or the model files `weights`) with the OOM-on-marker LLM
    handler and the given model-config."""
    import torch

    from servekit.archive import LLM, ArchiveSpec, build_archive
    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    work.mkdir(parents=True, exist_ok=True)
    handler = work / "oom_llm_handler.py"
    handler.write_text(FAULTY_LLM_HANDLER)
    spec = ArchiveSpec(LLM, handler, Path(config), lambda: weights or smollm2_archive_files(torch.bfloat16))
    return build_archive(name, store, archive_name=name, compress=False, spec=spec)  # test-only: fast to build


def build_faulty_archive(store: Path, work: Path, buckets: dict[str, list[int]] | None = None,
                         name: str = "minilm_faulty") -> Path:
    """`<store>/<name>.mar`: the OOM-on-marker handler, `too_long: reject`, batch 8 / 50 ms."""
    from servekit.archive import EMBEDDING, ArchiveSpec, build_archive, minilm_weights

    work.mkdir(parents=True, exist_ok=True)
    handler = work / "oom_handler.py"
    handler.write_text(FAULTY_HANDLER)
    cfg = yaml.safe_load(model_config("minilm").read_text())
    cfg.update({"batchSize": 8, "maxBatchDelay": 50})
    cfg["servekit"].setdefault("limits", {})["too_long"] = "reject"
    if buckets:
        cfg["servekit"]["buckets"] = buckets
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    spec = ArchiveSpec(EMBEDDING, handler, config, minilm_weights)
    return build_archive(name, store, archive_name=name, compress=False, spec=spec)  # test-only: fast to build


def faulty_cases(max_seq: int) -> list[BadInput]:
    """Bad inputs that only the faulty archive's plan (too_long: reject) or handler produce."""
    return [
        BadInput("too_long_reject", f"text longer than the largest bucket ({max_seq} tokens), too_long: reject",
                 _j({"input": ["short", "word " * (2 * max_seq)]}), 413, f"longer than the {max_seq} tokens served",
                 path=OPENAI),
        BadInput("out_of_memory", "inference raises torch.OutOfMemoryError (marker input)",
                 _j({"text": f"please embed {OOM_MARKER} now"}), 507, "out of memory"),
    ]


# -- faults --------------------------------------------------------------------------------------------------
NO_ANSWER = 0     # status recorded when the client timeout expired without an answer
CONNECT_ERROR = -1  # status recorded when the connection failed


class Load:
    """Closed-loop load of valid requests from `concurrency` threads, recording every answer.

    Each request has a client timeout: TorchServe 0.12 drops the requests it was assembling into a
    batch when the worker dies at that moment (no answer is ever sent), so a client without a
    timeout would wait forever.
    """

    def __init__(self, ts: TorchServe, model: str, concurrency: int = 4, client_timeout: float = 30.0) -> None:
        self.url = f"{ts.inference_url}/predictions/{model}"
        self.client_timeout = client_timeout
        self.records: list[tuple[float, float, int]] = []   # (sent, done, status), time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(concurrency)]

    def _run(self, k: int) -> None:
        session = requests.Session()
        body = {"text": [GOOD_TEXTS[k % len(GOOD_TEXTS)]]}
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status = session.post(self.url, json=body, timeout=self.client_timeout).status_code
            except requests.Timeout:
                status = NO_ANSWER
                session = requests.Session()  # the timed-out connection is unusable
            except requests.RequestException:
                status = CONNECT_ERROR
                time.sleep(0.05)
            with self._lock:
                self.records.append((t0, time.monotonic(), status))

    def __enter__(self) -> "Load":
        for th in self._threads:
            th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(timeout=self.client_timeout + 10)


def kill_worker_under_load(ts: TorchServe, model: str, concurrency: int = 4, before_s: float = 3.0,
                           after_s: float = 2.0, timeout: float = 300.0,
                           client_timeout: float = 30.0) -> dict[str, Any]:
    """SIGKILL the model's worker while `concurrency` clients send valid requests; measure the damage.

    Requests in the dead worker's batch get 507 "Worker died."; requests TorchServe was still
    assembling into a batch get no answer at all (counted as `no_answer` after `client_timeout`).
    """
    before = worker_identity(ts, model)
    if not before or before[0][1] is None:
        raise RuntimeError(f"{model} has no worker with a pid: {before}")
    with Load(ts, model, concurrency, client_timeout) as load:
        time.sleep(before_s)
        t_kill = time.monotonic()
        os.kill(before[0][1], signal.SIGKILL)
        ready_s = None
        while time.monotonic() - t_kill < timeout:
            after = [w for w in ts.api.workers(model, 2.0) if w.get("status") == "READY"]
            if ready_s is None and after and after[0].get("pid") != before[0][1]:
                ready_s = time.monotonic() - t_kill
            with load._lock:
                served = any(t1 > t_kill and s == 200 for t0, t1, s in load.records if t0 > t_kill)
            if ready_s is not None and served:
                break
            time.sleep(0.2)
        time.sleep(after_s)
    recs = load.records
    failed = [(t0, t1, s) for t0, t1, s in recs if s != 200]
    ok_after = [t1 for t0, t1, s in recs if s == 200 and t1 > t_kill]
    statuses: dict[str, int] = {}
    for _, _, s in failed:
        key = {NO_ANSWER: "no_answer", CONNECT_ERROR: "connection_error"}.get(s, str(s))
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "fault": "worker killed (SIGKILL) under load", "model": model, "concurrency": concurrency,
        "client_timeout_s": client_timeout,
        "requests": len(recs), "failed": len(failed), "failed_statuses": statuses,
        "failed_in_flight_at_kill": sum(1 for t0, t1, s in failed if t0 <= t_kill <= t1),
        "failed_sent_after_kill": sum(1 for t0, t1, s in failed if t0 > t_kill),
        "failed_sent_after_ready": (None if ready_s is None
                                    else sum(1 for t0, t1, s in failed if t0 > t_kill + ready_s)),
        "worker_ready_s": None if ready_s is None else round(ready_s, 2),
        "recovery_s": round(min(ok_after) - t_kill, 2) if ok_after else None,
        "worker_before": before, "worker_after": worker_identity(ts, model),
    }


def oom_isolation(ts: TorchServe, model: str, reference: Callable[[list[str]], np.ndarray],
                  rounds: int = 3) -> dict[str, Any]:
    """The marker request together with three valid ones, `rounds` times: only the marker may fail."""
    oom = faulty_cases(256)[1]
    results = [check_with_good(ts, model, oom, reference) for _ in range(rounds)]
    after = requests.post(f"{ts.inference_url}/predictions/{model}", json={"text": "after the fault"}, timeout=60)
    return {
        "fault": "torch.OutOfMemoryError in inference (simulated on CPU)", "model": model, "rounds": rounds,
        "requests": rounds * 4 + 1, "marker_statuses": [r["status"] for r in results],
        "marker_messages": sorted({r["message"] for r in results}),
        "valid_lost": sum(r["good_statuses"].count(200) != 3 or not r["good_correct"] for r in results)
        + (after.status_code != 200),
        "worker_same": all(r["worker_same"] for r in results), "batches_used": [r["batches_used"] for r in results],
        "passed": all(r["passed"] for r in results) and after.status_code == 200,
    }


def restart_from_store(ts: TorchServe, models: dict[str, str], run_dir: Path,
                       reference: Callable[[list[str]], np.ndarray]) -> tuple[TorchServe, dict[str, Any]]:
    """Stop `ts`, start a new TorchServe on the same store with `--models`, time it until every model answers.

    Returns the new server (the caller stops it) and the figures.
    """
    ts.stop()
    new = TorchServe(run_dir, ts.model_store, models=",".join(f"{m}={mar}" for m, mar in models.items()))
    t0 = time.monotonic()
    new.start()
    ping_s = time.monotonic() - t0
    ready = {}
    for m in models:
        new.wait_ready(m, timeout=600)
        ready[m] = round(time.monotonic() - t0, 2)
    answers = {}
    for m in models:
        r = requests.post(f"{new.inference_url}/predictions/{m}", json={"text": GOOD_TEXTS[:2]}, timeout=60)
        diff = float(np.abs(vectors(r.json()) - reference(GOOD_TEXTS[:2])).max()) if r.status_code == 200 else None
        answers[m] = {"status": r.status_code, "max_abs_diff": diff}
    return new, {"fault": "TorchServe restarted; models loaded from the store with --models",
                 "models": models, "ping_s": round(ping_s, 2), "ready_s": ready, "answers": answers,
                 "passed": all(a["status"] == 200 and a["max_abs_diff"] < 1e-4 for a in answers.values())}


# -- command line -------------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# Fault injection: `{report['command']}`", "",
             f"- date: {m['date']}; machine: {m['cpu']} ({m['cpu_count']} logical CPUs), GPU: {m['gpu'] or 'none'}",
             f"- versions: Python {m['python']}, torch {m['torch']}, TorchServe {m['torchserve']}, Java {m['java']}",
             "", "## Bad input (each sent together with 3 valid requests)", "",
             "| kind | answered by | status (expected) | message | valid batch-mates | worker kept |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["bad_input"]:
        msg = r["message"].replace("|", "\\|").replace("\n", " ")[:110] or "(empty body)"
        lines.append(f"| {r['kind']} | {r['answered_by']} | {r['status']} ({r['expected_status']}) | {msg} | "
                     f"{r['good_statuses'].count(200)}/3 {'correct' if r['good_correct'] else 'WRONG'} | "
                     f"{'yes' if r['worker_same'] else 'NO'} |")
    k, o, rs = report["kill_worker"], report["oom"], report["restart"]
    lines += ["", "## Faults", "",
              "| fault | requests | lost | recovery |", "| --- | --- | --- | --- |",
              f"| {k['fault']} ({k['concurrency']} clients) | {k['requests']} | {k['failed']} "
              f"({k['failed_in_flight_at_kill']} in flight at the kill, {k['failed_sent_after_kill']} sent after) "
              f"{k['failed_statuses']} | worker READY after {k['worker_ready_s']} s, first success {k['recovery_s']} s "
              "after the kill |",
              f"| {o['fault']}, {o['rounds']} rounds | {o['requests']} | {o['valid_lost']} valid lost; marker got "
              f"{o['marker_statuses']} | worker kept: {o['worker_same']} |",
              f"| {rs['fault']} | {len(rs['answers'])} | {sum(a['status'] != 200 for a in rs['answers'].values())} | "
              f"/ping after {rs['ping_s']} s, ready after {rs['ready_s']} s |", ""]
    return "\n".join(lines)


def summary(faults: dict[str, Any] | None, soak: dict[str, Any] | None,
            gpu_oom: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures of docs/reliability.md in one machine-readable object (``gpu_oom``: the result of
    ``benchmarks/gpu_oom.py``, the real out-of-memory error on a GPU)."""
    out: dict[str, Any] = {"generated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if faults:
        bad = faults["bad_input"]
        out["bad_input"] = {
            "kinds": len(bad), "passed": sum(r["passed"] for r in bad),
            "answered_by_handler": sum(r["answered_by"] == "handler" for r in bad),
            "answered_by_torchserve": sum(r["answered_by"] == "torchserve" for r in bad),
            "requests_sent": 4 * len(bad), "valid_sent": 3 * len(bad),
            "valid_lost": sum(3 - r["good_statuses"].count(200) for r in bad),
            "valid_wrong_vectors": sum(not r["good_correct"] for r in bad),
            "worker_restarts": sum(not r["worker_same"] for r in bad),
        }
        k, o, rs = faults["kill_worker"], faults["oom"], faults["restart"]
        out["faults"] = [
            {"fault": k["fault"], "requests": k["requests"], "lost": k["failed"],
             "lost_in_flight": k["failed_in_flight_at_kill"], "lost_sent_after_kill": k["failed_sent_after_kill"],
             "worker_ready_s": k["worker_ready_s"], "recovery_s": k["recovery_s"]},
            {"fault": o["fault"], "requests": o["requests"], "valid_lost": o["valid_lost"],
             "marker_statuses": o["marker_statuses"], "worker_kept": o["worker_same"]},
            {"fault": rs["fault"], "requests": len(rs["answers"]),
             "lost": sum(a["status"] != 200 for a in rs["answers"].values()),
             "ping_s": rs["ping_s"], "ready_s": rs["ready_s"]},
        ]
        out["faults_command"] = faults["command"]
        out["faults_machine"] = faults["machine"]
    if gpu_oom:
        out["gpu_oom"] = {k: gpu_oom[k] for k in ("gpu", "ballast_mib", "long_status", "long_error", "short_statuses",
                                                  "short_same_as_alone", "worker_same", "after_ballast_freed_status",
                                                  "passed", "command")}
        out["gpu_oom"]["date"] = gpu_oom["machine"]["date"]
    if soak:
        out["soak"] = {k: soak[k] for k in ("duration_s", "requests", "valid_requests", "invalid_requests_sent",
                                            "errors", "valid_lost", "worker_restarts", "throughput_rps",
                                            "latency_ms", "gpu", "command", "machine")}
        out["soak"]["memory_growth_mib"] = {k: v["growth_mib"] for k, v in soak["memory"].items()}
        out["soak"]["memory_slope_mib_per_hour"] = {k: v["slope_mib_per_hour"] for k, v in soak["memory"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    from servekit.benchmarks.soak import machine_info
    from servekit.archive import build_archive

    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the results")
    p.add_argument("--concurrency", type=int, default=4, help="clients during the worker kill (default 4)")
    args = p.parse_args(argv)
    command = "python -m servekit.benchmarks.faults " + " ".join(argv if argv is not None else sys.argv[1:])
    reference = reference_embedder()
    with tempfile.TemporaryDirectory(prefix="servekit-faults-") as tmp:
        tmp_path = Path(tmp)
        store = tmp_path / "store"
        build_archive("minilm", store)
        build_faulty_archive(store, tmp_path / "faulty")
        ts = TorchServe(tmp_path / "run", store).start()
        new = None
        try:
            ts.register("minilm.mar", "minilm", batch_size=8, max_batch_delay_ms=50)
            ts.register("minilm_faulty.mar", "minilm_faulty")
            print("servers ready; bad-input matrix", flush=True)
            before = worker_identity(ts, "minilm")
            bad = [check_with_good(ts, "minilm", b, reference, before) for b in bad_inputs()]
            before = worker_identity(ts, "minilm_faulty")
            bad += [check_with_good(ts, "minilm_faulty", faulty_cases(256)[0], reference, before)]
            for r in bad:
                print(f"  {'ok ' if r['passed'] else 'FAIL'} {r['name']}: {r['status']} {r['message'][:90]}", flush=True)
            print("out of memory", flush=True)
            oom = oom_isolation(ts, "minilm_faulty", reference, rounds=5)
            print(f"  {oom}", flush=True)
            print("worker kill under load", flush=True)
            kill = kill_worker_under_load(ts, "minilm", args.concurrency)
            print(f"  {kill}", flush=True)
            print("restart", flush=True)
            new, restart = restart_from_store(ts, {"minilm": "minilm.mar", "minilm_faulty": "minilm_faulty.mar"},
                                              tmp_path / "run2", reference)
            print(f"  {restart}", flush=True)
        finally:
            ts.stop()
            if new is not None:
                new.stop()
    report = {"command": command, "machine": machine_info(), "bad_input": bad, "oom": oom, "kill_worker": kill,
              "restart": restart}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reliability-faults.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "reliability-faults.md").write_text(markdown(report))
    soak_path = args.out / "reliability-soak.json"
    soak = json.loads(soak_path.read_text()) if soak_path.exists() else None
    oom_runs = sorted(args.out.glob("gpu-oom-*/gpu_oom.json"))  # GPU runs committed beside the results
    gpu_oom = json.loads(oom_runs[-1].read_text()) if oom_runs else None
    (args.out / "reliability-summary.json").write_text(json.dumps(summary(report, soak, gpu_oom), indent=2) + "\n")
    print(markdown(report))
    ok = all(r["passed"] for r in bad) and oom["passed"] and restart["passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
