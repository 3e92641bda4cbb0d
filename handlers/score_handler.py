"""TorchServe handler: cross-encoders (rerank, score) and sequence classifiers (classify, predict),
for any model `servekit archive` recognises as such; labels, activation and length limit come from
the model's own files (optimizations/models/classifier.py).

Routes and request shapes: handlers/score_requests.py; answers and truncation: docs/rerank.md.
Every input of a batch (pairs and single texts of every request) is tokenized in one call and run
in bucketed chunks together; a bad request gets its own 4xx JSON error and the others are answered.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import torch

from servekit.handlers.common import (RequestError, fail_request, models_requests, parse_each,
                                      registered_batch_size)
from servekit.handlers.metrics import HandlerMetrics, emit_batch
from servekit.handlers.score_requests import ScoreRequest, parse_score_request
from servekit.handlers.worker_io import install_buffered_reads
from servekit.optimizations.heap import freeze_heap
from servekit.optimizations.plan import parse_plan
from servekit.optimizations.score.runner import ScoreRunner

log = logging.getLogger(__name__)


class ScoreHandler:
    def initialize(self, context: Any) -> None:
        props = context.system_properties
        self.model_name = context.model_name
        self.created = int(time.time())
        plan = parse_plan((context.model_yaml_config or {}).get("servekit"))
        gpu_id = props.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available() and plan.device != "cpu":
            torch.cuda.set_device(int(gpu_id))
            torch.set_num_threads(1)  # several workers share the host's cores; the GPU does the maths
            if plan.tokenizer_threads is None:
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if plan.tokenizer_threads is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = "true" if plan.tokenizer_threads > 1 else "false"
            os.environ["RAYON_NUM_THREADS"] = str(plan.tokenizer_threads)
        self.runner = ScoreRunner(Path(props["model_dir"]), plan)
        self.plan = self.runner.plan
        self.spec = self.runner.spec
        self.batch_size = registered_batch_size(context)
        self.metrics = HandlerMetrics(context, self.model_name)
        self.metrics.emit("servekit_plan_info", "gauge", 1, Plan=self.plan.label())
        self.metrics.emit("servekit_recompiles", "gauge", 0)
        log.info("servekit plan %s ready: %s", self.plan.label(),
                 json.dumps({**self.runner.report(), "gc_frozen_objects": freeze_heap(),
                             "buffered_reads": install_buffered_reads()}))

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str | bytes]:
        self.metrics.begin_batch()
        try:
            return self._handle(data, context)
        finally:
            self.metrics.flush()

    def _handle(self, data: list[dict[str, Any]], context: Any) -> list[str | bytes]:
        t0 = time.perf_counter()
        limits = self.plan.limits
        parse = partial(parse_score_request, kind=self.spec.kind, max_texts=limits.max_texts_per_request,
                        max_chars=limits.max_chars_per_text)
        requests, given = parse_each(data, context, self.metrics, self.model_name, self.created, parse)
        answers: list[str | bytes | None] = [given.get(i) for i in range(len(data))]
        inputs: list[Any] = []
        spans: dict[int, tuple[int, int]] = {}
        for i, req in requests.items():
            spans[i] = (len(inputs), len(inputs) + len(req.inputs))
            inputs.extend(req.inputs)
        ids, types, cut = self.runner.tokenize(inputs)
        for i, (a, b) in list(spans.items()):
            if (limits.too_long == "reject" or not requests[i].truncate) and any(cut[a:b]):
                k = next(j for j in range(a, b) if cut[j]) - a
                answers[i] = fail_request(context, i, self.metrics, RequestError(
                    413, "invalid_request_error", f"input {k} is longer than the {self.runner.max_tokens} tokens "
                    "this model takes", "input_too_long"))
                del spans[i]
        kept = [j for a, b in spans.values() for j in range(a, b)]
        chunks = self.runner.chunks([ids[j] for j in kept])
        t1 = time.perf_counter()
        try:
            logits = self.runner.logits([ids[j] for j in kept], [types[j] for j in kept], chunks)
        except Exception as e:  # the batch failed on the device: retry request by request, keep the worker
            log.exception("inference failed for a batch of %d inputs; retrying its %d requests one by one",
                          len(kept), len(spans))
            logits = self._logits_alone(ids, types, spans, context, answers, e)
            kept = [j for a, b in spans.values() for j in range(a, b)]
        t2 = time.perf_counter()
        row = {j: r for r, j in enumerate(kept)}
        n_tokens = 0
        for i, (a, b) in spans.items():
            rows = [row[j] for j in range(a, b)]
            tokens = sum(len(ids[j]) for j in range(a, b))
            n_tokens += tokens
            context.set_response_content_type(i, "application/json")
            answers[i] = self._answer(requests[i], logits[rows], tokens)
        t3 = time.perf_counter()
        served = len(data) - models_requests(context, given)
        if served:  # a batch of the warm-up's models requests only: no batch of the model's
            self._emit_batch(served, len(kept), n_tokens, chunks, (t0, t1, t2, t3))
        return [a if a is not None else "" for a in answers]

    def _logits_alone(self, ids: list[list[int]], types: list[int], spans: dict[int, tuple[int, int]],
                      context: Any, answers: list, first: Exception) -> torch.Tensor:
        """After a failed batch: each request on its own; a request that fails alone gets its own error
        (and leaves `spans`). Returns the logits of the others, in `spans` order."""
        if isinstance(first, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        parts = []
        for i, (a, b) in list(spans.items()):
            try:
                parts.append(self.runner.logits(ids[a:b], types[a:b]))
            except Exception as e:
                log.exception("inference failed for request %d of the batch (%d inputs)", i, b - a)
                oom = isinstance(e, torch.OutOfMemoryError)
                answers[i] = fail_request(context, i, self.metrics, RequestError(
                    507 if oom else 500, "server_error", "out of memory for this request; retry with fewer documents"
                    if oom else f"inference failed: {type(e).__name__}", "out_of_memory" if oom else "inference_error"))
                del spans[i]
        return torch.cat(parts) if parts else torch.empty(0, len(self.spec.labels))

    def _answer(self, req: ScoreRequest, logits: torch.Tensor, tokens: int) -> bytes:
        return score_answer(req, logits, self.runner, self.model_name, tokens, self.created)

    def _emit_batch(self, n_requests: int, n_inputs: int, n_tokens: int, chunks: list, t: tuple) -> None:
        emit_batch(self.metrics, requests=n_requests, texts=n_inputs, tokens=n_tokens,  # texts: pairs for a cross-encoder
                   computed_tokens=sum(c.batch * c.seq for c in chunks), batch_size=self.batch_size, times=t,
                   recompiles=self.runner.recompiles())


def score_answer(req: ScoreRequest, logits: torch.Tensor, runner: ScoreRunner, model_name: str, tokens: int,
                 created: int) -> bytes:
    """One request's JSON answer from its inputs' logits (n, labels), in the shape its route defines."""
    spec = runner.spec
    scores = runner.scores(logits)
    model = req.model or model_name
    if req.shape in ("rerank", "tei_rerank"):
        values = (logits[:, 0] if req.raw_scores else scores).tolist()
        order = sorted(range(len(values)), key=lambda k: -values[k])[: req.top_n or len(values)]
        docs = [d for _, d in req.inputs]
        if req.shape == "tei_rerank":
            return orjson.dumps([{"index": k, "score": values[k], **({"text": docs[k]} if req.return_documents else {})}
                                 for k in order])
        return orjson.dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
                             "results": [{"index": k, "relevance_score": values[k],
                                          **({"document": {"text": docs[k]}} if req.return_documents else {})}
                                         for k in order]})
    if req.shape == "score":
        return orjson.dumps({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                             "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores.tolist())],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    # classify / predict: probabilities per label (a cross-encoder's one label: its score)
    probs = scores[:, None] if scores.dim() == 1 else scores
    if req.shape == "predict":
        shown = logits if req.raw_scores else probs
        per_text = [sorted(({"label": label, "score": v} for label, v in zip(spec.labels, row)), key=lambda x: -x["score"])
                    for row in shown.tolist()]
        return orjson.dumps(per_text[0] if req.single else per_text)
    best = probs.argmax(dim=1).tolist()
    raw = logits.tolist() if req.raw_scores else None
    return orjson.dumps({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
                         "data": [{"index": k, "label": spec.labels[best[k]], "probs": row,
                                   "num_classes": len(spec.labels), **({"logits": raw[k]} if raw else {})}
                                  for k, row in enumerate(probs.tolist())],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
