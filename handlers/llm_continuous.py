"""The LLM handler under TorchServe's continuous batching (``continuousBatching: true`` in the
model-config): requests join the running generation between decode steps.

TorchServe 0.12's protocol: every call of the handler carries the requests in flight (those seen
before arrive again with their headers and no body) plus newly admitted ones (with their body), at
most ``batchSize`` in all; the handler answers each with the text produced since the last call and
says through ``context.stopping_criteria`` which ones are finished. Unfinished answers go to the
client as chunks (an empty one sends nothing), a finished one as the last chunk. A request whose
client went away is dropped by the frontend and simply no longer appears: its generation is
cancelled, and its slot free for the next request.

Generation itself runs in the engine thread (``servekit.optimizations.llm.continuous.EngineThread``), so
decode steps run back to back whatever the frontend's round trips cost; a handler call only takes
new requests in, waits until some request has new tokens, and formats them. The OpenAI shapes,
limits and per-request errors are the static path's (``Generation``, ``LlmService.parse``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from servekit.handlers.common import RequestError, fail_request, parse_each
from servekit.optimizations.llm.continuous import FINISH_ERROR, ContinuousBatcher, EngineThread

log = logging.getLogger(__name__)

# How long a handler call waits for new tokens before answering with nothing new: the frontend
# sends the next call at once, so this only bounds how late a newly queued request is seen when no
# running request produces anything (never, while any decodes: a step takes milliseconds).
WAIT_S = 0.05
# Each handler call costs the worker Python time per request in it (TorchServe's message decoding
# and response encoding, formatting): with many requests running, a call per decode step would
# slow the steps down. A call then gathers tokens for up to this long per running request (capped),
# which sets how often chunks go out, not how fast tokens are made; a new request's first token
# is sent at once.
PACE_PER_REQUEST_S, MAX_PACE_S = 0.00025, 0.008
GAUGE_INTERVAL_S = 1.0


@dataclass
class _Live:
    rid: str
    req: Any  # llm_handler.LlmRequest
    gen: Any  # llm_handler.Generation of this one request
    error: RequestError | None = None
    answered: bool = False  # a chunk (the response head with it) went out already
    last: float = 0.0  # when the last tokens arrived


class ContinuousFrontend:
    """One worker's continuous-batching state: its engine thread and the requests in flight."""

    def __init__(self, service: Any, generation: Callable[..., Any], device_error: Callable[[Exception], RequestError]
                 ) -> None:
        """``service``: the ``LlmService``; ``generation(service, {0: request}, context, t0)``: its
        ``Generation``; ``device_error``: how a failed generation is answered."""
        self.s, self._generation, self._device_error = service, generation, device_error
        plan = service.plan
        batcher = ContinuousBatcher(service.runner, service.batch_size, plan.prefill_chunk, plan.max_num_batched_tokens)
        built = batcher.warmup()
        log.info("continuous batching: packed prefill (%s attention, %s layers, %s) over token buckets %s built in "
                 "%.1f s", built["attention"], "compiled" if built["compiled"] else "eager",
                 "CUDA graphs" if built["graphs"] else "no graphs", built["token_buckets"], built["seconds"])
        self.engine = EngineThread(batcher, service.runner.device)
        stats = batcher.spec_stats  # counted by the engine thread; their increases go out with the gauges
        self._spec_sent = ([0] * len(stats.proposed), [0] * len(stats.accepted)) if stats is not None else None
        self.live: dict[str, _Live] = {}
        self._last_return = self._gauges_at = time.perf_counter()

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        t0 = time.perf_counter()
        ids = [context.request_ids[i] for i in range(len(data))]
        present = set(ids)
        for rid in [r for r in self.live if r not in present]:  # the frontend dropped it: client gone
            self._cancel(self.live.pop(rid))
        running = {i for i, rid in enumerate(ids) if rid in self.live}
        requests, answers = parse_each(data, context, self.s.metrics, self.s.model_name, self.s.created,
                                       self.s.parse, skip=running)
        for i, req in requests.items():
            gen = self._generation(self.s, {0: req}, context, t0)
            for row in gen.rows:
                row.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{ids[i]}"
            self.live[ids[i]] = _Live(ids[i], req, gen)
            self.s.metrics.emit("servekit_llm_prompt_tokens_total", "counter", req.prompt_tokens)
            for k, (prompt, params) in enumerate(req.choices):
                self.engine.submit((ids[i], k), prompt, params, req.speculate)
        keys = [(rid, k) for rid in present if rid in self.live for k in range(len(self.live[rid].req.choices))]
        updates = self.engine.take(keys, 0 if answers or not keys else WAIT_S)
        first_token = any(self.live[rid].gen.rows[k].tokens == 0 for rid, k in updates)
        rest = self._last_return + min(MAX_PACE_S, PACE_PER_REQUEST_S * len(keys)) - time.perf_counter()
        if updates and not first_token and not answers and rest > 0:
            time.sleep(rest)
            for key, u in self.engine.take(keys, 0).items():
                updates[key] = u if key not in updates else updates[key].merge(u)
        out = [answers.get(i, "") for i in range(len(data))]
        # TorchServe 0.12 loses a response whose first part is marked as its last (it never sends
        # the HTTP head): a request answered in one go is marked neither way (None: a plain full
        # response), one that streamed before ends with True, one still running gets False.
        stop: list[bool | None] = [None] * len(data)
        for i, rid in enumerate(ids):
            live = self.live.get(rid)
            if live is None or i in answers:
                continue
            out[i], finished = self._answer(i, live, updates, context)
            if finished:
                stop[i] = True if live.answered else None
                del self.live[rid]
            else:
                stop[i], live.answered = False, True
        context.stopping_criteria = [lambda _, s=s: s for s in stop]
        m = self.s.metrics
        if time.perf_counter() - self._gauges_at >= GAUGE_INTERVAL_S or not self.live:
            # Calls come every few ms: gauges once a second (and when the last request ends) keep
            # the metric lines the frontend parses from growing with the call rate. The last
            # request gone, no call may come for a long while: wait for the engine to have taken
            # its cancellations in, so that these gauges are not left showing requests that ended.
            if not self.live:
                self.engine.settle(GAUGE_INTERVAL_S)
            m.emit("servekit_llm_running_seqs", "gauge", self.engine.running)
            m.emit("servekit_llm_waiting_seqs", "gauge", self.engine.waiting)
            m.emit("servekit_llm_kv_cache_usage", "gauge", round(self.engine.kv_usage, 4), "Percent")
            self._emit_spec_counts()
            self._gauges_at = time.perf_counter()
        if requests:
            m.emit("servekit_requests_total", "counter", len(requests) + len(answers))
        self._last_return = time.perf_counter()
        return out

    def _answer(self, i: int, live: _Live, updates: dict, context: Any) -> tuple[str, bool]:
        """Request i's text since the last call and whether it is finished."""
        gen, chunk, rid = live.gen, "", live.rid
        for k, row in enumerate(gen.rows):
            u = updates.get((rid, k))
            if u is None:
                continue
            if u.finish_reason == FINISH_ERROR:
                live.error = live.error or self._engine_error(u.error)
                row.finish = FINISH_ERROR
                continue
            now = time.perf_counter()
            if row.tokens and u.tokens:  # inter-token latency: this call's tokens share the time since the last
                self.s.metrics.emit("servekit_llm_itl_seconds", "histogram", (now - live.last) / len(u.tokens),
                                    "Seconds", times=len(u.tokens))
            live.last = now
            delta, reason = gen._push(row, u.tokens, u.finish_reason, u.logprobs or None)
            if row.text.stopped and u.finish_reason is None:
                self.engine.cancel((rid, k))  # a stop string matched: end the row here
            if reason is not None:
                row.finish = reason
                self.s.metrics.emit("servekit_request_latency_seconds", "histogram",
                                    time.perf_counter() - gen.t0, "Seconds")
            if live.req.stream:
                if delta or reason is not None:
                    chunk += gen._sse(row, delta, reason)
            else:
                row.pieces.append(delta)
        if live.error is not None:
            self._cancel(live)
            if not any(r.started for r in gen.rows):  # nothing sent yet: a proper error answer
                return fail_request(context, i, self.s.metrics, live.error), True
            # A stream under way cannot change its status: the error goes in the stream, then it ends.
            chunk += f"data: {live.error.body()}\n\n"
            for row in gen.rows:
                row.finish = row.finish or "error"
        finished = all(r.finish is not None for r in gen.rows)
        if finished:
            self.s.metrics.emit("servekit_llm_completion_tokens_total", "counter", sum(r.tokens for r in gen.rows))
        if live.req.stream:
            context.set_response_content_type(i, "text/event-stream")
            if finished:
                chunk += gen._sse_end(0)
            return chunk, finished
        context.set_response_content_type(i, "application/json")
        return (gen._answer(0), True) if finished else ("", False)

    def _emit_spec_counts(self) -> None:
        """Draft positions proposed and accepted since the last call, per draft position."""
        if self._spec_sent is None:  # no speculation
            return
        stats = self.engine.batcher.spec_stats
        sent_p, sent_a = self._spec_sent
        proposed, accepted = list(stats.proposed), list(stats.accepted)  # a snapshot: the engine counts on
        if proposed[0] == sent_p[0]:
            return
        m = self.s.metrics
        for pos in range(len(proposed)):
            m.emit("servekit_spec_proposed_total", "counter", proposed[pos] - sent_p[pos], Position=str(pos))
            m.emit("servekit_spec_accepted_total", "counter", accepted[pos] - sent_a[pos], Position=str(pos))
        self._spec_sent = (proposed, accepted)

    def _cancel(self, live: _Live) -> None:
        for k, row in enumerate(live.gen.rows):
            if row.finish is None:
                self.engine.cancel((live.rid, k))


    def _engine_error(self, e: Exception | None) -> RequestError:
        if isinstance(e, ValueError):
            return RequestError(400, "invalid_request_error", str(e), "invalid_request")
        return self._device_error(e if e is not None else RuntimeError("generation failed"))
