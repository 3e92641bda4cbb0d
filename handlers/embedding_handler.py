"""TorchServe handler: text -> sentence embeddings, for any encoder servekit loads (all-MiniLM-L6-v2
by default); pooling, normalisation, length limit and prompts come from the model's own files.

Routes (TorchServe passes the suffix after /predictions/<model>/<version>/ in `url_path`):
  POST /predictions/<model>/<version>/v1/embeddings   OpenAI embeddings API (strings or token-id
                                                       arrays, `dimensions`, and `prompt_name`)
  POST /predictions/<model>                            {"text": str | [str], "prompt_name"?}, a JSON
                                                       list, or a text body
A bad request gets its own 4xx JSON error; the other requests of the batch are answered normally.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from servekit.handlers.common import RequestError, fail_request, freeze_heap, parse_each, registered_batch_size
from servekit.handlers.embedding_budget import DEFAULT_RESPONSE_TIMEOUT_S, WorkBudget, best_seconds, derive_budget
from servekit.handlers.embedding_requests import EmbeddingRequest, parse_embedding_request
from servekit.handlers.metrics import HandlerMetrics
from servekit.handlers.worker_io import install_buffered_reads
from servekit.optimizations.embed.runner import EmbeddingRunner
from servekit.optimizations.plan import parse_plan

log = logging.getLogger(__name__)


class EmbeddingHandler:
    def initialize(self, context: Any) -> None:
        props = context.system_properties
        model_dir = Path(props["model_dir"])
        self.model_name = context.model_name  # the registered name: the one clients use in URLs
        self.created = int(time.time())
        plan = parse_plan((context.model_yaml_config or {}).get("servekit"))
        gpu_id = props.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available() and plan.device != "cpu":
            torch.cuda.set_device(int(gpu_id))
            # Several workers share the host's cores and the GPU does the maths: per-worker thread
            # pools (torch's and the tokenizer's) only contend. Measured on an H100 with 4 workers:
            # 52 threads per worker and a p99 that jumped between windows; 6 and a steady p99.
            torch.set_num_threads(1)
            if plan.tokenizer_threads is None:
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if plan.tokenizer_threads is not None:
            # Before the first tokenization: the tokenizer's thread pool starts once per process.
            # Bulk requests (hundreds of texts per batch) tokenize ~1.9x faster on 2 threads than on
            # 1 (2-core VM, MiniLM, 512 texts of ~175 characters: 75 -> 40 us per text).
            os.environ["TOKENIZERS_PARALLELISM"] = "true" if plan.tokenizer_threads > 1 else "false"
            os.environ["RAYON_NUM_THREADS"] = str(plan.tokenizer_threads)
        self.runner = EmbeddingRunner(model_dir, plan)
        self.plan = self.runner.plan
        # The batch size the model was registered with (the management API may override the archive's).
        self.batch_size = registered_batch_size(context)
        self.dim = self.runner.dim
        timeout = float((context.model_yaml_config or {}).get("responseTimeout", DEFAULT_RESPONSE_TIMEOUT_S))
        self.budget = self._measure_budget(timeout)
        self.metrics = HandlerMetrics(context, self.model_name)
        self._segments_seen = (self.runner.segments.lookups, self.runner.segments.misses)  # reported so far
        self.metrics.emit("servekit_plan_info", "gauge", 1, Plan=self.plan.label())
        self.metrics.emit("servekit_recompiles", "gauge", 0)
        log.info("servekit plan %s ready: %s", self.plan.label(),
                 json.dumps({**self.runner.report(), "budget": self.budget.report(), "gc_frozen_objects": freeze_heap(),
                             "buffered_reads": install_buffered_reads()}))

    def _measure_budget(self, response_timeout_s: float) -> WorkBudget:
        """This worker's speeds, measured once after warm-up: embedding full-length inputs (one on
        CPU, where time grows with the batch; a full batch bucket elsewhere) and tokenizing text of
        words it has never seen (its segment cache does not help a hostile request either)."""
        runner = self.runner
        n = 1 if runner.device.type == "cpu" else max(runner.buckets.batch_sizes)
        seqs, _ = runner.wrap([runner.encode_texts(["the"])[0] * runner.max_tokens] * n)
        tokens_per_s = sum(map(len, seqs)) / best_seconds(lambda: runner.embed_ids(seqs))
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        texts = [" ".join("".join(rng.choice(letters, 7)) for _ in range(2500)) for _ in range(3)]
        unseen = iter(texts)  # a new text each run: no run finds the previous one's words cached
        chars_per_s = len(texts[0]) / best_seconds(lambda: runner.encode_texts([next(unseen)]), reps=len(texts))
        return derive_budget(tokens_per_s, chars_per_s, response_timeout_s, self.batch_size,
                             min_tokens=runner.max_tokens, min_chars=self.plan.limits.max_chars_per_text)

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str | bytes]:
        self.metrics.begin_batch()
        try:
            return self._handle(data, context)
        finally:
            self.metrics.flush()  # the batch's metric lines, errors included, in one write

    def _handle(self, data: list[dict[str, Any]], context: Any) -> list[str | bytes]:
        t0 = time.perf_counter()
        limits = self.plan.limits
        parse = partial(parse_embedding_request, dim=self.dim, max_texts=limits.max_texts_per_request,
                        max_chars=limits.max_chars_per_text, vocab_size=self.runner.vocab_size,
                        prompts=self.runner.spec.prompts)
        requests, given = parse_each(data, context, self.metrics, self.model_name, self.created, parse)
        answers: list[str | None] = [given.get(i) for i in range(len(data))]
        for i, req in list(requests.items()):  # before tokenizing: its time grows with the characters
            try:
                self.budget.check_chars("input" if req.openai else "text", sum(map(len, req.texts)))
            except RequestError as e:
                answers[i] = fail_request(context, i, self.metrics, e)
                del requests[i]
        ids, cut, spans = self._tokenize(requests)
        for i, (a, b) in list(spans.items()):
            try:
                self.budget.check_tokens(sum(len(ids[j]) for j in range(a, b)))
            except RequestError as e:
                answers[i] = fail_request(context, i, self.metrics, e)
                del spans[i]
        if limits.too_long == "reject":
            for i, (a, b) in list(spans.items()):
                if any(cut[a:b]):
                    k = next(j for j in range(a, b) if cut[j]) - a
                    answers[i] = fail_request(context, i, self.metrics, RequestError(
                        413, "invalid_request_error", f"input {k} is longer than the {self.runner.max_tokens} "
                        "tokens served", "input_too_long"))
                    del spans[i]
        kept = [j for a, b in spans.values() for j in range(a, b)]
        seqs = [ids[j] for j in kept]
        chunks = self.runner.chunks(seqs)
        t1 = time.perf_counter()
        try:
            vectors = self.runner.embed_ids(seqs, chunks).numpy() if seqs else np.zeros((0, self.dim), np.float32)
        except Exception as e:  # the batch failed on the device: retry request by request, keep the worker
            log.exception("inference failed for a batch of %d texts; retrying its %d requests one by one",
                          len(seqs), len(spans))
            if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            vectors, failed = self._embed_alone(ids, spans)
            for i, err in failed.items():
                answers[i] = fail_request(context, i, self.metrics, err)
                del spans[i]
            kept = [j for a, b in spans.values() for j in range(a, b)]
            seqs = [ids[j] for j in kept]
        t2 = time.perf_counter()
        row = {j: r for r, j in enumerate(kept)}
        n_tokens = 0
        for i, (a, b) in spans.items():
            req = requests[i]
            vecs = vectors[[row[j] for j in range(a, b)]]
            tokens = sum(len(ids[j]) for j in range(a, b))
            n_tokens += tokens
            context.set_response_content_type(i, "application/json")
            answers[i] = self._answer(req, vecs, tokens)
        t3 = time.perf_counter()
        self._emit_batch(len(data), len(seqs), n_tokens, chunks, (t0, t1, t2, t3))
        return [a if a is not None else "" for a in answers]

    def _tokenize(self, requests: dict[int, EmbeddingRequest]
                  ) -> tuple[list[list[int]], list[bool], dict[int, tuple[int, int]]]:
        """Model input ids of every input of the batch (texts tokenized in one call, each with its
        request's prompt; token arrays as given), which were cut, and each request's span of them."""
        runner = self.runner
        texts = [runner.prompt(r.prompt_name) + t for r in requests.values() if r.token_ids is None for t in r.texts]
        text_tokens = iter(runner.encode_texts(texts))
        tokens: list[list[int]] = []
        spans: dict[int, tuple[int, int]] = {}
        for i, req in requests.items():
            spans[i] = (len(tokens), len(tokens) + req.n_inputs)
            tokens.extend(req.token_ids if req.token_ids is not None else (next(text_tokens) for _ in req.texts))
        ids, cut = runner.wrap(tokens)
        return ids, cut, spans

    def _device_error(self, e: Exception) -> RequestError:
        oom = isinstance(e, torch.OutOfMemoryError)
        if oom and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return RequestError(507 if oom else 500, "server_error",
                            "out of memory for this request; retry with fewer or shorter texts" if oom
                            else f"inference failed: {type(e).__name__}", "out_of_memory" if oom else "inference_error")

    def _embed_alone(self, ids: list[list[int]], spans: dict[int, tuple[int, int]]
                     ) -> tuple[np.ndarray, dict[int, RequestError]]:
        """After a failed batch: each request's texts on their own, so only a request that fails alone gets an error.

        Returns the vectors of the requests that succeeded (in `spans` order) and the errors of the others.
        """
        parts, failed = [], {}
        for i, (a, b) in spans.items():
            try:
                parts.append(self.runner.embed_ids(ids[a:b]).numpy())
            except Exception as e:
                log.exception("inference failed for request %d of the batch (%d texts)", i, b - a)
                failed[i] = self._device_error(e)
        return (np.concatenate(parts) if parts else np.zeros((0, self.dim), np.float32)), failed

    def _answer(self, req: EmbeddingRequest, vecs: np.ndarray, tokens: int) -> bytes:
        return embedding_answer(req, vecs, tokens, self.model_name, self.runner.normalized)

    def _emit_batch(self, n_requests: int, n_texts: int, n_tokens: int, chunks: list, t: tuple) -> None:
        m = self.metrics
        t0, t1, t2, t3 = t
        m.emit("servekit_batches_total", "counter", 1)
        m.emit("servekit_requests_total", "counter", n_requests)
        m.emit("servekit_texts_total", "counter", n_texts)
        m.emit("servekit_tokens_total", "counter", n_tokens)
        computed = sum(c.batch * c.seq for c in chunks)
        m.emit("servekit_padded_tokens_total", "counter", computed - n_tokens)
        segments = self.runner.segments
        m.emit("servekit_tokenizer_segments_total", "counter", segments.lookups - self._segments_seen[0])
        m.emit("servekit_tokenizer_segment_misses_total", "counter", segments.misses - self._segments_seen[1])
        self._segments_seen = (segments.lookups, segments.misses)
        m.emit("servekit_padding_ratio", "histogram", (computed - n_tokens) / computed if computed else 0.0, "Ratio")
        m.emit("servekit_batch_fill_ratio", "histogram", min(1.0, n_requests / max(1, self.batch_size)), "Ratio")
        m.emit("servekit_preprocess_seconds", "histogram", t1 - t0, "Seconds")
        m.emit("servekit_inference_seconds", "histogram", t2 - t1, "Seconds")
        m.emit("servekit_postprocess_seconds", "histogram", t3 - t2, "Seconds")
        # Every request of the batch waited for the whole batch: one observation each.
        m.emit("servekit_request_latency_seconds", "histogram", t3 - t0, "Seconds", times=n_requests)
        m.emit("servekit_recompiles", "gauge", self.runner.recompiles())


def embedding_answer(req: EmbeddingRequest, vecs: np.ndarray, tokens: int, model_name: str, normalized: bool) -> bytes:
    """One request's JSON answer: its vectors ``(n, dim)`` (shortened to ``req.dimensions`` and, for a
    model whose output is unit length, normalised again), as floats or base64, in the OpenAI shape
    for ``/v1/embeddings`` requests."""
    if req.dimensions is not None and req.dimensions < vecs.shape[1]:
        # Matryoshka-style shortening: keep the first coordinates, and unit length where the
        # model's own output has it.
        vecs = vecs[:, :req.dimensions]
        if normalized:
            vecs = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
    # orjson writes float32 arrays directly: ~35x faster than json.dumps(vecs.tolist()), which
    # cost ~0.4 ms per 384-float answer of a worker's CPU time.
    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    if not req.openai:
        return orjson.dumps({"model": model_name, "embeddings": vecs}, option=orjson.OPT_SERIALIZE_NUMPY)
    if req.encoding_format == "base64":
        items: Any = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vecs]
    else:
        items = vecs
    return orjson.dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": k, "embedding": e} for k, e in enumerate(items)],
        "model": req.model or model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, option=orjson.OPT_SERIALIZE_NUMPY)
