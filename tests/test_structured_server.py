"""Structured outputs and tool calls against a live TorchServe (SmolLM2 on CPU, continuous batching;
the server of test_llm_continuous_server.py): the openai SDK's ``parse`` with a pydantic model,
vLLM's ``structured_outputs`` (regex, choice), JSON schemas streamed and not, a streamed tool-call
loop (call -> tool result -> answer), logit_bias, and bad schemas answered 400 while their
batch-mates finish."""
from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from servekit.torchserve import TorchServe
from test_llm_continuous_server import server  # noqa: F401  (the live server fixture, reused)
from test_structured_engine import SCHEMAS

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def client(server: TorchServe):  # noqa: F811
    return openai.OpenAI(base_url=f"{server.inference_url}/predictions/smollm2/1.0/v1", api_key="unused",
                         max_retries=0, timeout=300)


def _post(server: TorchServe, body: dict) -> tuple[int, dict]:  # noqa: F811
    req = urllib.request.Request(f"{server.inference_url}/predictions/smollm2/1.0/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "other"]


def test_sdk_parse_with_a_pydantic_model(client) -> None:
    r = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=80, temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schemas_validate_streamed_and_not(client, stream: bool) -> None:
    prompts = ["Give me an example.", "Fill this in about a cat."]
    results: dict[tuple[int, int], tuple[str, str]] = {}

    def one(i: int, p: int) -> None:
        kw = dict(model="smollm2", messages=[{"role": "user", "content": prompts[p]}], max_tokens=120,
                  temperature=0, response_format={"type": "json_schema",
                                                  "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i]}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        results[(i, p)] = (text, finish)

    cases = [(i, p) for i in (0, 3, 5, 11, 16, 19) for p in range(len(prompts))]
    threads = [threading.Thread(target=one, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (i, p), (text, finish) in results.items():
        assert finish == "stop", (i, p, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert len(results) == len(cases)


def test_structured_outputs_regex_choice_and_logit_bias(client) -> None:
    msgs = [{"role": "user", "content": "Is the sky blue?"}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20, temperature=0.8, seed=3,
                                       extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", r.choices[0].message.content)
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=5, temperature=0,
                                       logit_bias={"28": 100})  # token 28: ","
    assert r.choices[0].message.content == "," * 5


def test_vllms_former_guided_fields(client) -> None:
    """Clients written for vLLM before structured_outputs send guided_json / guided_choice (and a
    guided_decoding_backend): the answer follows them."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Name a city and rank it."}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=60, temperature=0.7, seed=5,
                                       extra_body={"guided_json": schema, "guided_decoding_backend": "outlines"})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model="smollm2", prompt="The best colour is", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["teal", "amber"]})
    assert r.choices[0].text in ("teal", "amber")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_loop(client, choice) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME],
                                                tool_choice=choice, parallel_tool_calls=False, max_tokens=60,
                                                temperature=0, stream=True):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:  # the deltas as the SDK hands them over
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
    if not isinstance(choice, str):
        assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 7, "unit": "C"})}]
    r = client.chat.completions.create(model="smollm2", messages=msgs, tools=[WEATHER, TIME], tool_choice="none",
                                       max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def test_non_streamed_required_tool_call(client) -> None:
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Time in Tokyo?"}],
                                       tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=60, temperature=0)
    msg = r.choices[0]
    assert msg.finish_reason == "tool_calls" and len(msg.message.tool_calls) == 1
    fn = msg.message.tool_calls[0].function
    tool = {"get_weather": WEATHER, "get_time": TIME}[fn.name]
    jsonschema.validate(json.loads(fn.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex cannot be used"),
    ({"structured_outputs": {"regex": "a{300000}"}}, "regex makes decoding too slow"),
    ({"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "json admits no output"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}, "unknown field 'guided_whitespace_pattern'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"logit_bias": {"999999": 5}}, "outside the vocabulary"),
    ({"logit_bias": {"5": 500}}, "logit_bias[5]"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5}, "'min_tokens' (5) is more than the 4 tokens"),
])
def test_bad_requests_get_a_400_while_batch_mates_finish(server, body, message) -> None:  # noqa: F811
    good: dict = {}

    def mate() -> None:
        good["r"] = _post(server, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                                   "temperature": 0, "response_format": {"type": "json_object"}})

    t = threading.Thread(target=mate)
    t.start()
    status, answer = _post(server, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
    t.join()
    assert status == 400 and message in answer["error"]["message"], answer
    assert good["r"][0] == 200 and good["r"][1]["choices"][0]["message"]["content"].startswith("{")
