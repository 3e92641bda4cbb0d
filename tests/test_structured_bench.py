"""benchmarks/structured_bench.py without a model: its schemas cover what the structured-outputs
target names, each answer is judged valid only when it stopped, parses and validates, and a
streamed answer is assembled from OpenAI chunks (against a scripted loopback server; the bench
itself runs against SmolLM2 on TorchServe: docs/structured-output.md, "Served benchmark")."""
from __future__ import annotations

import json
import time
from pathlib import Path

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
    """A chat-completions endpoint that answers the schema's example (12 tokens), as JSON or as
    OpenAI SSE chunks; a free request gets 5 words, or ``max_tokens`` of them with ``ignore_eos``.
    Every request's body is kept in ``seen``; with ``slow`` set, a request of seed 0 takes that many
    seconds, and each request's (seed, start, end) goes into ``timeline``."""

    seen: list[dict] = []
    slow: float = 0.0
    timeline: list[tuple[int, float, float]] = []

    def do_POST(self):
        body = self.json_body()
        self.seen.append(body)
        if self.slow:
            start = time.perf_counter()
            time.sleep(self.slow if body.get("seed") == 0 else 0.01)
            self.timeline.append((body.get("seed"), start, time.perf_counter()))
        if self.path != "/v1/chat/completions":
            return self.reply(400, {"error": {"message": "unknown route"}})
        fmt = body.get("response_format")
        if fmt is not None:
            assert fmt.get("type") == "json_schema" and fmt["json_schema"]["strict"] is True
            pieces = ['{"name":"Ana",', '"age":31,', '"email":"ana@mail.com"}']
            tokens, finish = 12, "stop"
        else:
            tokens = body["max_tokens"] if body.get("ignore_eos") else min(5, body["max_tokens"])
            pieces, finish = ["word "] * tokens, "length" if tokens == body["max_tokens"] else "stop"
        if not body.get("stream"):
            return self.reply(200, {"choices": [{"finish_reason": finish, "message": {"content": "".join(pieces)}}],
                                    "usage": {"completion_tokens": tokens}})
        assert body["stream_options"] == {"include_usage": True}
        events = [{"choices": [{"delta": {"role": "assistant"}}]}]
        events += [{"choices": [{"delta": {"content": p}}]} for p in pieces]
        events += [{"choices": [{"delta": {}, "finish_reason": finish}]},
                   {"choices": [], "usage": {"completion_tokens": tokens}}]
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


def _answers(lengths: list[int], ttft: float = 0.05, status: int = 200) -> list:
    return [sb.Answer(None, True, status, "stop", "", n, ttft, 0.2) for n in lengths]


def test_free_requests_are_capped_at_the_constrained_answers_lengths():
    rounds = [_answers([50, 12, 0]), _answers([128, 7, 33])]
    assert sb.matched_max_tokens(rounds) == [[50, 12, 1], [128, 7, 33]]


def test_matched_free_answers_are_exactly_as_long_as_the_constrained_ones(endpoint):
    """The "matched" mix asks each free request for its constrained answer's length with
    ``ignore_eos``, so a free answer that would stop sooner (5 words here) is that long too."""
    ScriptedChat.seen.clear()
    mixes = sb.mixed(endpoint, 3, 2, 64, mixes=("free", "constrained", "matched"))
    assert [m["mean_answer_tokens"] for m in mixes] == [5.0, 12.0, 12.0]
    free, matched = ScriptedChat.seen[:6], ScriptedChat.seen[12:]
    assert len(matched) == 6 and all(b["max_tokens"] == 12 and b["ignore_eos"] is True for b in matched)
    assert all("ignore_eos" not in b and b["max_tokens"] == 64 for b in free)


@pytest.mark.parametrize("load", sb.LOADS)
def test_streams_send_each_clients_next_request_as_its_last_ends_and_rounds_wait_for_the_slowest(endpoint, load):
    """``--load streams``: a client whose answers come fast goes on to its next request while a slow
    one (seed 0 here) is still answering; ``rounds``: nobody starts round 2 before round 1's
    slowest answer. Either way every request is sent once and the matched mix copies the lengths."""
    ScriptedChat.seen.clear()
    ScriptedChat.timeline.clear()
    ScriptedChat.slow = 0.3
    try:
        mixes = sb.mixed(endpoint, 3, 2, 64, mixes=("constrained", "matched"), load=load)
    finally:
        ScriptedChat.slow = 0.0
    assert [(m["load"], m["requests"], m["mean_answer_tokens"]) for m in mixes] == [(load, 6, 12.0)] * 2
    assert all(b["max_tokens"] == 12 and b["ignore_eos"] for b in ScriptedChat.seen[6:])
    first_slow_end = min(end for seed, _, end in ScriptedChat.timeline[:6] if seed == 0)
    fast_starts = sorted(start for seed, start, _ in ScriptedChat.timeline[:6] if seed != 0)
    assert len(fast_starts) == 4
    # the fast clients' second requests: before the slow answer ends only when streaming
    assert (fast_starts[-1] < first_slow_end) is (load == "streams")
    with pytest.raises(ValueError, match="load 'waves'"):
        sb.mixed(endpoint, 3, 1, 64, load="waves")


def test_the_comparison_gives_the_share_against_free_and_against_matched_lengths():
    handler = {"handler_ttft_ms_mean": 20.0, "handler_itl_ms_mean": 2.0}
    mixes = [sb.mix_row("all free", 0.0, 4, _answers([100, 100, 100, 100]), 0.1, handler),
             sb.mix_row("half constrained", 0.5, 4, _answers([100, 100, 50, 50]), 0.1, handler),
             sb.mix_row("all constrained", 1.0, 4, _answers([50, 50, 40, 60], ttft=0.08) + _answers([0], status=400), 0.1,
                        {**handler, "handler_ttft_ms_mean": 23.5}),
             sb.mix_row(sb.MATCHED, 0.0, 4, _answers([50, 50, 40, 55]), 0.05, {})]
    free, constrained, matched = mixes[0], mixes[2], mixes[3]
    assert free["tok_per_s_total"] == 4000 and free["tokens_per_step"] == 8.0 and free["mean_answer_tokens"] == 100
    assert constrained["failed"] == 1 and constrained["mean_answer_tokens"] == 50 and constrained["tok_per_s_total"] == 2000
    assert matched["tokens_per_step"] is None and matched["ttft_ms_p50"] == 50.0
    c = sb.compare(mixes)
    assert c["vs_free"]["share"] == 0.5 and not c["vs_free"]["met"]
    assert c["vs_free_matched"]["share"] == round(2000 / 3900, 3) and c["vs_free_matched"]["free_answer_tokens"] == 48.8
    assert sb.compare(mixes, target=0.5)["vs_free"]["met"]
    # how much later the constrained first tokens came under the same load: clients and handler
    assert c["vs_free"]["ttft_later_ms_p50"] == 30.0 and c["vs_free_matched"]["ttft_later_ms_p50"] == 30.0
    assert c["vs_free"]["handler_ttft_later_ms_mean"] == 3.5
    assert c["vs_free_matched"]["handler_ttft_later_ms_mean"] is None  # the matched mix ran without the handler's metrics
    # the same difference as added_ttft() takes for a cached schema and a first use
    assert sb.added(12.5, 10.25) == 2.25 and sb.added(None, 10.25) is None and sb.added(12.5, None) is None
    md = sb.markdown({"environment": {}, "mixed": mixes, "comparison": {"rounds": c}})
    assert "| free, matched lengths (4 at once) | 4 | 48.8 | 3900.0 | None |" in md
    assert "At once, all constrained against free answers: 2000.0 / 4000.0 tokens/s = 50% (target 90%: missed" in md
    assert "free answers of the constrained answers' lengths: 2000.0 / 3900.0 tokens/s = 51%" in md
    assert "A constrained first token came 30.0 ms later at the median (the handler's mean: 3.5 ms)" in md


def test_model_dir_serves_a_converted_checkpoint_under_its_folders_name(tmp_path, capsys):
    """``--model-dir``: the bench archives and calls a converted LLM folder by its name, with the
    folder's archive spec; a folder that is not a model is refused before any server starts."""
    from servekit.benchmarks import shaped_models
    from servekit.model_source import LLM

    assert sb.served_model(None) == (sb.MODEL, None)
    folder = shaped_models.decoder(tmp_path / "Qwen-Tiny", "qwen2.5-0.5b", hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    name, spec = sb.served_model(folder)
    assert name == "Qwen-Tiny" and spec.kind == LLM and spec.config == folder
    files = {(w if isinstance(w, Path) else w[0]).name for w in spec.weights()}
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= files
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:
        sb.main(["--out", str(tmp_path / "out"), "--model-dir", str(tmp_path / "empty")])
    assert e.value.code == 2 and f"--model-dir {tmp_path / 'empty'}:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
