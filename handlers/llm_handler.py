"""TorchServe handler: OpenAI-compatible chat and text completions for a Llama-architecture LLM.

Routes (TorchServe passes the suffix after /predictions/<model>/<version>/ in `url_path`):
  POST /predictions/<model>/<version>/v1/chat/completions   OpenAI chat completions
  POST /predictions/<model>/<version>/v1/completions        OpenAI text completions
Both answer as one JSON, or with "stream": true as server-sent events (`data: {...}` chunks sent
with TorchServe's intermediate responses, ending with `data: [DONE]`).

The requests TorchServe batches together are generated as one batch (servekit.optimizations.llm.generate):
each row stops on its own (stop token, stop string, max_tokens), a streaming row gets its chunks
as soon as each decode step ends, and one bad request gets its own 4xx JSON error while the others
are answered. A row whose stream has ended keeps its HTTP response open until the batch is done
(TorchServe's last chunk is the handler's return value); clients stop reading at `[DONE]`.

TorchServe calls the module-level `handle` (a function entry point: this module defines more than
one class, which TorchServe's class entry point does not allow).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from servekit.handlers.common import (RequestError, clip, decode_body, device_error, fail_request, freeze_heap,
                                      int_field, number_field, parse_each, registered_batch_size, shown, without_nulls)
from servekit import __version__
from servekit.handlers.llm_continuous import ContinuousFrontend
from servekit.handlers.llm_openai_tools import (ToolPlan, parse_extras, template_messages, tool_message,
                                                tool_stream_events)
from servekit.handlers.metrics import HandlerMetrics
from servekit.handlers.worker_io import install_buffered_reads
from servekit.optimizations.llm.chat_template import ChatTokenizer, IncrementalDetokenizer, TemplateError
from servekit.optimizations.llm.generate import (FINISH_STOP, PENALTY_RANGE, TEMPERATURE_RANGE, LlamaRunner,
                                             SamplingParams, TokenLogprob)
from servekit.optimizations.llm.grammar import GrammarCompiler
from servekit.optimizations.llm.sampling import TOP_LOGPROBS
from servekit.optimizations.llm.plan import LlmPlan, load_llm_runner, parse_llm_plan, stop_token_ids
from servekit.optimizations.plan import PlanError
from servekit.optimizations.llm.speculative import SpecStats

log = logging.getLogger(__name__)

CHAT_ROUTE, COMPLETIONS_ROUTE = "v1/chat/completions", "v1/completions"
# OpenAI request fields, all accepted when null (= absent). Those with no effect here are accepted
# with any value: `user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls` (meaningful
# only with tools); the rest are checked below, and those whose semantics are not implemented get a
# 400 naming them unless they hold their no-op value.
COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "stream_options", "stop",
               "n", "user", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias",
               "speculate", "metadata", "store", "service_tier", "suffix", "echo", "best_of"}
COMMON_KEYS |= {"min_tokens", "structured_outputs", "response_format"}  # handlers/llm_openai_tools.py
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "response_format", "tools", "tool_choice",
                           "parallel_tool_calls", "functions", "function_call", "modalities", "audio", "prediction",
                           "reasoning_effort", "web_search_options"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
# Message fields the SDK's own response objects carry (`message.model_dump()`): accepted when null
# or empty, since a multi-turn conversation sends the assistant's message back as it came.
MESSAGE_KEYS = {"role", "content", "name", "refusal", "annotations", "audio", "function_call", "tool_calls",
                "tool_call_id"}
MAX_STOP_STRINGS = 4
# Characters read per token of the prompt limit before tokenizing: generous (byte-level BPE tokens run to a
# few characters; whitespace runs and repeated symbols to a few dozen), and small enough that tokenizing
# the largest prompt admitted takes a fraction of a second.
MAX_CHARS_PER_TOKEN = 32
SEED_RANGE = (-2**63, 2**64 - 1)  # OpenAI's seed is a 64-bit integer; it is reduced mod 2**32
COMPLETION_LOGPROBS_MAX = 5  # /v1/completions' integer `logprobs` (OpenAI's limit); chat allows TOP_LOGPROBS


@dataclass
class LlmRequest:
    """One valid request: its choices, each a (prompt, sampling) row of the batch. Choice k of
    prompt p is row p * n + k (OpenAI's order for a list of prompts with `n`)."""
    chat: bool
    choices: list[tuple[list[int], SamplingParams]]
    prompt_tokens: int  # each prompt counted once, whatever n
    stream: bool
    include_usage: bool
    stop: list[str]
    model: str | None
    speculate: bool = True  # servekit extension: false keeps this request from speculative decoding
    tools: ToolPlan | None = None  # tool calls are parsed out of the answer (handlers/llm_openai_tools.py)


def _bad(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, "invalid_request_error", message, code)


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"'{where}[{k}]' must be a text part {{\"type\": \"text\", \"text\": ...}}, got {shown(kind)}",
                           "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"'{where}' must be a string or a list of text parts, got {type(content).__name__}", "invalid_type")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise _bad(f"'messages' must be a list, got {type(value).__name__}", "invalid_type")
    if not value:
        raise _bad("'messages' is empty: give at least one message", "empty_messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _bad(f"'messages[{i}]' must be an object, got {type(m).__name__}", "invalid_type")
        m = {k: v for k, v in without_nulls(m).items() if v != []}  # null and [] (annotations, tool_calls): absent
        unknown = sorted(set(m) - MESSAGE_KEYS)
        if unknown:
            raise _bad(f"'messages[{i}].{clip(unknown[0])}' is not supported", "unknown_field")
        for key in ("audio", "function_call"):
            if key in m:
                raise _bad(f"'messages[{i}].{key}' is not supported (no audio or legacy functions here)",
                           "unsupported_value")
        if "tool_calls" in m and "content" not in m:  # an assistant's tool calls alone
            m["content"] = ""
        if m.get("role") == "assistant" and "content" not in m and isinstance(m.get("refusal"), str):
            m["content"] = m["refusal"]
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"'messages[{i}].role' must be one of {', '.join(sorted(ROLES))}, got {shown(role)}", "invalid_value")
        if "content" not in m:
            raise _bad(f"'messages[{i}].content' is missing", "missing_field")
        # The chat template knows system/user/assistant; "developer" is OpenAI's newer name for system.
        out.append({"role": "system" if role == "developer" else role,
                    "content": _text_content(m["content"], f"messages[{i}].content"), **template_messages(m, i)})
    return out


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("'stop' must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS}", "invalid_value")
    return stops


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives to report per token, or None for no logprobs. Chat: `logprobs`
    true/false and `top_logprobs` 0..20 (only with logprobs, as OpenAI says); completions: the
    legacy integer `logprobs` 0..5."""
    if not chat:
        if "top_logprobs" in body:
            raise _bad("'top_logprobs' is a chat field; /v1/completions takes an integer 'logprobs'", "unknown_field")
        return int_field(body, "logprobs", 0, COMPLETION_LOGPROBS_MAX)
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise _bad("'logprobs' must be true or false", "invalid_type")
    top = int_field(body, "top_logprobs", 0, TOP_LOGPROBS)
    if top is not None and not wanted:
        raise _bad("'top_logprobs' needs \"logprobs\": true", "invalid_value")
    return (top or 0) if wanted else None


def _unsupported(body: dict) -> None:
    """Fields whose semantics are not implemented: accepted only at their no-op value (nulls are
    gone already), each other value a 400 naming the field rather than silently ignored."""
    noop = {"functions": [], "function_call": "none", "modalities": ["text"], "suffix": "", "echo": False,
            "best_of": 1}
    for key, value in noop.items():
        if key in body and body[key] != value:
            raise _bad(f"'{key}' is not supported (only {json.dumps(value)})", "unsupported_value")
    for key in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if key in body:
            raise _bad(f"'{key}' is not supported", "unsupported_value")
    for key in ("model", "user", "service_tier"):
        if key in body and not isinstance(body[key], str):
            raise _bad(f"'{key}' must be a string", "invalid_type")
    if "metadata" in body and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "invalid_type")
    for key in ("store", "parallel_tool_calls"):
        if key in body and not isinstance(body[key], bool):
            raise _bad(f"'{key}' must be true or false", "invalid_type")


class LlmService:
    """State of one worker: the runner, tokenizer, plan and metrics."""

    def __init__(self) -> None:
        self.initialized = False

    def initialize(self, context: Any) -> None:
        props = context.system_properties
        model_dir = props["model_dir"]
        self.model_name = context.model_name  # the registered name: the one clients use in URLs
        self.created = int(time.time())
        config = context.model_yaml_config or {}
        plan = parse_llm_plan(config.get("servekit"))
        gpu_id = props.get("gpu_id")
        if gpu_id is not None and torch.cuda.is_available() and plan.device != "cpu":
            torch.cuda.set_device(int(gpu_id))
        t0 = time.perf_counter()
        self.runner: LlamaRunner
        self.plan: LlmPlan
        self.runner, self.plan, downgrades = load_llm_runner(model_dir, plan, bool(config.get("continuousBatching")))
        for msg in downgrades:
            log.warning("plan downgraded (fallback: eager): %s", msg)
        self.batch_size = registered_batch_size(context)
        if self.batch_size > self.runner.max_batch:
            raise PlanError(f"batchSize {self.batch_size} exceeds servekit.buckets.batch_sizes' largest "
                            f"bucket {self.runner.max_batch}")
        self.tokenizer = ChatTokenizer(model_dir)
        self.stop_ids = stop_token_ids(model_dir, self.tokenizer)
        self.grammar = GrammarCompiler(self.tokenizer, self.runner.model.config.vocab_size, tuple(self.stop_ids))
        self.metrics = HandlerMetrics(context, self.model_name)
        self.metrics.emit("servekit_plan_info", "gauge", 1, Plan=self.plan.label())
        # OpenAI's system_fingerprint names the backend configuration: servekit's version and plan.
        self.fingerprint = f"servekit-{__version__}-{self.plan.label()}"
        # continuousBatching (TorchServe's own key): requests join the running batch, at most
        # batchSize at a time (handlers/llm_continuous.py); otherwise each batch runs to its end.
        self.continuous: ContinuousFrontend | None = None
        if config.get("continuousBatching"):
            self.continuous = ContinuousFrontend(self, Generation, generation_error)
        install_buffered_reads()
        log.info("servekit LLM plan %s ready in %.1f s (gc_frozen_objects %d): %s", self.plan.label(),
                 time.perf_counter() - t0, freeze_heap(), json.dumps(self.runner.plan))
        self.initialized = True

    # -- requests ------------------------------------------------------------------------------
    def parse(self, raw: dict[str, Any], route: str) -> LlmRequest:
        if route not in (CHAT_ROUTE, COMPLETIONS_ROUTE):
            raise RequestError(404, "not_found_error", f"unknown route '{route}'; use /v1/chat/completions or "
                               "/v1/completions under /predictions/<model>/<version>/", "unknown_route")
        chat = route == CHAT_ROUTE
        body = decode_body(raw)
        if not isinstance(body, dict):
            raise _bad(f"body must be a JSON object, got {type(body).__name__}", "invalid_type")
        body = without_nulls(body)
        unknown = sorted(set(body) - (CHAT_KEYS if chat else COMPLETION_KEYS))
        if unknown:
            raise _bad(f"unknown field {shown(unknown[0])}", "unknown_field")
        _unsupported(body)
        extras = parse_extras(body, chat, self.grammar, self.runner.model.config.vocab_size,
                              self.tokenizer.template_source, self.continuous is not None)
        if chat:
            if "messages" not in body:
                raise _bad("missing required field 'messages'", "missing_field")
            messages = _messages(body["messages"])
            self._check_chars("messages", sum(len(m["content"]) for m in messages))
            try:
                prompt = self.tokenizer.encode_chat(messages, tools=extras.tools)
            except TemplateError as e:
                raise _bad(str(e), "invalid_messages") from None
            prompts = [prompt]
        else:
            texts = body.get("prompt")
            texts = [texts] if isinstance(texts, str) else texts
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise _bad("'prompt' must be a string or a non-empty list of strings", "invalid_type")
            for k, t in enumerate(texts):
                self._check_chars("prompt" if len(texts) == 1 else f"prompt[{k}]", len(t))
            prompts = [self.tokenizer.encode_prompt(t) for t in texts]
            if not all(prompts):
                raise _bad("'prompt' is empty" if len(prompts) == 1 else
                           f"'prompt[{[bool(p) for p in prompts].index(False)}]' is empty", "empty_prompt")
        n = int_field(body, "n", 1, self.runner.max_batch, 1)
        if len(prompts) * n > self.runner.max_batch:
            raise _bad(f"{len(prompts)} prompt(s) x n={n} = {len(prompts) * n} choices; at most "
                       f"{self.runner.max_batch} per request", "too_many_choices")
        choices = []
        for prompt in prompts:
            params = self._params(body, chat, len(prompt))
            for k in range(n):  # a seeded request's choices differ: choice k samples with seed + k
                seed = None if params.seed is None else (params.seed + k) % 2**32
                choices.append((prompt, dataclasses.replace(params, seed=seed, constraint=extras.constraint)))
        speculate = body.get("speculate", True)
        if not isinstance(speculate, bool):
            raise _bad("'speculate' must be true or false", "invalid_type")
        return LlmRequest(chat, choices, sum(len(p) for p in prompts), *self._stream_flags(body),
                          _stop(body.get("stop")), body.get("model"), speculate, extras.plan)

    def _check_chars(self, field: str, n_chars: int) -> None:
        """Before tokenizing: a prompt longer than MAX_CHARS_PER_TOKEN characters per token the model
        accepts cannot fit, and tokenizing megabytes stalls the worker (and, under continuous
        batching, every running stream) for seconds; refused at once instead."""
        limit = self.runner.max_prompt_len * MAX_CHARS_PER_TOKEN
        if n_chars > limit:
            raise RequestError(413, "invalid_request_error", f"'{field}' has {n_chars} characters; at most {limit} "
                               f"are read ({MAX_CHARS_PER_TOKEN} per token of the {self.runner.max_prompt_len}-token "
                               "prompt limit)", "context_length_exceeded")

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _bad("'stream' must be true or false", "invalid_type")
        opts = body.get("stream_options")
        if opts is None:
            return bool(stream), False
        if not stream:
            raise _bad("'stream_options' is only allowed with \"stream\": true", "invalid_value")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(opts.get("include_usage", False), bool):
            raise _bad("'stream_options' must be {\"include_usage\": true|false}", "invalid_type")
        return True, bool(opts.get("include_usage", False))

    def _params(self, body: dict, chat: bool, prompt_len: int) -> SamplingParams:
        limits, max_seq = self.plan.limits, self.runner.max_seq_len
        longest = self.runner.max_prompt_len
        if prompt_len > longest:
            raise _bad(f"the prompt has {prompt_len} tokens; this model accepts at most {longest}",
                       "context_length_exceeded")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = int_field(body, key, 1, limits.max_tokens)
        if max_tokens is None:
            max_tokens = min(limits.default_max_tokens, max_seq - prompt_len)
        elif prompt_len + max_tokens > max_seq:
            raise _bad(f"the prompt ({prompt_len} tokens) plus '{key}' ({max_tokens}) exceeds the context of "
                       f"{max_seq} tokens", "context_length_exceeded")
        top_k = int_field(body, "top_k", -1, 2**31 - 1)  # -1 and 0: off; above the vocabulary: all of it
        seed = int_field(body, "seed", *SEED_RANGE)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=number_field(body, "temperature", 1.0, *TEMPERATURE_RANGE),
            top_p=number_field(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=max(top_k or 0, 0),
            seed=None if seed is None else seed % 2**32,
            stop_token_ids=self.stop_ids,
            presence_penalty=number_field(body, "presence_penalty", 0.0, *PENALTY_RANGE),
            frequency_penalty=number_field(body, "frequency_penalty", 0.0, *PENALTY_RANGE),
            logprobs=_logprobs(body, chat))

    # -- the batch -----------------------------------------------------------------------------
    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        if self.continuous is not None:
            return self.continuous.handle(data, context)
        t0 = time.perf_counter()
        requests, answers = parse_each(data, context, self.metrics, self.model_name, self.created, self.parse)
        # Requests go to the runner in chunks of at most max_batch rows (choices), in arrival order.
        chunk: dict[int, LlmRequest] = {}
        for i, req in requests.items():
            if chunk and sum(len(r.choices) for r in chunk.values()) + len(req.choices) > self.runner.max_batch:
                answers.update(self._generate(chunk, context, t0))
                chunk = {}
            chunk[i] = req
        if chunk:
            answers.update(self._generate(chunk, context, t0))
        self.metrics.emit("servekit_batches_total", "counter", 1)
        self.metrics.emit("servekit_requests_total", "counter", len(data))
        self.metrics.emit("servekit_batch_fill_ratio", "histogram", min(1.0, len(data) / max(1, self.batch_size)),
                          "Ratio")
        return [answers.get(i, "") for i in range(len(data))]

    def _generate(self, chunk: dict[int, LlmRequest], context: Any, t0: float) -> dict[int, str]:
        """Answers of one batch. If generation fails (out of memory, ...), the requests that have not
        streamed anything yet are generated again one by one, so only one that fails alone gets the
        5xx; a request whose stream had begun gets the error (its chunks cannot be taken back)."""
        gen = Generation(self, chunk, context, t0)
        try:
            return gen.run()
        except Exception as e:  # the worker lives on
            log.exception("generation failed for a batch of %d requests", len(chunk))
            err = generation_error(e)
        started = {row.idx for row in gen.rows if row.started}
        out = {i: fail_request(context, i, self.metrics, err) for i in chunk if i in started or len(chunk) == 1}
        for i in chunk:
            if i not in out:
                out.update(self._generate({i: chunk[i]}, context, t0))
        return out


def generation_error(e: Exception) -> RequestError:
    """A request's error for an exception its generation raised on the device (507 out of memory, else 500)."""
    return device_error(e, "retry with a shorter prompt or fewer tokens", "generation")


@dataclass
class _Row:
    idx: int  # the request's index in TorchServe's batch
    choice: int  # its choice index in the answer
    req: LlmRequest
    text: IncrementalDetokenizer
    id: str
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    finish: str | None = None
    started: bool = False
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # all of them (a JSON answer)
    pending: list[dict[str, Any]] = field(default_factory=list)  # not sent yet (a stream)
    offset: int = 0  # characters of the tokens' texts so far: the legacy text_offset


class Generation:
    """One batch of valid requests through the runner: streams chunks, returns the final answers."""

    def __init__(self, service: LlmService, requests: dict[int, LlmRequest], context: Any, t0: float) -> None:
        self.s, self.context, self.t0 = service, context, t0
        self.created = int(time.time())
        self.rows: list[_Row] = []  # the batch's rows, in the runner's order
        self.by_request: dict[int, list[_Row]] = {}  # a request's rows, by choice index
        for i, req in requests.items():
            rid = (context.get_request_id(i) or str(i)) if hasattr(context, "get_request_id") else str(i)
            self.by_request[i] = [_Row(i, k, req, IncrementalDetokenizer(service.tokenizer, req.stop),
                                       f"{'chatcmpl' if req.chat else 'cmpl'}-{rid}") for k in range(len(req.choices))]
            self.rows += self.by_request[i]
        self.done: set[int] = set()  # requests whose stream has ended ([DONE] sent)

    def run(self) -> dict[int, str]:
        m, runner = self.s.metrics, self.s.runner
        prompts = [r.req.choices[r.choice][0] for r in self.rows]
        params = [r.req.choices[r.choice][1] for r in self.rows]
        stream = runner.stream(prompts, params, [r.req.speculate for r in self.rows])
        stats = SpecStats.empty(runner.speculation.n_heads) if runner.speculation is not None else None
        last = None
        for step in stream:
            now = time.perf_counter()
            if last is not None:  # one observation per decode step: every live row waited this long
                m.emit("servekit_llm_itl_seconds", "histogram", now - last, "Seconds")
            last = now
            if stats is not None:
                stats.add(step)
            chunks: dict[int, str] = {}
            for j, row in enumerate(self.rows):
                new = step.tokens[j]
                if new is None:
                    continue
                delta, reason = self._push(row, new, step.finish_reasons[j], step.logprobs[j] if step.logprobs else None)
                if row.text.stopped:  # a stop string matched: end the row here
                    stream.cancel(j)
                if reason is not None:
                    row.finish = reason
                    m.emit("servekit_request_latency_seconds", "histogram", now - self.t0, "Seconds")
                if row.req.stream:
                    if delta or reason is not None:
                        chunks[row.idx] = chunks.get(row.idx, "") + self._sse(row, delta, reason)
                else:
                    row.pieces.append(delta)
            for i in list(chunks):
                if i not in self.done and all(r.finish is not None for r in self.by_request[i]):
                    chunks[i] += self._sse_end(i)
            if chunks:
                self._send(chunks)
        m.emit("servekit_llm_prompt_tokens_total", "counter",
               sum(rows[0].req.prompt_tokens for rows in self.by_request.values()))
        m.emit("servekit_llm_completion_tokens_total", "counter", sum(r.tokens for r in self.rows))
        if stats is not None and stats.proposed[0]:  # once per batch: 2 metric lines per draft position
            for pos, (proposed, accepted) in enumerate(zip(stats.proposed, stats.accepted)):
                m.emit("servekit_spec_proposed_total", "counter", proposed, Position=str(pos))
                m.emit("servekit_spec_accepted_total", "counter", accepted, Position=str(pos))
        for i, rows in self.by_request.items():
            if not rows[0].req.stream:
                self.context.set_response_content_type(i, "application/json")
        return {i: ("" if rows[0].req.stream else self._answer(i)) for i, rows in self.by_request.items()}

    def _push(self, row: _Row, tokens: list[int], reason: str | None,
              logprobs: list[TokenLogprob] | None) -> tuple[str, str | None]:
        """Detokenize a row's new tokens (one, or several from a speculative step); the last one
        carries `reason`. Returns the text to send and the finish reason (a stop string ends the
        row at once: later tokens of the same step are dropped). Logprobs are kept for every token
        that is part of the text (not for a stop token)."""
        delta = ""
        for n, tok in enumerate(tokens):
            if row.tokens == 0:
                self.s.metrics.emit("servekit_llm_ttft_seconds", "histogram", time.perf_counter() - self.t0,
                                    "Seconds")
            row.tokens += 1
            last = n == len(tokens) - 1
            if not (last and reason == FINISH_STOP):  # never print the stop token
                delta += row.text.push(tok)
                if logprobs is not None:
                    entry = self._logprob_entry(row, tok, logprobs[n])
                    row.logprobs.append(entry)
                    row.pending.append(entry)
            if row.text.stopped:
                reason = FINISH_STOP
                break
        if reason is not None:
            delta += row.text.finish()
        return delta, reason

    def _logprob_entry(self, row: _Row, token: int, lp: TokenLogprob) -> dict[str, Any]:
        """One token's logprobs, in the chat API's shape (`content[]` items) with the legacy
        completions fields alongside (`_text_offset`, `_top`), folded by `_logprobs_field`."""
        tok = self.s.tokenizer
        text = tok.token_text(token)
        entry = {"token": text, "logprob": lp.logprob, "bytes": list(tok.token_bytes(token)),
                 "top_logprobs": [{"token": tok.token_text(t), "logprob": v, "bytes": list(tok.token_bytes(t))}
                                  for t, v in lp.top]}
        if not row.req.chat:
            entry["_text_offset"] = row.offset
        row.offset += len(text)
        return entry

    def _logprobs_field(self, row: _Row, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A choice's `logprobs`: null unless asked for; chat's {content, refusal}, or the legacy
        completions shape {tokens, token_logprobs, top_logprobs, text_offset}."""
        if row.req.choices[row.choice][1].logprobs is None:
            return None
        if row.req.chat:
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": [e["_text_offset"] for e in entries]}

    def _send(self, chunks: dict[int, str]) -> None:
        from ts.handler_utils.utils import send_intermediate_predict_response

        for i in chunks:
            self.context.set_response_content_type(i, "text/event-stream")
        ids = {i: self.context.request_ids[i] for i in chunks}
        send_intermediate_predict_response(chunks, ids, "Intermediate Prediction success", 200, self.context)

    def _usage(self, idx: int) -> dict[str, int]:
        rows = self.by_request[idx]
        p, c = rows[0].req.prompt_tokens, sum(r.tokens for r in rows)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _head(self, row: _Row, obj: str) -> dict[str, Any]:
        return {"id": row.id, "object": obj, "created": self.created, "model": row.req.model or self.s.model_name,
                "system_fingerprint": self.s.fingerprint}

    def _sse(self, row: _Row, delta: str, reason: str | None) -> str:
        events = []
        head = self._head(row, "chat.completion.chunk" if row.req.chat else "text_completion")
        if row.req.include_usage:  # the spec: null on every chunk but the last, which carries it
            head["usage"] = None
        # The tokens of this chunk's text: its logprobs (a token whose text is held back, e.g. by a
        # possible stop string, goes with the chunk that carries it, or with the last one).
        logprobs = self._logprobs_field(row, row.pending) if delta or reason is not None else None
        if delta or reason is not None:
            row.pending = []
        if row.req.chat:
            if not row.started:
                events.append({**head, "choices": [{"index": row.choice, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            if row.req.tools is not None:  # sent once complete: only then is a tool call told from text
                row.pieces.append(delta)
                events += tool_stream_events(head, row.choice, row.req.tools, "".join(row.pieces), reason)
                delta, reason, logprobs = "", None, None
            if delta or (reason is not None and logprobs and logprobs["content"]):
                events.append({**head, "choices": [{"index": row.choice, "delta": {"content": delta},
                                                    "logprobs": logprobs, "finish_reason": None}]})
            if reason is not None:
                events.append({**head, "choices": [{"index": row.choice, "delta": {}, "logprobs": None,
                                                    "finish_reason": reason}]})
        else:
            events.append({**head, "choices": [{"index": row.choice, "text": delta, "logprobs": logprobs,
                                                "finish_reason": reason}]})
        row.started = True
        return "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)

    def _sse_end(self, idx: int) -> str:
        """The end of request `idx`'s stream, once all its choices have finished: the usage chunk
        (with include_usage) and [DONE]."""
        self.done.add(idx)
        row = self.by_request[idx][0]
        end = ""
        if row.req.include_usage:
            usage = {**self._head(row, "chat.completion.chunk" if row.req.chat else "text_completion"),
                     "choices": [], "usage": self._usage(idx)}
            end = f"data: {json.dumps(usage, ensure_ascii=False)}\n\n"
        return end + "data: [DONE]\n\n"

    def _answer(self, idx: int) -> str:
        rows = self.by_request[idx]
        req = rows[0].req
        if req.chat:
            choices = [{"index": r.choice, "message": {"role": "assistant", "content": "".join(r.pieces)},
                        "logprobs": self._logprobs_field(r, r.logprobs), "finish_reason": r.finish} for r in rows]
            for c, r in zip(choices, rows):
                if r.req.tools is not None:
                    c["message"], c["finish_reason"] = tool_message(r.req.tools, "".join(r.pieces), r.finish)
        else:
            choices = [{"index": r.choice, "text": "".join(r.pieces), "logprobs": self._logprobs_field(r, r.logprobs),
                        "finish_reason": r.finish} for r in rows]
        return json.dumps({**self._head(rows[0], "chat.completion" if req.chat else "text_completion"),
                           "choices": choices, "usage": self._usage(idx)}, ensure_ascii=False)


_service = LlmService()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    """TorchServe's entry point: called once with data=None to initialize, then once per batch."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
