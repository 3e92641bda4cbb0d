"""OpenAI chat and text completions: the LLM handler's request and response code, in one module.

Routes (TorchServe passes the suffix after /predictions/<model>/<version>/ in `url_path`):
  POST /predictions/<model>/<version>/v1/chat/completions   OpenAI chat completions
  POST /predictions/<model>/<version>/v1/completions        OpenAI text completions

In: ``OpenAIApi.parse`` turns a body into an ``LlmRequest`` (each choice's token ids and
``SamplingParams`` for the engine, the answer's options), every limit checked, or raises a 4xx
``RequestError`` naming the field. Out: ``Answer`` builds one request's answer from the engine's
tokens: server-sent-event chunks (`data: {...}`, ending with `data: [DONE]`) while streaming, or one
JSON; usage (cached prompt tokens included), logprobs fields, tool calls (parsed by
handlers/llm_openai_tools.py). The engine (servekit.optimizations.llm) never imports this module: it
takes token ids and sampling parameters and yields tokens.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from servekit.handlers.common import (RequestError, check_token_ids, clip, decode_body, int_field, number_field, shown,
                                      without_nulls)
from servekit.handlers.llm_openai_reasoning import (ThinkingSplit, grammar_thinking, prompt_opens_thinking,
                                                    template_thinks)
from servekit.handlers.llm_openai_tools import (GUIDED_BACKEND, GUIDED_KINDS, Extras, ToolPlan, constrain, parse_extras,
                                                template_messages, tool_message, tool_stream_events)
from servekit.optimizations.llm.chat_template import ChatTokenizer, IncrementalDetokenizer, TemplateError
from servekit.optimizations.llm.generate import (FINISH_STOP, PENALTY_RANGE, TEMPERATURE_RANGE, RunnerShape,
                                                 SamplingParams, TokenLogprob)
from servekit.optimizations.llm.grammar import MAY_THINK, THINKING, DeferredGrammars
from servekit.optimizations.llm.plan import LlmLimits
from servekit.optimizations.llm.sampling import TOP_LOGPROBS

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
COMMON_KEYS |= {*GUIDED_KINDS, GUIDED_BACKEND}  # vLLM's former names of structured_outputs
COMMON_KEYS |= {"ignore_eos"}  # vLLM's extension: only max_tokens (or the context) ends the answer
COMMON_KEYS |= {"stop_token_ids"}  # vLLM's extension: more tokens that end the answer, not printed
COMMON_KEYS |= {"include_stop_str_in_output"}  # vLLM's extension: the stop string ends the text
# vLLM's sampling fields that servekit does not implement: clients that send every field send them
# at their defaults, which are accepted (_unsupported).
VLLM_NOOP = {"min_p": 0, "repetition_penalty": 1, "length_penalty": 1, "use_beam_search": False,
             "skip_special_tokens": True, "spaces_between_special_tokens": True}
VLLM_CHAT_NOOP = {"add_generation_prompt": True, "continue_final_message": False}
COMMON_KEYS |= set(VLLM_NOOP)
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "response_format", "tools", "tool_choice",
                           "parallel_tool_calls", "functions", "function_call", "modalities", "audio", "prediction",
                           "reasoning_effort", "web_search_options"}
CHAT_KEYS |= {"chat_template_kwargs"}  # vLLM's extension: more of the chat template's variables
CHAT_KEYS |= set(VLLM_CHAT_NOOP)
# OpenAI's successors of `user`: identifiers, as `user` is (the prefix cache finds shared prefixes
# by itself, without a key); the cache keeps prefixes in memory, the retention OpenAI calls in_memory.
CHAT_KEYS |= {"safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
# Message fields the SDK's own response objects carry (`message.model_dump()`): accepted when null
# or empty, since a multi-turn conversation sends the assistant's message back as it came.
MESSAGE_KEYS = {"role", "content", "name", "refusal", "annotations", "audio", "function_call", "tool_calls",
                "tool_call_id"}
# An earlier answer's thinking sent back (handlers/llm_openai_reasoning.py; vLLM's newer name is
# `reasoning`): the template gets it as `reasoning_content`, which Qwen3's renders for the turns
# after the last user message and drops before.
THOUGHT_KEYS = ("reasoning_content", "reasoning")
MESSAGE_KEYS |= set(THOUGHT_KEYS)
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
# Characters read per token of the prompt limit before tokenizing: generous (byte-level BPE tokens run to a
# few characters; whitespace runs and repeated symbols to a few dozen), and small enough that tokenizing
# the largest prompt admitted takes a fraction of a second.
MAX_CHARS_PER_TOKEN = 32
SEED_RANGE = (-2**63, 2**64 - 1)  # OpenAI's seed is a 64-bit integer; it is reduced mod 2**32
# A text no answer holds, marking where a chunk's text goes in its event's encoded JSON.
MARK = "\x00servekit-text\x00"
COMPLETION_LOGPROBS_MAX = 5  # /v1/completions' integer `logprobs` (OpenAI's limit); chat allows TOP_LOGPROBS


@dataclass
class LlmRequest:
    """One valid request: its choices, each a (prompt, sampling) sequence for the engine. Choice k
    of prompt p is choice p * n + k (OpenAI's order for a list of prompts with `n`)."""
    chat: bool
    choices: list[tuple[list[int], SamplingParams]]
    prompt_tokens: int  # each prompt counted once, whatever n
    stream: bool
    include_usage: bool
    stop: list[str]
    model: str | None
    speculate: bool = True  # servekit extension: false keeps this request from speculative decoding
    tools: ToolPlan | None = None  # tool calls are parsed out of the answer (handlers/llm_openai_tools.py)
    n: int = 1  # choices per prompt
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    # A thinking model's chat, free to think: whether its prompt opened the thinking block (None:
    # no thinking split off, handlers/llm_openai_reasoning.py)
    thinking: bool | None = None


@dataclass
class PreparedRequest:
    """A request checked up to its prompts' texts (``OpenAIApi.prepare``), waiting to be tokenized:
    a chat's one rendered conversation, or a completion's prompts."""
    chat: bool
    body: dict[str, Any]
    extras: Extras
    texts: list[str]
    ids: list[list[int]] | None = None  # a completion's prompts sent as token ids: used as they are


K = TypeVar("K")


def _bad(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, "invalid_request_error", message, code)


def _token_prompts(prompt: Any, vocab_size: int) -> list[list[int]] | None:
    """A completion's ``prompt`` given as token ids, as OpenAI's API allows: one list of ids, or a
    list of such lists (each one prompt); None when it is not given as ids. Ids outside the
    vocabulary are a 400; an empty list is left for the empty-prompt check."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], str):
        return None
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    for k, ids in enumerate(lists):
        where = "prompt" if lists is not prompt else f"prompt[{k}]"
        if not isinstance(ids, list):
            raise _bad(f"'{where}' must be a list of token ids, got {type(ids).__name__}", "invalid_type")
        check_token_ids(ids, where, vocab_size)
    return lists


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
        thought = {}
        for key in THOUGHT_KEYS:
            if key in m:
                if role != "assistant" or not isinstance(m[key], str):
                    raise _bad(f"'messages[{i}].{key}' must be a string, on an assistant message", "invalid_value")
                thought = {"reasoning_content": m[key]}
        # The chat template knows system/user/assistant; "developer" is OpenAI's newer name for system.
        out.append({"role": "system" if role == "developer" else role,
                    "content": _text_content(m["content"], f"messages[{i}].content"), **thought,
                    **template_messages(m, i)})
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


def _stop_token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``: token ids that end the answer as the model's end-of-turn does."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(f"'stop_token_ids' must be a list of token ids, got {type(value).__name__}", "invalid_type")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise _bad(f"'stop_token_ids' has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS}", "invalid_value")
    check_token_ids(value, "stop_token_ids", vocab_size)
    return tuple(dict.fromkeys(value))


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
            "best_of": 1, "prompt_cache_retention": "in_memory", **VLLM_NOOP, **VLLM_CHAT_NOOP}
    for key, value in noop.items():
        # true is not 1 here, nor 0 false
        if key in body and (body[key] != value or isinstance(body[key], bool) != isinstance(value, bool)):
            raise _bad(f"'{key}' is not supported (only {json.dumps(value)})", "unsupported_value")
    for key in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if key in body:
            raise _bad(f"'{key}' is not supported", "unsupported_value")
    for key in ("model", "user", "service_tier", "safety_identifier", "prompt_cache_key"):
        if key in body and not isinstance(body[key], str):
            raise _bad(f"'{key}' must be a string", "invalid_type")
    if "metadata" in body and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "invalid_type")
    for key in ("store", "parallel_tool_calls"):
        if key in body and not isinstance(body[key], bool):
            raise _bad(f"'{key}' must be true or false", "invalid_type")


class OpenAIApi:
    """What parsing a request and shaping its answer need of the worker: the runner's shape, the
    tokenizer, the stop tokens and the grammar compiler; the served model's name and fingerprint."""

    def __init__(self, shape: RunnerShape, limits: LlmLimits, tokenizer: ChatTokenizer, stop_ids: tuple[int, ...],
                 grammar: DeferredGrammars, model_name: str, fingerprint: str) -> None:
        self.shape, self.limits, self.tokenizer, self.stop_ids, self.grammar = shape, limits, tokenizer, stop_ids, grammar
        self.model_name, self.fingerprint = model_name, fingerprint
        self.created = int(time.time())  # the models API's `created`
        self.thinks = template_thinks(tokenizer.template_source)

    def warm_up(self) -> float:
        """A chat, streamed and not, and a text completion through every step a request takes on the
        worker's host (parsing, the chat template, tokenizing, answer chunks), without the engine;
        returns the seconds it took. The first request would otherwise pay each library's first
        use: the tokenizer's thread pool, the template's first render, the first streamed text
        (~0.9 ms of a 600-token chat's TTFT on the 2-core VM). A request this model refuses (a
        template's own rule) is logged and skipped: warming up never stops a worker."""
        t0 = time.perf_counter()
        chat = {"messages": [{"role": "user", "content": "Warm up: say hello, please."}], "max_tokens": 2}
        bodies = [(CHAT_ROUTE, {**chat, "stream": True}), (CHAT_ROUTE, chat),
                  (COMPLETIONS_ROUTE, {"prompt": "Warm up:", "max_tokens": 2})]
        prepared = {}
        for k, (route, body) in enumerate(bodies):
            try:
                prepared[k] = self.prepare({"body": json.dumps(body).encode()}, route)
            except RequestError as e:
                log.warning("request path warm-up skipped a %s request: %s", route, e.message)
        for k, req in self.tokenize(prepared).items():
            if isinstance(req, RequestError):
                log.warning("request path warm-up skipped a request: %s", req.message)
                continue
            answer = self.answer(req, f"warm-up-{k}")
            answer.add(0, req.choices[0][0][-2:], "length", None)
            answer.end()
        return time.perf_counter() - t0

    def answer(self, req: LlmRequest, request_id: str) -> "Answer":
        """The answer of a request being generated."""
        return Answer(self, req, request_id)

    def parse(self, raw: dict[str, Any], route: str) -> LlmRequest:
        """One request of TorchServe's batch (``raw``: its data entry) on ``route``: its choices for
        the engine, every limit checked; a ``RequestError`` (404 or 4xx) naming what is wrong."""
        got = self.tokenize({0: self.prepare(raw, route)})[0]
        if isinstance(got, RequestError):
            raise got
        return got

    def prepare(self, raw: dict[str, Any], route: str) -> PreparedRequest:
        """``parse`` up to tokenizing: the request checked as far as its prompts' texts (rendered
        with the chat template), or a ``RequestError``. ``tokenize`` does the rest, for a whole
        batch of requests at once."""
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
        extras = parse_extras(body, chat, self.grammar, self.shape.vocab_size, self.tokenizer.template_source,
                              build=False)
        if chat:
            if "messages" not in body:
                raise _bad("missing required field 'messages'", "missing_field")
            messages = _messages(body["messages"])
            self._check_chars("messages", sum(len(m["content"]) + len(m.get("reasoning_content", ""))
                                              for m in messages))
            variables = self._template_variables(body.get("chat_template_kwargs"))
            try:
                texts = [self.tokenizer.render(messages, tools=extras.tools, variables=variables)]
            except TemplateError as e:
                raise _bad(str(e), "invalid_messages") from None
            if variables:  # what they put into the prompt is read before tokenizing too
                self._check_chars("chat_template_kwargs", len(texts[0]))
            # A thinking model's grammar lets it think first and holds from </think> on.
            think = grammar_thinking(texts[0]) if self.thinks and extras.spec is not None else None
            extras = constrain(extras, self.grammar, think or None)
        else:
            extras = constrain(extras, self.grammar)
            ids = _token_prompts(body.get("prompt"), self.shape.vocab_size)
            if ids is not None:
                return PreparedRequest(chat, body, extras, [], ids)
            texts = body.get("prompt")
            texts = [texts] if isinstance(texts, str) else texts
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise _bad("'prompt' must be a string, a non-empty list of strings, a list of token ids or a "
                           "list of such lists", "invalid_type")
            for k, t in enumerate(texts):
                self._check_chars("prompt" if len(texts) == 1 else f"prompt[{k}]", len(t))
        return PreparedRequest(chat, body, extras, texts)

    def tokenize(self, prepared: dict[K, PreparedRequest]) -> dict[K, LlmRequest | RequestError]:
        """The prepared requests' prompts tokenized together (one batch call for the chats, one for
        the text completions: a burst of long prompts costs about one prompt's time, not the sum),
        then each request's remaining checks: its ``LlmRequest``, or its own ``RequestError``."""
        prompts = self._encode(prepared)  # any str encodes: decode_body let no unpaired surrogate through
        out: dict[K, LlmRequest | RequestError] = {}
        for key, p in prepared.items():
            try:
                out[key] = self._request(p, prompts[key])
            except RequestError as e:
                out[key] = e
        return out

    def _encode(self, prepared: dict[K, PreparedRequest]) -> dict[K, list[list[int]]]:
        """Each prepared request's prompt ids: the chats' in one batch call, the completions' in another."""
        chats = [key for key, p in prepared.items() if p.chat]
        plain = [key for key, p in prepared.items() if not p.chat and p.ids is None]
        prompts: dict[K, list[list[int]]] = {key: p.ids for key, p in prepared.items() if p.ids is not None}
        if chats:
            ids = iter(self.tokenizer.encode_batch([prepared[key].texts[0] for key in chats]))
            prompts |= {key: [next(ids)] for key in chats}
        if plain:
            ids = iter(self.tokenizer.encode_prompts([t for key in plain for t in prepared[key].texts]))
            prompts |= {key: [next(ids) for _ in prepared[key].texts] for key in plain}
        return prompts

    def _request(self, p: PreparedRequest, prompts: list[list[int]]) -> LlmRequest:
        """A prepared request with its prompts' ids: the checks that need them, and the rest."""
        body = p.body
        if not p.chat and not all(prompts):
            raise _bad("'prompt' is empty" if len(prompts) == 1 else
                       f"'prompt[{[bool(q) for q in prompts].index(False)}]' is empty", "empty_prompt")
        if body.get("ignore_eos") is True and ((c := p.extras.constraint) is not None and c.spec is not None
                                               or p.extras.plan is not None):
            raise _bad("'ignore_eos' cannot be combined with a structured output or tools: their answers end "
                       "where the grammar or the call ends", "invalid_value")
        n = int_field(body, "n", 1, self.shape.max_batch, 1)
        if len(prompts) * n > self.shape.max_batch:
            raise _bad(f"{len(prompts)} prompt(s) x n={n} = {len(prompts) * n} choices; at most "
                       f"{self.shape.max_batch} per request", "too_many_choices")
        choices = []
        stops = _stop_token_ids(body.get("stop_token_ids"), self.shape.vocab_size)
        constraint = p.extras.constraint
        least = constraint.min_tokens if constraint is not None else 0
        if least and stops:  # held back until min_tokens, as the model's own stop tokens are
            constraint = dataclasses.replace(constraint, stop_token_ids=tuple(dict.fromkeys(
                constraint.stop_token_ids + stops)))
        for prompt in prompts:
            params = self._params(body, p.chat, len(prompt), stops)
            if least > params.max_tokens:  # vLLM refuses it too: the answer would end short of it
                raise _bad(f"'min_tokens' ({least}) is more than the {params.max_tokens} tokens the answer may "
                           "have (max_tokens, or what the context leaves)", "invalid_value")
            for k in range(n):  # a seeded request's choices differ: choice k samples with seed + k
                seed = None if params.seed is None else (params.seed + k) % 2**32
                choices.append((prompt, dataclasses.replace(params, seed=seed, constraint=constraint)))
        speculate, include_stop = body.get("speculate", True), body.get("include_stop_str_in_output", False)
        for key, value in (("speculate", speculate), ("include_stop_str_in_output", include_stop)):
            if not isinstance(value, bool):
                raise _bad(f"'{key}' must be true or false", "invalid_type")
        # A thinking model's chat: its thinking split off, from a block the prompt opened or one the
        # answer opens; under a grammar, where the grammar lets it think.
        thinking = None
        if p.chat and self.thinks:
            spec = p.extras.spec
            thinking = prompt_opens_thinking(p.texts[0]) if spec is None else \
                {MAY_THINK: False, THINKING: True}.get(spec.think)
        return LlmRequest(p.chat, choices, sum(len(q) for q in prompts), *self._stream_flags(body),
                          _stop(body.get("stop")), body.get("model"), speculate, p.extras.plan, n, include_stop,
                          thinking)

    def _template_variables(self, value: Any) -> dict[str, Any] | None:
        """vLLM's ``chat_template_kwargs``: more variables for the chat template (Qwen3's
        ``enable_thinking``), none of those servekit sets itself or the template's helpers."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise _bad("'chat_template_kwargs' must be an object of template variables", "invalid_type")
        taken = sorted(set(value) & self.tokenizer.reserved())
        if taken:
            raise _bad(f"'chat_template_kwargs' cannot set {', '.join(map(repr, taken))}: the server sets "
                       f"{'it' if len(taken) == 1 else 'them'} from the request", "invalid_value")
        return value

    def _check_chars(self, field: str, n_chars: int) -> None:
        """Before tokenizing: a prompt longer than MAX_CHARS_PER_TOKEN characters per token the model
        accepts cannot fit, and tokenizing megabytes stalls the worker (and, under continuous
        batching, every running stream) for seconds; refused at once instead."""
        limit = self.shape.max_prompt_len * MAX_CHARS_PER_TOKEN
        if n_chars > limit:
            raise RequestError(413, "invalid_request_error", f"'{field}' has {n_chars} characters; at most {limit} "
                               f"are read ({MAX_CHARS_PER_TOKEN} per token of the {self.shape.max_prompt_len}-token "
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

    def _params(self, body: dict, chat: bool, prompt_len: int, stops: tuple[int, ...]) -> SamplingParams:
        """The sampling parameters of one prompt's choices; ``stops``: the request's own stop token
        ids, beside the model's (which ``ignore_eos`` leaves out)."""
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = int_field(body, key, 1, self.limits.max_tokens)
        if max_tokens is None:  # what the context leaves, up to the default (the context check below sees it fits)
            max_tokens = max(1, min(self.limits.default_max_tokens, self.shape.max_seq_len - prompt_len))
        if (err := self.shape.context_error(prompt_len, max_tokens)) is not None:
            raise _bad(err.replace("max_tokens", f"'{key}'"), "context_length_exceeded")
        top_k = int_field(body, "top_k", -1, 2**31 - 1)  # -1 and 0: off; above the vocabulary: all of it
        seed = int_field(body, "seed", *SEED_RANGE)
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad("'ignore_eos' must be true or false", "invalid_type")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=number_field(body, "temperature", 1.0, *TEMPERATURE_RANGE),
            top_p=number_field(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=max(top_k or 0, 0),
            seed=None if seed is None else seed % 2**32,
            stop_token_ids=tuple(dict.fromkeys((() if ignore_eos else self.stop_ids) + stops)),
            presence_penalty=number_field(body, "presence_penalty", 0.0, *PENALTY_RANGE),
            frequency_penalty=number_field(body, "frequency_penalty", 0.0, *PENALTY_RANGE),
            logprobs=_logprobs(body, chat))


@dataclass
class _Choice:
    index: int
    text: IncrementalDetokenizer
    pieces: list[str] = field(default_factory=list)  # the text so far (a JSON answer, or a tool-call stream)
    tokens: int = 0
    cached: int = 0  # prompt tokens the engine found in its cache
    finish: str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # all of them (a JSON answer)
    pending: list[dict[str, Any]] = field(default_factory=list)  # not sent yet (a stream)
    offset: int = 0  # characters of the tokens' texts so far: the legacy text_offset
    started: bool = False  # a chunk of it went out
    text_event: tuple[str, str] | None = None  # a text-only chunk's event around its JSON-encoded text
    thinking: ThinkingSplit | None = None  # a thinking model's thinking split off (LlmRequest.thinking)
    reasoning: list[str] = field(default_factory=list)  # the thinking so far
    reasoning_pending: str = ""  # not sent yet (a stream)


class Answer:
    """One request's OpenAI answer, fed with the engine's tokens choice by choice (``add``): the
    stream's chunks as they come, or the whole JSON at the ``end``."""

    def __init__(self, api: OpenAIApi, req: LlmRequest, request_id: str) -> None:
        self.api, self.req = api, req
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.choices = [_Choice(k, IncrementalDetokenizer(api.tokenizer, req.stop, req.include_stop),
                                thinking=None if req.thinking is None else ThinkingSplit(req.thinking))
                        for k in range(len(req.choices))]

    @property
    def started(self) -> bool:
        """A chunk went out: the status can no longer change."""
        return any(c.started for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def generated(self, k: int) -> int:
        """Tokens choice k got so far."""
        return self.choices[k].tokens

    def ended(self, k: int) -> bool:
        """Whether choice k has finished."""
        return self.choices[k].finish is not None

    def stopped(self, k: int) -> bool:
        """Whether a stop string ended choice k (the engine may still be generating it)."""
        return self.choices[k].text.stopped

    def add(self, k: int, tokens: list[int], finish_reason: str | None, logprobs: list[TokenLogprob] | None,
            cached_tokens: int = 0) -> tuple[str, bool]:
        """Choice k's new tokens (the last one carries ``finish_reason``). Returns the stream's next
        chunks ("" for a JSON answer) and whether the choice just ended."""
        c = self.choices[k]
        c.cached = max(c.cached, cached_tokens)
        delta, reason = self._push(c, tokens, finish_reason, logprobs)
        c.finish = reason
        if not self.req.stream:
            c.pieces.append(delta)
            return "", reason is not None
        return (self._sse(c, delta, reason) if delta or reason is not None or c.reasoning_pending else ""), \
            reason is not None

    def fail(self, k: int) -> None:
        """Choice k ended in an error: the request's error answer follows (``error_event`` or a 4xx/5xx)."""
        self.choices[k].finish = "error"

    def error_event(self, err: RequestError) -> str:
        """A stream under way cannot change its status: the error goes in the stream and ends it."""
        for c in self.choices:
            c.finish = c.finish or "error"
        return f"data: {err.body()}\n\n"

    def end(self) -> str:
        """Once every choice has finished: the stream's end (the usage chunk with include_usage, then
        [DONE]), or the whole JSON answer."""
        if not self.req.stream:
            return self._json()
        end = ""
        if self.req.include_usage:
            usage = {**self._head("chat.completion.chunk" if self.req.chat else "text_completion"),
                     "choices": [], "usage": self._usage()}
            end = f"data: {json.dumps(usage, ensure_ascii=False)}\n\n"
        return end + "data: [DONE]\n\n"

    def _push(self, c: _Choice, tokens: list[int], reason: str | None,
              logprobs: list[TokenLogprob] | None) -> tuple[str, str | None]:
        """Detokenize a choice's new tokens (one, or several from a speculative step); the last one
        carries `reason`. Returns the text to send and the finish reason (a stop string ends the
        choice at once: later tokens of the same step are dropped). Logprobs are kept for every
        token that is part of the text (not for a stop token)."""
        delta = ""
        for n, tok in enumerate(tokens):
            c.tokens += 1
            last = n == len(tokens) - 1
            if not (last and reason == FINISH_STOP):  # never print the stop token
                delta += c.text.push(tok)
                if logprobs:
                    entry = self._logprob_entry(c, tok, logprobs[n])
                    c.logprobs.append(entry)
                    c.pending.append(entry)
            if c.text.stopped:
                reason = FINISH_STOP
                break
        if reason is not None:
            delta += c.text.finish()
        if c.thinking is not None:
            thought, delta = c.thinking.feed(delta, final=reason is not None)
            c.reasoning.append(thought)
            c.reasoning_pending += thought
        return delta, reason

    def _logprob_entry(self, c: _Choice, token: int, lp: TokenLogprob) -> dict[str, Any]:
        """One token's logprobs, in the chat API's shape (`content[]` items) with the legacy
        completions fields alongside (`_text_offset`), folded by `_logprobs_field`."""
        tok = self.api.tokenizer
        text = tok.token_text(token)
        entry = {"token": text, "logprob": lp.logprob, "bytes": list(tok.token_bytes(token)),
                 "top_logprobs": [{"token": tok.token_text(t), "logprob": v, "bytes": list(tok.token_bytes(t))}
                                  for t, v in lp.top]}
        if not self.req.chat:
            entry["_text_offset"] = c.offset
        c.offset += len(text)
        return entry

    def _logprobs_field(self, c: _Choice, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A choice's `logprobs`: null unless asked for; chat's {content, refusal}, or the legacy
        completions shape {tokens, token_logprobs, top_logprobs, text_offset}."""
        if self.req.choices[c.index][1].logprobs is None:
            return None
        if self.req.chat:
            return {"content": entries, "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": [e["_text_offset"] for e in entries]}

    def _usage(self) -> dict[str, Any]:
        """OpenAI's usage: each prompt counted once whatever `n`, and of its tokens those read from
        the engine's cache (a prompt's choices run side by side: its count is the least any of
        them found)."""
        p, c, n = self.req.prompt_tokens, self.completion_tokens, self.req.n
        cached = sum(min(x.cached for x in self.choices[i:i + n]) for i in range(0, len(self.choices), n))
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model or self.api.model_name,
                "system_fingerprint": self.api.fingerprint}

    def _sse(self, c: _Choice, delta: str, reason: str | None) -> str:
        plain = (c.started and reason is None and self.req.choices[c.index][1].logprobs is None
                 and self.req.tools is None and not c.reasoning_pending)
        if plain and delta and c.text_event is not None:
            # Most chunks carry only text: the same event as below, its constant part encoded once.
            return f"data: {c.text_event[0]}{json.dumps(delta, ensure_ascii=False)}{c.text_event[1]}\n\n"
        events = []
        head = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        if self.req.include_usage:  # the spec: null on every chunk but the last, which carries it
            head["usage"] = None
        if plain and c.text_event is None:
            event = {**head, "choices": [{"index": c.index, "delta": {"content": MARK}, "logprobs": None,
                                          "finish_reason": None}] if self.req.chat else
                     [{"index": c.index, "text": MARK, "logprobs": None, "finish_reason": None}]}
            before, after = json.dumps(event, ensure_ascii=False).rsplit(json.dumps(MARK), 1)
            c.text_event = (before, after)
        # The tokens of this chunk's text: its logprobs (a token whose text is held back, e.g. by a
        # possible stop string, goes with the chunk that carries it, or with the last one).
        logprobs = self._logprobs_field(c, c.pending)
        c.pending = []
        if self.req.chat:
            if not c.started:
                events.append({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
            if c.reasoning_pending:  # its tokens' logprobs go with it unless answer text follows
                thought = {"reasoning_content": c.reasoning_pending}
                events.append({**head, "choices": [{"index": c.index, "delta": thought,
                                                    "logprobs": None if delta else logprobs, "finish_reason": None}]})
                c.reasoning_pending, logprobs = "", logprobs if delta else None
            if self.req.tools is not None:  # sent once complete: only then is a tool call told from text
                c.pieces.append(delta)
                events += tool_stream_events(head, c.index, self.req.tools, "".join(c.pieces), reason)
                delta, reason, logprobs = "", None, None
            if delta or (reason is not None and logprobs and logprobs["content"]):
                events.append({**head, "choices": [{"index": c.index, "delta": {"content": delta},
                                                    "logprobs": logprobs, "finish_reason": None}]})
            if reason is not None:
                events.append({**head, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                    "finish_reason": reason}]})
        else:
            events.append({**head, "choices": [{"index": c.index, "text": delta, "logprobs": logprobs,
                                                "finish_reason": reason}]})
        c.started = True
        return "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events)

    def _json(self) -> str:
        req = self.req
        if req.chat:
            choices = []
            for c in self.choices:
                text = "".join(c.pieces)
                message, finish = ({"role": "assistant", "content": text}, c.finish) if req.tools is None else \
                    tool_message(req.tools, text, c.finish)
                if self.api.thinks:  # the field a thinking model's answers have, whether it thought or not
                    message["reasoning_content"] = "".join(c.reasoning) or None
                choices.append({"index": c.index, "message": message, "logprobs": self._logprobs_field(c, c.logprobs),
                                "finish_reason": finish})
        else:
            choices = [{"index": c.index, "text": "".join(c.pieces), "logprobs": self._logprobs_field(c, c.logprobs),
                        "finish_reason": c.finish} for c in self.choices]
        return json.dumps({**self._head("chat.completion" if req.chat else "text_completion"),
                           "choices": choices, "usage": self._usage()}, ensure_ascii=False)
