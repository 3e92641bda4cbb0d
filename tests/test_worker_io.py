"""servekit.handlers.worker_io and servekit.handlers.metrics against TorchServe 0.12's own decoder and emitter, on real sockets."""
import io
import json
import logging
import socket
import threading

import pytest
from ts.metrics.caching_metric import CachingMetric
from ts.metrics.metric_type_enum import MetricTypes
from ts import service
from ts.context import Context, RequestProcessor
from ts.protocol import otf_message_handler as otf

from servekit.benchmarks.worker_overhead import predict_frame
from servekit.handlers import worker_io
from servekit.handlers.metrics import HandlerMetrics, metric_line

BODIES = [json.dumps({"text": f"request {i} " + "é" * i}).encode() for i in range(20)]


@pytest.fixture
def sockets(monkeypatch):
    """A connected socket pair, TorchServe's reader and body decoding restored and no buffered state
    left afterwards."""
    monkeypatch.setattr(otf, "_retrieve_buffer", worker_io.stock_retrieve)
    monkeypatch.setattr(otf, "_retrieve_inference_msg", worker_io.stock_inference_msg)
    monkeypatch.setattr(service.Service, "retrieve_data_for_inference", staticmethod(worker_io.stock_requests))
    monkeypatch.setattr(service, "create_predict_response", worker_io.stock_response)
    monkeypatch.delenv(worker_io.DECODE_SWITCH, raising=False)
    monkeypatch.setattr(worker_io, "_reader", None)
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _decode(conn):
    cmd, msg = otf.retrieve_msg(conn)
    return bytes(cmd), msg


def test_buffered_reader_decodes_what_torchserve_decodes(sockets, monkeypatch):
    a, b = sockets
    # Requests with bodies, and continuing requests of a continuous-batching call (headers, no body).
    frame = predict_frame(BODIES) + predict_frame([b""] * 3, {"Accept": "text/event-stream"}, "")
    a.sendall(frame)
    stock = [_decode(b), _decode(b)]
    monkeypatch.setenv(worker_io.DECODE_SWITCH, "false")  # TorchServe's own decoding, bodies left as bytes
    a.sendall(frame)
    stock_bytes = [_decode(b), _decode(b)]
    assert worker_io.install_buffered_reads() is True
    assert worker_io.install_buffered_reads() is False  # once per process
    assert service.Service.retrieve_data_for_inference is worker_io.requests_for_inference
    assert service.create_predict_response is worker_io.encode_response
    a.sendall(frame)
    buffered = [_decode(b), _decode(b)]
    assert buffered == stock_bytes
    assert [type(x) for x in (buffered[0][1][0]["requestId"], buffered[0][1][0]["headers"][0]["value"],
                              buffered[0][1][0]["parameters"][0]["value"])] == [bytearray] * 3
    (cmd, msg), (_, continuing) = buffered
    assert cmd == b"I" and len(msg) == len(BODIES) and len(continuing) == 3
    assert [r["parameters"][0]["value"] for r in msg] == BODIES  # for decode_body to parse once
    assert [json.loads(r["parameters"][0]["value"]) for r in msg] == [r["parameters"][0]["value"] for r in stock[0][1]]
    assert msg[3]["requestId"] == b"req-00000003"
    assert continuing[1]["headers"] == [{"name": b"Accept", "value": b"text/event-stream"}]
    assert continuing[1]["parameters"][0] == {"name": "body", "contentType": "", "value": bytearray()}


def test_request_bookkeeping_is_torchserves():
    """Each request's headers (parameters' content types and the HTTP headers, decoded), its
    parameters by name and its id: what TorchServe's own bookkeeping gives, for requests with
    bodies and for continuing requests without."""
    frame = predict_frame(BODIES[:5], {"Accept": "text/event-stream", "X-Tag": "ünïcode"}) + \
        predict_frame([b""] * 3, {"Accept": "text/event-stream"}, "")
    first, end = worker_io.parse_requests(bytearray(frame), 1)
    second, _ = worker_io.parse_requests(bytearray(frame), end + 1)
    for batch in (first, second):
        (ours_h, ours_in, ours_ids), (ts_h, ts_in, ts_ids) = (worker_io.requests_for_inference(batch),
                                                              worker_io.stock_requests(batch))
        assert (ours_in, ours_ids) == (ts_in, ts_ids)
        assert [h.get_request_properties() for h in ours_h] == [h.get_request_properties() for h in ts_h]
        assert all(type(h) is RequestProcessor for h in ours_h)
    assert ours_h[1].get_request_property("Accept") == "text/event-stream"
    with pytest.raises(ValueError, match="invalid inputs"):
        worker_io.requests_for_inference(None)


def _context(n: int) -> Context:
    ctx = Context("m", "", {}, n, None, "0.12.0")
    ctx.request_ids = {i: f"req-{i:03d}" for i in range(n)}
    ctx.request_processor = [RequestProcessor({}) for _ in range(n)]
    return ctx


def test_response_frames_are_torchserves_byte_for_byte(monkeypatch):
    """The response frame and its effect on the context (each streamed answer's ts_stream_next
    header) as TorchServe's create_predict_response: with and without a context, content types,
    statuses with phrases, other headers, stopping criteria saying stop, go on or nothing, text,
    bytes and objects TorchServe serializes itself."""
    ids = {0: "req-000", 1: "réq-001", 2: "req-002"}
    answers = ["data: {\"x\": \"é\"}\n\n", b"\x00\x01raw", bytearray(b"more")]

    def setup(ctx: Context) -> Context:
        ctx.set_response_content_type(0, "text/event-stream")
        ctx.set_response_content_type(1, "application/jsön")
        ctx.set_response_status(400, "Bäd Request", 1)
        ctx.set_response_header(2, "X-Served-By", "servekit ✓")
        ctx.set_response_header(2, "ts_stream_next", "true")
        return ctx

    cases = [
        dict(ret=None, message="Prediction failed", code=503),
        dict(ret=answers, message="Prediction success", code=200, context="plain"),
        dict(ret=answers, message="Prediction success", code=200, context="stops"),
        dict(ret=answers, message="Prediction success", code=200, context="plain", ts_stream_next=True),
        dict(ret=[{"a": 1}, "two", b"3"], message="Prediction success", code=200, context="plain"),
    ]
    for case in cases:
        contexts = []
        for encode in (worker_io.stock_response, worker_io.encode_response):
            kw = dict(case)
            if kw.get("context"):
                ctx = setup(_context(3))
                if kw["context"] == "stops":
                    ctx.stopping_criteria = [lambda _: True, lambda _: False, lambda _: None]
                kw["context"] = ctx
                contexts.append([ctx.get_response_headers(i) for i in range(3)])
            contexts.append(bytes(encode(kw.pop("ret"), ids, kw.pop("message"), kw.pop("code"), **kw)))
        assert contexts[: len(contexts) // 2] == contexts[len(contexts) // 2:], case
    monkeypatch.setenv("LOCAL_RANK", "1")  # a non-zero rank sends nothing
    assert worker_io.encode_response(answers, ids, "Prediction success", 200) is None


def test_frames_split_anywhere_or_sent_together_decode_alike(sockets):
    a, b = sockets
    worker_io.install_buffered_reads()
    frames = [predict_frame(BODIES[:k]) for k in (1, 7, 20)]
    a.sendall(b"".join(frames[:2]))  # two frames in one write: the second stays buffered
    got = [_decode(b)[1], _decode(b)[1]]

    def dribble():  # the third in 3-byte pieces: fields span reads
        for i in range(0, len(frames[2]), 3):
            a.sendall(frames[2][i:i + 3])

    sender = threading.Thread(target=dribble)
    sender.start()
    got.append(_decode(b)[1])
    sender.join()
    assert [len(m) for m in got] == [1, 7, 20]
    assert [json.loads(r["parameters"][0]["value"])["text"] for r in got[2]] == [json.loads(x)["text"] for x in BODIES]
    # A body larger than the reader's chunk, arriving in pieces, between two small requests.
    big = json.dumps({"text": "x" * (3 * worker_io.CHUNK)}).encode()
    frame = predict_frame([BODIES[0], big, BODIES[1]])
    sender = threading.Thread(target=lambda: [a.sendall(frame[i:i + 65536]) for i in range(0, len(frame), 65536)])
    sender.start()
    msg = _decode(b)[1]
    sender.join()
    assert [bytes(r["parameters"][0]["value"]) for r in msg] == [BODIES[0], big, BODIES[1]]


def test_frontend_disconnect_ends_the_worker_as_torchserve_does(sockets):
    a, b = sockets
    worker_io.install_buffered_reads()
    a.sendall(predict_frame(BODIES[:2])[:10])  # a frame cut short, then the peer goes away
    a.close()
    with pytest.raises(SystemExit) as exc:
        _decode(b)
    assert exc.value.code == 0


# -- metrics ---------------------------------------------------------------------------------------
class _Context:
    def __init__(self):
        from pathlib import Path

        from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

        self.metrics = MetricsCacheYamlImpl(str(Path(__file__).resolve().parent.parent / "config" / "metrics.yaml"))
        self.metrics.initialize_cache()


def test_metric_line_is_what_torchserve_logs():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("ts.metrics.caching_metric")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for kind, value in ((MetricTypes.HISTOGRAM, 0.0123), (MetricTypes.COUNTER, 7), (MetricTypes.GAUGE, 0)):
            metric = CachingMetric("servekit_x", "Seconds", ["ModelName", "Plan"], kind)
            metric.add_or_update(value, ["minilm", "fp16"])
            ours = metric_line(metric, value, ["minilm", "fp16"], socket.gethostname(), 0)
            theirs = stream.getvalue().splitlines()[-1]
            # The timestamp (whole seconds) is the only part that may differ.
            assert ours.rsplit(",", 1)[0] == theirs.rsplit(",", 1)[0]
    finally:
        logger.removeHandler(handler)
    with pytest.raises(ValueError, match="dimensions"):
        metric_line(metric, 1, ["minilm"], "h", 0)
    with pytest.raises(ValueError, match="cannot decrease"):
        metric_line(CachingMetric("c", "Count", ["ModelName"], MetricTypes.COUNTER), -1, ["m"], "h", 0)


class _CountingStream(io.StringIO):
    writes = 0

    def write(self, s):
        self.writes += 1
        return super().write(s)


def test_a_batch_of_metrics_is_one_write_and_loses_no_observation():
    stream = _CountingStream()
    m = HandlerMetrics(_Context(), "minilm", stream=stream)
    m.emit("servekit_plan_info", "gauge", 1, Plan="fp32")  # outside a batch: written at once
    assert stream.writes == 1
    m.begin_batch()
    m.emit("servekit_batches_total", "counter", 1)
    m.emit("servekit_request_latency_seconds", "histogram", 0.01, "Seconds", times=16)
    m.emit("servekit_request_errors_total", "counter", -1, ErrorType="x")  # refused, logged, not fatal
    assert stream.writes == 1
    m.flush()
    assert stream.writes == 2
    lines = stream.getvalue().splitlines()
    assert sum(line.startswith("[METRICS]servekit_request_latency_seconds.Seconds:0.01|#ModelName:minilm|")
               for line in lines) == 16
    assert len(lines) == 1 + 1 + 16
    m.flush()  # nothing queued: no write
    assert stream.writes == 2


def test_overhead_benchmark_times_every_stage_of_bulk_requests(monkeypatch):
    """The worker-overhead benchmark with multi-text requests: every stage of a 32-text request's
    worker-side path timed, on OpenAI bodies whose answers are smaller in base64 than in floats."""
    from servekit.benchmarks import worker_overhead

    monkeypatch.setattr(otf, "_retrieve_buffer", worker_io.stock_retrieve)
    monkeypatch.setattr(otf, "_retrieve_inference_msg", worker_io.stock_inference_msg)
    monkeypatch.setattr(worker_io, "_reader", None)
    result = worker_overhead.run([2], reps=1, texts=32)
    assert otf._retrieve_inference_msg is worker_io.stock_inference_msg  # the benchmark put TorchServe's back
    call = result["llm_call"]
    assert (call["requests"], call["headers_per_request"]) == (32, len(worker_overhead.OPENAI_SDK_HEADERS))
    assert call["decode"]["stock_us_per_batch"] > 0 and call["decode"]["servekit_us_per_batch"] > 0
    [row] = result["rows"]
    assert (row["batch"], row["texts_per_request"], result["texts_per_request"]) == (2, 32, 32)
    for stage in ("decode", "metrics", "tokenize", "pad", "answer"):
        assert row[stage]["stock_us_per_batch"] > 0 and row[stage]["servekit_us_per_batch"] > 0, stage
        # per batch is rounded to 0.1 µs, per request to 0.01 µs, each from the unrounded time
        assert row[stage]["stock_us_per_request"] == pytest.approx(row[stage]["stock_us_per_batch"] / 2, abs=0.06)
    assert row["frame"]["us_per_batch"] > 0
    # 32 x 384 float32: ~49 KB of raw floats, base64 4/3 of that; JSON text of the floats is larger.
    assert 32 * 384 * 4 * 4 / 3 < row["answer"]["base64_bytes_per_request"] < row["answer"]["float_bytes_per_request"]
    assert row["frame_bytes"] > 2 * 32 * 20  # two bodies of 32 texts
