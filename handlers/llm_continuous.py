"""The LLM handler's serving loop under TorchServe's continuous batching (``continuousBatching: true``
in the model-config, the only way the LLM is served): requests join the running generation between
decode steps.

TorchServe 0.12's protocol: every call of the handler carries the requests in flight (those seen
before arrive again with their headers and no body) plus newly admitted ones (with their body), at
most ``batchSize`` in all; the handler answers each with the text produced since the last call and
says through ``context.stopping_criteria`` which ones are finished. Unfinished answers go to the
client as chunks (an empty one sends nothing), a finished one as the last chunk. A request whose
client went away is dropped by the frontend and simply no longer appears: its generation is
cancelled, and its slot free for the next request.

Generation itself runs in the engine process (``servekit.optimizations.llm.engine_process``), so
decode steps run back to back whatever the frontend's round trips cost, and on an interpreter
(GIL) of their own; a handler call only takes new requests in (parsed by handlers/llm_openai.py),
waits until some request has new tokens, and hands them to each request's ``Answer``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from servekit.handlers.common import (RequestError, device_error, fail_request, is_warm_up, models_requests,
                                      parse_each)
from servekit.handlers.llm_openai import Answer, LlmRequest, OpenAIApi
from servekit.handlers.metrics import NO_METRICS, HandlerMetrics
from servekit.optimizations.llm.continuous import FINISH_ERROR, SeqUpdate
from servekit.optimizations.llm.engine_process import EngineError, EngineProcess
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.grammar import GrammarError

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


def generation_error(e: Exception) -> RequestError:
    """A request's error for an exception its generation raised on the device (507 out of memory, else 500)."""
    return device_error(e, "retry with a shorter prompt or fewer tokens", "generation")


@dataclass
class _Live:
    rid: str
    req: LlmRequest
    answer: Answer
    t0: float  # when the handler took it in: TTFT and latency count from here
    error: RequestError | None = None
    answered: bool = False  # a chunk (the response head with it) went out already
    last: float = 0.0  # when the last tokens arrived
    counted: bool = True  # in the request metrics: all but the inference warm-up's requests


class ContinuousFrontend:
    """One worker's continuous-batching state: its engine and the requests in flight."""

    def __init__(self, engine: EngineProcess, api: OpenAIApi, metrics: HandlerMetrics) -> None:
        self.api, self.metrics, self.engine = api, metrics, engine
        positions = engine.ready.spec_positions  # counted by the engine; their increases go out with the gauges
        self._spec_sent = ((0,) * positions, (0,) * positions) if positions is not None else None
        self._prefix_sent = (0, 0)  # prompt tokens looked up and served by the prefix cache, as last emitted
        self.live: dict[str, _Live] = {}
        self._last_return = self._gauges_at = time.perf_counter()

    def warm_up(self, prompt: list[int], timeout: float = 120.0) -> float:
        """A greedy and a sampled request of ``prompt`` (cut to half the context) through the
        engine, 2 tokens each; returns the seconds they took. Every shape is built by the
        batcher's warm-up, but a fresh worker's first real prompt of a few hundred tokens still
        cost its handler ~2 ms more than later ones on an H100 (the first runs of the host paths
        around the captured graphs); this is that first prompt. Its prefix blocks stay cached
        like any request's."""
        t0 = time.perf_counter()
        prompt = prompt[:max(1, self.engine.shape.max_seq_len // 2)]
        keys = {("warm-up", 0): SamplingParams(max_tokens=2),
                ("warm-up", 1): SamplingParams(max_tokens=2, temperature=1.0)}
        for key, params in keys.items():
            self.engine.submit(key, prompt, params)
        left = set(keys)
        while left and time.perf_counter() - t0 < timeout:
            for key, u in self.engine.take(list(left), 1.0).items():
                if u.finish_reason is not None:
                    left.discard(key)
                    if u.error is not None:
                        log.warning("engine warm-up request failed: %s", u.error)
        for key in left:  # a stuck engine shows in the first requests' errors; the worker still starts
            self.engine.cancel(key)
            log.warning("engine warm-up request %s did not finish within %.0f s", key, timeout)
        return time.perf_counter() - t0

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        t0 = time.perf_counter()
        ids = [context.request_ids[i] for i in range(len(data))]
        present = set(ids)
        for rid in [r for r in self.live if r not in present]:  # the frontend dropped it: client gone
            self._cancel(self.live.pop(rid))
        running = {i for i, rid in enumerate(ids) if rid in self.live}
        prepared, answers = parse_each(data, context, self.metrics, self.api.model_name, self.api.created,
                                       self.api.prepare, skip=running,
                                       card_fields={"max_model_len": self.api.shape.max_seq_len,
                                                    "max_num_seqs": self.engine.ready.max_num_seqs})
        # The new requests' prompts in one tokenizer call: a burst of long prompts (TorchServe hands
        # over all that arrived together) would otherwise be tokenized one after another on this
        # thread, holding the GIL from the engine thread, before the first of them reached the engine.
        requests: dict[int, LlmRequest] = {}
        for i, got in self.api.tokenize(prepared).items():
            if isinstance(got, RequestError):
                answers[i] = fail_request(context, i, self.metrics, got)
            else:
                requests[i] = got
        warm_ups = 0
        for i, req in requests.items():
            live = self.live[ids[i]] = _Live(ids[i], req, self.api.answer(req, ids[i]), t0,
                                             counted=not is_warm_up(context, i))
            warm_ups += not live.counted
            if live.counted:
                self.metrics.emit("servekit_llm_prompt_tokens_total", "counter", req.prompt_tokens)
            for k, (prompt, params) in enumerate(req.choices):
                self.engine.submit((ids[i], k), prompt, params, req.speculate)
        keys = [(rid, k) for rid in present if rid in self.live for k in range(len(self.live[rid].req.choices))]
        # A call that took new requests in does not wait for their first tokens: the rest of a burst
        # waits in the frontend's queue until this call returns (TorchServe hands requests over
        # call by call), and a prefill longer than WAIT_S (an 8B model's burst) held each later
        # part of the burst back by all of it. Except on an idle engine for prompts that fit one
        # step's token budget: their first tokens come within a step or two (prefill_chunk), and
        # sending them with this call saves a lone request a round trip to the frontend and back;
        # a request arriving meanwhile joins the engine a step later, which it would have anyway.
        lone = len(self.live) == len(requests) and \
            sum(req.prompt_tokens * req.n for req in requests.values()) <= self.engine.max_num_batched_tokens
        updates = self.engine.take(keys, WAIT_S if keys and not answers and (not requests or lone) else 0)
        first_token = any(self.live[rid].answer.generated(k) == 0 for rid, k in updates)
        rest = self._last_return + min(MAX_PACE_S, PACE_PER_REQUEST_S * len(keys)) - time.perf_counter()
        if updates and not first_token and not answers and rest > 0:
            # Requests still waiting for their first token (taken in by this call or an earlier one)
            # end the wait when it comes: pacing spaces the chunks of running requests, never a TTFT.
            starting = [key for key in keys if self.live[key[0]].answer.generated(key[1]) == 0 and key not in updates]
            if starting:
                self.engine.wait(starting, rest)
            else:
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
            elif live.req.stream:
                stop[i], live.answered = False, True
            else:
                # A non-streamed request gets no intermediate response: TorchServe 0.12 would send
                # its 200 head with it, so a worker dying later could no longer answer it with a
                # 5xx (nor an out-of-memory error with a 507). Left out of request_ids, it gets no
                # reply from this call; the frontend sends it again with the next one.
                del context.request_ids[i]
        context.stopping_criteria = [lambda _, s=s: s for s in stop]
        m = self.metrics
        if time.perf_counter() - self._gauges_at >= GAUGE_INTERVAL_S or not self.live:
            # Calls come every few ms: gauges once a second (and when the last request ends) keep
            # the metric lines the frontend parses from growing with the call rate. The last
            # request gone, no call may come for a long while: wait for the engine to have taken
            # its cancellations in, so that these gauges are not left showing requests that ended.
            if not self.live:
                self.engine.settle(GAUGE_INTERVAL_S)
            m.emit("servekit_llm_running_seqs", "gauge", self.engine.gauges.running)
            m.emit("servekit_llm_waiting_seqs", "gauge", self.engine.gauges.waiting)
            m.emit("servekit_llm_kv_cache_usage", "gauge", round(self.engine.gauges.kv_usage, 4), "Percent")
            self._emit_spec_counts()
            self._emit_prefix_stats()
            self._gauges_at = time.perf_counter()
        # Neither the models API's requests nor the warm-up's chats are counted.
        served = len(requests) + len(answers) - models_requests(context, answers) - warm_ups
        if served:  # a call that took new requests in: one batch of TorchServe's
            m.emit("servekit_batches_total", "counter", 1)
            m.emit("servekit_requests_total", "counter", served)
        self._last_return = time.perf_counter()
        return out

    def _answer(self, i: int, live: _Live, updates: dict[tuple[str, int], SeqUpdate], context: Any
                ) -> tuple[str, bool]:
        """Request i's text since the last call and whether it is finished."""
        answer, chunk = live.answer, ""
        m = self.metrics if live.counted else NO_METRICS
        for k in range(len(live.req.choices)):
            u = updates.get((live.rid, k))
            if u is None:
                continue
            if u.finish_reason == FINISH_ERROR:
                live.error = live.error or self._engine_error(u.error)
                answer.fail(k)
                continue
            now = time.perf_counter()
            if answer.generated(k) and u.tokens:  # inter-token latency: this call's tokens share the time since the last
                m.emit("servekit_llm_itl_seconds", "histogram", (now - live.last) / len(u.tokens), "Seconds",
                       times=len(u.tokens))
            elif u.tokens:
                m.emit("servekit_llm_ttft_seconds", "histogram", now - live.t0, "Seconds")
            live.last = now
            text, ended = answer.add(k, u.tokens, u.finish_reason, u.logprobs or None, getattr(u, "cached_tokens", 0))
            chunk += text
            if answer.stopped(k) and u.finish_reason is None:
                self.engine.cancel((live.rid, k))  # a stop string matched: end the choice here
            if ended:
                m.emit("servekit_request_latency_seconds", "histogram", time.perf_counter() - live.t0, "Seconds")
        if live.error is not None:
            self._cancel(live)
            if not answer.started:  # nothing sent yet: a proper error answer
                return fail_request(context, i, m, live.error), True
            chunk += answer.error_event(live.error)
        finished = answer.finished
        if finished:
            m.emit("servekit_llm_completion_tokens_total", "counter", answer.completion_tokens)
        if live.req.stream:
            context.set_response_content_type(i, "text/event-stream")
            return (chunk + answer.end(), True) if finished else (chunk, False)
        context.set_response_content_type(i, "application/json")
        return (answer.end(), True) if finished else ("", False)

    def _emit_spec_counts(self) -> None:
        """Draft positions proposed and accepted since the last call, per draft position."""
        if self._spec_sent is None:  # no speculation
            return
        counts = self.engine.gauges.spec  # as of the engine's last report
        sent_p, sent_a = self._spec_sent
        if counts is None or counts[0][0] == sent_p[0]:
            return
        proposed, accepted = counts
        for pos in range(len(proposed)):
            self.metrics.emit("servekit_spec_proposed_total", "counter", proposed[pos] - sent_p[pos], Position=str(pos))
            self.metrics.emit("servekit_spec_accepted_total", "counter", accepted[pos] - sent_a[pos], Position=str(pos))
        self._spec_sent = (proposed, accepted)

    def _emit_prefix_stats(self) -> None:
        """Prompt tokens looked up and served by the prefix cache since the last call; its blocks now."""
        stats = self.engine.gauges.prefix  # as of the engine's last report
        if stats is None:  # prefix caching off
            return
        queried, hit = self._prefix_sent
        if stats.queried_tokens != queried:
            self.metrics.emit("servekit_llm_prefix_queried_tokens_total", "counter", stats.queried_tokens - queried)
            self.metrics.emit("servekit_llm_prefix_hit_tokens_total", "counter", stats.hit_tokens - hit)
            self._prefix_sent = (stats.queried_tokens, stats.hit_tokens)
        self.metrics.emit("servekit_llm_prefix_cache_usage", "gauge", round(stats.usage, 4), "Percent")
        self.metrics.emit("servekit_llm_prefix_cache_blocks", "gauge", stats.held_blocks)

    def _cancel(self, live: _Live) -> None:
        for k in range(len(live.req.choices)):
            if not live.answer.ended(k):
                self.engine.cancel((live.rid, k))

    @staticmethod
    def _engine_error(e: Exception | None) -> RequestError:
        if isinstance(e, EngineError):  # the worker exits and TorchServe starts a new one: worth a retry
            return RequestError(503, "server_error", f"{e}; the worker restarts, retry shortly", "engine_restarting")
        if isinstance(e, GrammarError):  # compiled by the engine: refused, or over the time limit
            return RequestError(400, "invalid_request_error", str(e), "invalid_grammar")
        if isinstance(e, ValueError):
            return RequestError(400, "invalid_request_error", str(e), "invalid_request")
        return generation_error(e if e is not None else RuntimeError("generation failed"))
