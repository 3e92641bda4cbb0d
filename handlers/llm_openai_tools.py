"""OpenAI structured outputs and tool calling for the LLM handler: request fields in, a
``DecodeConstraint`` for the engine and a ``ToolPlan`` for the answer out.

Request fields (docs/structured-output.md): ``response_format`` (OpenAI's ``json_object`` and
``json_schema``), ``structured_outputs`` (vLLM's extension: exactly one of ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``; or the top-level ``guided_*`` fields vLLM used before it),
``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
``logit_bias`` and ``min_tokens``. Bad schemas, regexes, grammars and tool definitions are a 400
naming the field.

Tool calls: with ``tool_choice`` ``auto`` the model's own chat template renders the tools and the
model's own format is parsed back (a parser per template family: Qwen2.5/Hermes
``<tool_call>{json}</tool_call>``, Llama 3.1 JSON ``{"name": ..., "parameters": ...}``). With
``required`` the output is decoded under a JSON schema of a list of calls
(``[{"name": ..., "parameters": {...}}]``, one call unless ``parallel_tool_calls``); with a named
function, under that function's parameters schema: both always parse, and the arguments validate.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import jsonschema

from servekit.handlers.common import RequestError
from servekit.optimizations.llm.grammar import (CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX, DecodeConstraint,
                                                DeferredGrammars, GrammarError, GrammarSpec, logit_bias)

# vLLM's structured_outputs keys that select a grammar (exactly one), in its own names.
STRUCTURED_KINDS = {"json": JSON, "regex": REGEX, "choice": CHOICE, "grammar": GRAMMAR, "json_object": JSON_OBJECT}
# The top-level fields vLLM took for them before structured_outputs (removed in its 0.12). Clients
# such as outlines sent them long after; vLLM now ignores them and answers unconstrained, servekit
# decodes under them.
GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# Picks which of vLLM's grammar engines runs; servekit has one (llguidance), and any valid answer is
# the same answer.
GUIDED_BACKEND = "guided_decoding_backend"
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CALL_FINISH = "tool_calls"


def _bad(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, "invalid_request_error", message, code)


# -- tool-call formats of chat templates ----------------------------------------------------------

def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """Qwen2.5 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks."""
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        calls.append({"name": obj["name"], "arguments": obj.get("arguments", obj.get("parameters", {}))})
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def _llama_json(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """Llama 3.1/3.2 JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``
    (several separated by ``;``), after an optional ``<|python_tag|>``."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        calls.append({"name": obj["name"], "arguments": obj.get("parameters", obj.get("arguments", {}))})
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return None, calls


# Which parser reads a template's tool calls: recognised by what the template itself writes.
PARSERS: list[tuple[str, Callable[[str], Any]]] = [
    ("<tool_call>", _hermes),
    ("<|python_tag|>", _llama_json),
]


def parser_for_template(template_source: str) -> Callable[[str], Any]:
    """The tool-call parser of a chat template; Hermes-style ``<tool_call>`` when it writes none."""
    for marker, parser in PARSERS:
        if marker in template_source:
            return parser
    return _hermes


# -- the request side -------------------------------------------------------------------------

@dataclass
class ToolPlan:
    """How a request's answer carries tool calls: ``mode`` ``auto`` (parse the model's format),
    ``required`` (a JSON list of calls) or ``named`` (the output is the named function's arguments)."""

    mode: str
    names: list[str]
    parser: Callable[[str], Any] | None = None

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool_calls) of a finished answer's text."""
        found: list[dict[str, Any]] = []
        content: str | None = text
        if self.mode == "named":
            content, found = None, [{"name": self.names[0], "arguments": _loads(text)}]
        elif self.mode == "required":
            listed = _loads(text)
            if isinstance(listed, list):
                content = None
                found = [{"name": c.get("name"), "arguments": c.get("parameters", {})} for c in listed
                         if isinstance(c, dict)]
        elif self.parser is not None and (parsed := self.parser(text)) is not None:
            content, found = parsed
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                               else json.dumps(c["arguments"], ensure_ascii=False)}} for c in found]
        return content, calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # cut short by max_tokens: handed back as it is
        return text


@dataclass
class Extras:
    """What the structured-output and tool fields of one request asked for."""

    constraint: DecodeConstraint | None = None  # None also until ``constrain`` built it
    tools: list[dict[str, Any]] | None = None  # for the chat template (None: render none)
    plan: ToolPlan | None = None
    spec: GrammarSpec | None = field(default=None, repr=False)
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    min_tokens: int = field(default=0, repr=False)


def _schema(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"'{where}' must be a JSON schema object", "invalid_type")
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as e:  # nesting too deep to serialise
        raise _bad(f"'{where}' is not a valid JSON schema ({type(e).__name__})", "invalid_schema") from None
    problem = _schema_problem(text)
    if problem is not None:
        path, message = problem
        if message is None:
            raise _bad(f"'{where}' is not a valid JSON schema ({path})", "invalid_schema")
        raise _bad(f"'{where}' is not a valid JSON schema{f' at {path}' if path else ''}: {message}", "invalid_schema")
    return value


@functools.lru_cache(maxsize=1024)
def _schema_problem(text: str) -> tuple[str, str | None] | None:
    """Why the schema of canonical JSON `text` is invalid against its metaschema: (where, message),
    or (exception name, None) when it cannot be checked; None when valid. Cached: checking took
    about 3.5 ms per request (most of what a cached schema added to the time to first token), and
    clients send the same few schemas again and again."""
    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        return "/".join(str(p) for p in e.absolute_path), e.message
    except Exception as e:  # e.g. a "$schema" that is no string, or nesting too deep to check
        return type(e).__name__, None
    return None


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict) or "type" not in value:
        raise _bad("'response_format' must be an object with a 'type'", "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.of(JSON_OBJECT, None)
    if kind != "json_schema":
        raise _bad(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}", "invalid_value")
    js = value.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
        raise _bad("'response_format.json_schema' must be an object with a 'name'", "invalid_type")
    if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
        raise _bad("'response_format.json_schema.strict' must be true or false", "invalid_type")
    schema = _schema(js.get("schema", {}), "response_format.json_schema.schema")
    return GrammarSpec.of(JSON, schema)


def _structured_outputs(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise _bad("'structured_outputs' must be an object", "invalid_type")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_KINDS))
    if unknown:
        raise _bad(f"'structured_outputs.{unknown[0]}' is not supported (one of {', '.join(STRUCTURED_KINDS)})",
                   "unsupported_value")
    if len(given) != 1:
        raise _bad(f"'structured_outputs' needs exactly one of {', '.join(STRUCTURED_KINDS)}", "invalid_value")
    (key, spec), = given.items()
    return _structured(key, spec, f"structured_outputs.{key}")


def _guided(body: dict[str, Any]) -> GrammarSpec | None:
    """vLLM's former ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
    (at most one), or None; ``guided_decoding_backend`` must be a string and changes nothing."""
    if GUIDED_BACKEND in body and not isinstance(body[GUIDED_BACKEND], str):
        raise _bad(f"'{GUIDED_BACKEND}' must be a string", "invalid_type")
    given = [k for k in GUIDED_KINDS if k in body]
    if len(given) > 1:
        raise _bad(f"give one of {', '.join(map(repr, given))}, not {len(given)}", "invalid_value")
    return _structured(GUIDED_KINDS[given[0]], body[given[0]], given[0]) if given else None


def _structured(key: str, spec: Any, where: str) -> GrammarSpec:
    """``spec`` for the structured_outputs kind ``key``; errors name the request field ``where``."""
    if key == "json" and isinstance(spec, dict):
        _schema(spec, where)
    try:
        return GrammarSpec.of(STRUCTURED_KINDS[key], None if key == "json_object" else spec)
    except GrammarError as e:
        raise _bad(f"'{where}': {e}", "invalid_grammar") from None


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _bad("'tools' must be a list", "invalid_type")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", "invalid_tool")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise _bad(f"'tools[{i}].function.name' must be 1-64 letters, digits, _ or -", "invalid_tool")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise _bad(f"'tools[{i}].function.description' must be a string", "invalid_tool")
        params = _schema(fn.get("parameters") or {"type": "object", "properties": {}},
                         f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {**{k: v for k, v in fn.items() if v is not None},
                                                     "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise _bad("'tools' names a function twice", "invalid_tool")
    return out


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> str:
    """``none``, ``auto``, ``required`` or the name of a function of ``tools``."""
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise _bad("'tool_choice' is required but 'tools' is empty", "invalid_value")
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise _bad(f"'tool_choice' names function {str(name)[:64]!r}, which is not in 'tools'", "invalid_value")
        return name
    raise _bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
               "invalid_value")


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required``'s output: a list of calls of the given tools."""
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         "parameters": t["function"]["parameters"]},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    return {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def parse_extras(body: dict[str, Any], chat: bool, compiler: DeferredGrammars, vocab_size: int,
                 template_source: str, build: bool = True) -> Extras:
    """The constraint and tool plan of a request (``body`` without nulls). Raises a 400
    ``RequestError`` naming the bad field. ``build=False``: the constraint is left to
    ``constrain`` (a thinking model's grammar depends on the rendered prompt, which needs the tools)."""
    spec = None
    if "response_format" in body:
        spec = _response_format(body["response_format"])
    if "structured_outputs" in body:
        if spec is not None:
            raise _bad("give 'response_format' or 'structured_outputs', not both", "invalid_value")
        spec = _structured_outputs(body["structured_outputs"])
    guided = _guided(body)
    if guided is not None:
        if spec is not None:
            raise _bad(f"give 'response_format', 'structured_outputs' or "
                       f"'{next(k for k in GUIDED_KINDS if k in body)}', not two of them", "invalid_value")
        spec = guided
    extras = Extras()
    tools = _tools(body["tools"]) if "tools" in body else []
    choice = _tool_choice(body.get("tool_choice", "auto" if tools else "none"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be true or false", "invalid_type")
    if tools and not chat:
        raise _bad("'tools' is a chat field", "unknown_field")
    if tools and choice != "none":
        extras.tools = tools
        if choice == "auto":
            extras.plan = ToolPlan("auto", [t["function"]["name"] for t in tools], parser_for_template(template_source))
        else:
            if spec is not None:
                raise _bad(f"'tool_choice' {choice!r} decodes the call's arguments under their schema: it cannot be "
                           "combined with 'response_format', 'structured_outputs' or a 'guided_' field", "invalid_value")
            if choice == "required":
                spec = GrammarSpec.of(JSON, _required_schema(tools, parallel))
                extras.plan = ToolPlan("required", [t["function"]["name"] for t in tools])
            else:
                fn = next(t["function"] for t in tools if t["function"]["name"] == choice)
                spec = GrammarSpec.of(JSON, fn["parameters"])
                extras.plan = ToolPlan("named", [choice])
    bias = ()
    if "logit_bias" in body:
        try:
            bias = logit_bias(body["logit_bias"], vocab_size)
        except GrammarError as e:
            raise _bad(str(e), "invalid_value") from None
    min_tokens = body.get("min_tokens", 0)
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise _bad("'min_tokens' must be a non-negative integer", "invalid_value")
    extras.spec, extras.logit_bias, extras.min_tokens = spec, bias, min_tokens
    return constrain(extras, compiler) if build else extras


def constrain(extras: Extras, compiler: DeferredGrammars, think: str | None = None) -> Extras:
    """``extras`` with its ``DecodeConstraint`` built from its grammar, ``logit_bias`` and
    ``min_tokens``; ``think``: the thinking block a thinking model's grammar starts with
    (``GrammarSpec.think``). A grammar the compiler refuses is a 400."""
    spec = extras.spec if think is None or extras.spec is None else replace(extras.spec, think=think)
    try:
        constraint = compiler.constraint(spec, extras.logit_bias, extras.min_tokens)
    except GrammarError as e:
        raise _bad(str(e), "invalid_grammar") from None
    return replace(extras, spec=spec, constraint=constraint)


def template_messages(message: dict[str, Any], i: int) -> dict[str, Any]:
    """The tool parts of one request message as chat templates take them (transformers' shape):
    an assistant's ``tool_calls`` with their arguments as objects, a tool message's
    ``tool_call_id``. Returns the fields to add to the plain message."""
    out: dict[str, Any] = {}
    if "tool_calls" in message:
        calls = message["tool_calls"]
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise _bad(f"'messages[{i}].tool_calls' must be a list on an assistant message", "invalid_type")
        out["tool_calls"] = []
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise _bad(f"'messages[{i}].tool_calls[{k}]' must have a function with a name", "invalid_type")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                raise _bad(f"'messages[{i}].tool_calls[{k}].function.arguments' is not JSON", "invalid_value") from None
            out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": args}})
    if message.get("role") == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise _bad(f"'messages[{i}].tool_call_id' is missing: a tool message answers a call", "missing_field")
        out["tool_call_id"] = message["tool_call_id"]
    return out


# -- the answer side --------------------------------------------------------------------------

def stream_tool_events(head: dict[str, Any], index: int, content: str | None,
                       calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finished answer's content and tool calls as OpenAI streams them: content, then per call
    one delta with its id and name and one with its arguments (the SDK joins them by index)."""
    events = []
    if content:
        events.append({**head, "choices": [{"index": index, "delta": {"content": content}, "logprobs": None,
                                            "finish_reason": None}]})
    for k, call in enumerate(calls):
        fn = call["function"]
        events.append({**head, "choices": [{"index": index, "delta": {"tool_calls": [
            {"index": k, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}]},
            "logprobs": None, "finish_reason": None}]})
        events.append({**head, "choices": [{"index": index, "delta": {"tool_calls": [
            {"index": k, "function": {"arguments": fn["arguments"]}}]}, "logprobs": None, "finish_reason": None}]})
    return events


def tool_stream_events(head: dict[str, Any], index: int, plan: ToolPlan, text: str,
                       reason: str | None) -> list[dict[str, Any]]:
    """A streamed tool-calling answer: nothing until it is complete (a call's format is known
    only then), then its content, its calls and the finish chunk."""
    if reason is None:
        return []
    content, calls = plan.calls(text)
    finish = TOOL_CALL_FINISH if calls and reason == "stop" else reason
    return stream_tool_events(head, index, content, calls) + [
        {**head, "choices": [{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]}]


def tool_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A finished answer's chat message (content and tool_calls) and finish reason."""
    content, calls = plan.calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, TOOL_CALL_FINISH if calls and finish == "stop" else finish
