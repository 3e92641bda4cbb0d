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

from servekit.handlers.common import (RequestError, device_error, fail_request, parse_each,
                                      models_requests, registered_batch_size)
from servekit.handlers.embedding_budget import DEFAULT_RESPONSE_TIMEOUT_S, WorkBudget, derive_budget
from servekit.handlers.embedding_requests import EmbeddingRequest, parse_embedding_request
from servekit.handlers.metrics import HandlerMetrics, emit_batch
from servekit.handlers.worker_io import install_buffered_reads
from servekit.optimizations.embed.runner import Batch, EmbeddingRunner, Inputs, Refusal
from servekit.optimizations.heap import freeze_heap
from servekit.optimizations.plan import parse_plan

log = logging.getLogger(__name__)
OOM_ADVICE = "retry with fewer or shorter texts"


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
        if plan.threads is not None:
            torch.set_num_threads(plan.threads)
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
        """Per-request limits from this worker's speeds, measured once after warm-up."""
        tokens_per_s, chars_per_s = self.runner.measure_speed()
        return derive_budget(tokens_per_s, chars_per_s, response_timeout_s, self.batch_size,
                             min_tokens=self.runner.max_tokens, min_chars=self.plan.limits.max_chars_per_text)

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
        batch = self.runner.encode({i: Inputs(r.texts, r.token_ids, r.prompt_name) for i, r in requests.items()},
                                   reject_too_long=limits.too_long == "reject",
                                   max_request_tokens=self.budget.tokens_per_request)
        for i, refusal in batch.refused.items():
            answers[i] = fail_request(context, i, self.metrics, self._refusal_error(refusal))
        t1 = time.perf_counter()
        try:
            vectors: dict = self.runner.embed_batch(batch)
        except Exception as e:  # the batch failed on the device: retry request by request, keep the worker
            log.exception("inference failed for a batch of %d texts; retrying its %d requests one by one",
                          len(batch.ids), len(batch.spans))
            if isinstance(e, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            vectors = {}
            for i, got in self.runner.embed_each(batch).items():
                if isinstance(got, Exception):
                    answers[i] = fail_request(context, i, self.metrics, device_error(got, OOM_ADVICE, "inference"))
                else:
                    vectors[i] = got
        t2 = time.perf_counter()
        for i, vecs in vectors.items():
            context.set_response_content_type(i, "application/json")
            answers[i] = self._answer(requests[i], vecs, batch.tokens[i])
        t3 = time.perf_counter()
        served = len(data) - models_requests(context, given)
        if served:  # a batch of the warm-up's models requests only: no batch of the model's
            self._emit_batch(served, batch, vectors, (t0, t1, t2, t3))
        return [a if a is not None else "" for a in answers]

    def _refusal_error(self, refusal: Refusal) -> RequestError:
        if refusal.reason == "too_long":
            return RequestError(413, "invalid_request_error", f"input {refusal.index} is longer than the "
                                f"{self.runner.max_tokens} tokens served", "input_too_long")
        return self.budget.tokens_error(refusal.tokens)

    def _answer(self, req: EmbeddingRequest, vecs: np.ndarray, tokens: int) -> bytes:
        return embedding_answer(req, vecs, tokens, self.model_name, self.runner.normalized)

    def _emit_batch(self, n_requests: int, batch: Batch, answered: dict, t: tuple) -> None:
        segments = self.runner.segments
        self.metrics.emit("servekit_tokenizer_segments_total", "counter", segments.lookups - self._segments_seen[0])
        self.metrics.emit("servekit_tokenizer_segment_misses_total", "counter", segments.misses - self._segments_seen[1])
        self._segments_seen = (segments.lookups, segments.misses)
        emit_batch(self.metrics, requests=n_requests, texts=sum(batch.spans[i][1] - batch.spans[i][0] for i in answered),
                   tokens=sum(batch.tokens[i] for i in answered), computed_tokens=batch.computed_tokens,
                   batch_size=self.batch_size, times=t, recompiles=self.runner.recompiles())


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
