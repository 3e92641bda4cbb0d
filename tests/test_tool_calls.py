"""Tool calling without a server: each template family's tool-call format parsed into OpenAI
tool_calls, streamed (assembled by the openai SDK's own stream state) and not; tools, an
assistant's tool_calls and tool results rendered by a chat template; request validation."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from servekit.handlers.common import RequestError
from servekit.handlers.llm_openai_tools import (ToolPlan, _hermes, _llama_json, parse_extras, parser_for_template,
                                                template_messages, tool_message, tool_stream_events)
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import GrammarCompiler
from servekit.optimizations.models.gguf_weights import smollm2_archive_files

openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types.chat import ChatCompletionChunk  # noqa: E402

# Tool sections in the shape of Qwen2.5's and Llama 3.1's templates (what each writes for tools,
# for an assistant's calls and for tool results).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_TEMPLATE = """{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{%- if tools and m.role == "user" %}Respond with {"name": function name, "parameters": arguments}.
{%- for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}{# <|python_tag|> starts a built-in tool call #}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def weights() -> Path:
    return smollm2_archive_files(torch.bfloat16)[0].parent


def _tokenizer(weights: Path, tmp: Path, template: str) -> ChatTokenizer:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(weights / name, tmp / name)
    (tmp / "chat_template.jinja").write_text(template)
    return ChatTokenizer(tmp)


def test_each_template_gets_its_parser() -> None:
    assert parser_for_template(HERMES_TEMPLATE) is _hermes
    assert parser_for_template(LLAMA_TEMPLATE) is _llama_json


def test_hermes_format() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    content, calls = _hermes(text)
    assert content == "Let me check."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                     {"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert _hermes("No tools needed.") is None
    assert _hermes('<tool_call>{"name": broken</tool_call>') is None  # not JSON: left as text


def test_llama_json_format() -> None:
    content, calls = _llama_json('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                 '{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content is None and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[1]["arguments"] == {"zone": "CET"}
    assert _llama_json("The weather is fine.") is None


@pytest.mark.parametrize("plan,text,names,args", [
    (ToolPlan("auto", ["get_weather"], _hermes),
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', ["get_weather"],
     [{"city": "Oslo"}]),
    (ToolPlan("required", ["get_weather", "get_time"]),
     '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "A"}}]',
     ["get_time", "get_weather"], [{"zone": "UTC"}, {"city": "A"}]),
    (ToolPlan("named", ["get_weather"]), '{"city": "Lima"}', ["get_weather"], [{"city": "Lima"}]),
])
def test_streamed_and_whole_answers_carry_the_same_calls(plan, text, names, args) -> None:
    message, finish = tool_message(plan, text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == names
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == args
    # The same answer streamed, cut in pieces, assembled by the SDK's own stream state.
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    state = ChatCompletionStreamState()
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    events = [first]
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    for k in range(len(pieces)):
        events += tool_stream_events(head, 0, plan, "".join(pieces[:k + 1]), "stop" if k == len(pieces) - 1 else None)
    for e in events:
        state.handle_chunk(ChatCompletionChunk.model_validate(e))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
        list(zip(names, args))


def test_plain_text_stays_content() -> None:
    message, finish = tool_message(ToolPlan("auto", ["get_weather"], _hermes), "It is sunny.", "stop")
    assert message == {"role": "assistant", "content": "It is sunny."} and finish == "stop"


@pytest.mark.parametrize("template,call_text", [(HERMES_TEMPLATE, '"arguments": {"city": "Oslo"}'),
                                                (LLAMA_TEMPLATE, '"parameters": {"city": "Oslo"}')])
def test_templates_render_tools_calls_and_results(weights, tmp_path, template, call_text) -> None:
    tok = _tokenizer(weights, tmp_path, template)
    request = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 7}'}]
    messages = [{**{k: m[k] for k in ("role", "content")}, **template_messages(m, i)} for i, m in enumerate(request)]
    text = tok.render(messages, tools=[WEATHER])
    assert json.dumps(WEATHER) in text and call_text in text and '{"temp": 7}' in text
    assert json.dumps(WEATHER) not in tok.render(messages[:1])


@pytest.fixture(scope="module")
def compiler(weights: Path) -> GrammarCompiler:
    tok = ChatTokenizer(weights)
    return GrammarCompiler(tok, 49152, (tok.eos_token_id,))


@pytest.mark.parametrize("body,message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "'tools[0].function.parameters' is not a valid JSON schema"),
    ({"tools": [WEATHER, WEATHER]}, "names a function twice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tool_choice": "required"}, "'tools' is empty"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "with a 'name'"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "not supported"),
    ({"guided_regex": "[a-"}, "the regex cannot be used"),
    ({"guided_json": {"type": "objekt"}}, "'guided_json' is not a valid JSON schema"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "give one of 'guided_json', 'guided_regex', not 2"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "not two of them"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "not two of them"),
    ({"guided_decoding_backend": 3, "guided_regex": "a"}, "'guided_decoding_backend' must be a string"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "or a 'guided_' field"),
    ({"messages_ok": True, "logit_bias": {"a": 1}}, "not a token id"),
])
def test_bad_tool_and_format_fields_are_named(compiler, body, message) -> None:
    body = {k: v for k, v in body.items() if k != "messages_ok"}
    with pytest.raises(RequestError) as e:
        parse_extras(body, True, compiler, 49152, HERMES_TEMPLATE)
    assert e.value.status == 400 and message in e.value.message


@pytest.mark.parametrize("field,kind,value", [
    ("guided_json", "json", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    ("guided_json", "json", '{"type": "array", "items": {"type": "string"}, "maxItems": 2}'),
    ("guided_regex", "regex", "[0-9]{3}-[a-z]+"),
    ("guided_choice", "choice", ["red", "green"]),
    ("guided_grammar", "grammar", 'root ::= "yes" | "no"'),
])
def test_vllms_former_guided_fields_ask_what_structured_outputs_asks(compiler, field, kind, value) -> None:
    """guided_json / guided_regex / guided_choice / guided_grammar (vLLM before structured_outputs)
    give the grammar that structured_outputs' key of the same kind gives, with or without
    guided_decoding_backend."""
    new = parse_extras({"structured_outputs": {kind: value}}, True, compiler, 49152, HERMES_TEMPLATE)
    for backend in ({}, {"guided_decoding_backend": "xgrammar"}):
        old = parse_extras({field: value, **backend}, True, compiler, 49152, HERMES_TEMPLATE)
        assert old.spec == new.spec and old.constraint is not None and old.constraint.grammar is not None


def test_a_schema_is_checked_against_its_metaschema_once(compiler) -> None:
    """The same schema again, keys in another order, is not checked again (the check took ~3.5 ms a
    request); a bad one is still refused the second time, with the same message."""
    from servekit.handlers.llm_openai_tools import _schema_problem

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    parse_extras({"response_format": fmt}, True, compiler, 49152, HERMES_TEMPLATE)
    misses = _schema_problem.cache_info().misses
    reordered = {"required": ["n"], "properties": {"n": {"minimum": 3, "type": "integer"}}, "type": "object"}
    parse_extras({"response_format": {**fmt, "json_schema": {"name": "y", "schema": reordered}}}, True, compiler, 49152,
                 HERMES_TEMPLATE)
    assert _schema_problem.cache_info().misses == misses
    bad = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "3"}}}}
    messages = []
    for _ in range(2):
        with pytest.raises(RequestError) as e:
            parse_extras(bad, True, compiler, 49152, HERMES_TEMPLATE)
        messages.append(e.value.message)
    assert messages[0] == messages[1] and "at minimum" in messages[0]


def test_min_tokens_and_auto_tools_give_a_constraint_and_a_tool_plan(compiler) -> None:
    assert parse_extras({"min_tokens": 3}, True, compiler, 49152, HERMES_TEMPLATE).constraint is not None
    assert parse_extras({"tools": [WEATHER]}, True, compiler, 49152, HERMES_TEMPLATE).plan.mode == "auto"


def test_assistant_tool_calls_need_json_arguments() -> None:
    with pytest.raises(RequestError, match=r"tool_calls\[0\].function.arguments' is not JSON"):
        template_messages({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}, 1)
    with pytest.raises(RequestError, match="tool_call_id"):
        template_messages({"role": "tool", "content": "7"}, 2)
