"""benchmarks/structured_bench.py without a model: its schemas cover what the structured-outputs
target names, each answer is judged valid only when it stopped, parses and validates, and a
streamed answer is assembled from OpenAI chunks (against a scripted loopback server; the bench
itself runs against SmolLM2 on TorchServe: docs/structured-output.md, "Served benchmark")."""
from __future__ import annotations

import json

import jsonschema
import pytest

from http_double import HttpDouble, JsonHandler
from servekit.benchmarks import structured_bench as sb


def _walk(schema: dict):
    yield schema
    for key in ("properties",):
        for sub in schema.get(key, {}).values():
            yield from _walk(sub)
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"])
    for sub in schema.get("anyOf", []):
        yield from _walk(sub)


def test_the_schemas_cover_the_targets_features_and_are_valid():
    assert len(sb.SCHEMAS) >= 20 and len({n for n, _, _ in sb.SCHEMAS}) == len(sb.SCHEMAS)
    seen = set()
    for _, _, schema in sb.SCHEMAS:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        for node in _walk(schema):
            if node.get("type") == "object" and node is not schema:
                seen.add("nested object")
            if node.get("type") == "array" and {"minItems", "maxItems"} <= set(node):
                seen.add("array bounds")
            if "enum" in node:
                seen.add("enum")
            if node.get("type") in ("integer", "number") and "maximum" in node:
                seen.add(f"{node['type']} bounds")
            if "pattern" in node:
                seen.add("pattern")
            if node.get("type") == "object" and set(node["properties"]) - set(node["required"]):
                seen.add("optional")
            if "anyOf" in node:
                seen.add("anyOf")
            if node.get("type") == "string" and "pattern" not in node:
                assert "maxLength" in node, "an unbounded string lets a sampled answer run into max_tokens"
    assert seen == {"nested object", "array bounds", "enum", "integer bounds", "number bounds", "pattern",
                    "optional", "anyOf"}


PERSON = sb.SCHEMAS[0][2]


@pytest.mark.parametrize("finish, text, error", [
    ("stop", '{"name":"Ana","age":31,"email":"ana@mail.com"}', ""),
    ("length", '{"name":"Ana","age":31,"email":"ana@mail.com"}', "finish_reason 'length'"),
    ("stop", '{"name":"Ana","age":31,', "not JSON"),
    ("stop", '{"name":"Ana","age":131,"email":"ana@mail.com"}', "invalid at age"),
    ("stop", '{"name":"Ana","age":31,"email":"ANA@mail.com"}', "invalid at email"),
    ("stop", '{"name":"Ana","age":31,"email":"a@b.com","x":1}', "invalid at (root)"),
])
def test_an_answer_is_valid_only_when_it_stopped_parses_and_validates(finish, text, error):
    a = sb.check(sb.Answer("person", False, 200, finish, text, 9, None, 0.1), PERSON)
    assert a.valid is (error == "") and a.error.startswith(error)


class ScriptedChat(JsonHandler):
    """A chat-completions endpoint that answers the schema's example, as JSON or as OpenAI SSE chunks."""

    def do_POST(self):
        body = self.json_body()
        if self.path != "/v1/chat/completions":
            return self.reply(400, {"error": {"message": "unknown route"}})
        fmt = body.get("response_format", {})
        assert fmt.get("type") == "json_schema" and fmt["json_schema"]["strict"] is True
        pieces = ['{"name":"Ana",', '"age":31,', '"email":"ana@mail.com"}']
        if not body.get("stream"):
            return self.reply(200, {"choices": [{"finish_reason": "stop", "message": {"content": "".join(pieces)}}],
                                    "usage": {"completion_tokens": 12}})
        assert body["stream_options"] == {"include_usage": True}
        events = [{"choices": [{"delta": {"role": "assistant"}}]}]
        events += [{"choices": [{"delta": {"content": p}}]} for p in pieces]
        events += [{"choices": [{"delta": {}, "finish_reason": "stop"}]}, {"choices": [], "usage": {"completion_tokens": 12}}]
        self.reply(200, "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n", "text/event-stream")


@pytest.fixture
def endpoint():
    server = HttpDouble(ScriptedChat)
    yield server.url + "/v1/chat/completions"
    server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_answers_are_assembled_the_same_streamed_and_not(endpoint, stream):
    a = sb.check(sb.chat(endpoint, "Give me a person as JSON.", 64, stream, ("person", PERSON), seed=3), PERSON)
    assert a.valid and a.status == 200 and a.tokens == 12 and a.finish == "stop"
    if stream:
        assert a.ttft_s is not None and 0 < a.ttft_s <= a.total_s
    else:
        assert a.ttft_s is None


def test_a_refused_request_keeps_its_status_and_message(endpoint):
    a = sb.chat(endpoint.replace("/v1/chat/completions", "/nowhere"), "x", 8, True)
    assert a.status == 400 and "unknown route" in a.error
    assert not sb.check(a, PERSON).valid


def test_warming_uses_every_schema_once_and_names_refusals(endpoint):
    got = sb.warm_schemas(endpoint)
    assert got["schemas"] == len(sb.SCHEMAS) and got["refused"] == {}
    refused = sb.warm_schemas(endpoint.replace("/v1/chat/completions", "/nowhere"))["refused"]
    assert sorted(refused) == sorted(n for n, _, _ in sb.SCHEMAS) and "unknown route" in refused["person"]
