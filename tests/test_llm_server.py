"""Live TorchServe with the SmolLM2 archive format (CPU plan with speculative decoding, heads trained
by conftest's fixture): the official openai client, streaming and not, text completions, per-request
errors inside a shared batch, the LLM and speculative-decoding metrics.

The archive holds conftest's `tiny_smollm2`: SmolLM2's tokenizer and chat template with a tiny random
model, since what is checked here is the protocol and the engine, not SmolLM2's answers (those:
test_speculative_smollm2.py, test_structured_server.py, test_reliability_faults.py).

Expected texts come from the same weights run in-process without speculation (fp32, greedy,
servekit.optimizations.llm.offline), so the server must produce exactly what plain greedy decoding produces
while it accepts several drafted tokens per step.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from servekit.torchserve import TorchServe
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import Completion, generate
from servekit.optimizations.models.llama import load_llama

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def weights_dir(tiny_smollm2: list[Path]) -> Path:
    return tiny_smollm2[0].parent


@pytest.fixture(scope="module")
def server(tiny_smollm2_spec_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    with TorchServe(tmp_path_factory.mktemp("ts-llm"), tiny_smollm2_spec_store) as ts:
        # A long batch delay so that requests sent together share a batch.
        ts.register("smollm2.mar", "smollm2", batch_size=4, max_batch_delay_ms=400, workers=1, timeout=240)
        yield ts


@pytest.fixture(scope="module")
def reference_runner(weights_dir: Path):
    """The archive's weights in-process with the server's plan: (tokenizer, generate(ids, **sampling))."""
    tok = ChatTokenizer(weights_dir)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    runner = LlamaRunner(load_llama(weights_dir, "cpu", torch.float32), max_seq_len=1024, batch_buckets=(1,),
                         prefill_buckets=(32, 64, 128, 256, 512, 1024), kv_buckets=(256, 512, 1024))
    stops = (tok.eos_token_id, tok.token_id("<|endoftext|>"))

    def run(ids: list[int], max_tokens: int, **sampling: Any) -> Completion:
        return generate(runner, [ids], [SamplingParams(max_tokens=max_tokens, stop_token_ids=stops, **sampling)])[0]

    yield tok, run
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def reference(reference_runner):
    """Greedy completion of prompt ids: (text, tokens)."""
    tok, run = reference_runner

    def complete(ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
        out = run(ids, max_tokens)
        tokens = out.tokens[:-1] if out.finish_reason == "stop" else out.tokens
        return tok.decode(tokens), out.tokens

    return tok, complete


@pytest.fixture(scope="module")
def client(server: TorchServe):
    return openai.OpenAI(base_url=f"{server.inference_url}/predictions/smollm2/1.0/v1", api_key="unused",
                         max_retries=0, timeout=120)


def post(server: TorchServe, route: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server.inference_url}/predictions/smollm2/1.0/{route}",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric_sum(server: TorchServe, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{server.metrics_url}/metrics", timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_for_change(server: TorchServe, name: str, before: float, timeout: float = 15.0) -> float:
    """The metric's sum once it differs from `before` (metrics reach /metrics asynchronously)."""
    deadline = time.monotonic() + timeout
    while (now := metric_sum(server, name)) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    return now


def test_openai_client_streams_a_chat_completion(client, reference) -> None:
    tok, complete = reference
    want, tokens = complete(tok.encode_chat(MESSAGES), 24)
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == want and want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert reasons == ["stop" if len(tokens) < 24 else "length"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(tokens) and usage.prompt_tokens == len(tok.encode_chat(MESSAGES))


def test_non_streaming_chat_and_text_completions(client, reference) -> None:
    tok, complete = reference
    want, tokens = complete(tok.encode_chat(MESSAGES), 24)
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and r.object == "chat.completion"
    assert r.usage.completion_tokens == len(tokens)
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens  # OpenAI's field, always there
    prompt = "The three primary colors are"
    want, _ = complete(tok.encode(prompt), 12)
    c = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert c.choices[0].text == want and c.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stream=True) if ch.choices)
    assert streamed == want


def test_vllm_sampling_fields_at_their_defaults_change_nothing(client, reference) -> None:
    """Clients that send all of vLLM's sampling fields send the ones servekit does not implement at
    their defaults, and OpenAI's SDK sends the successors of `user`: the answer is the plain one.
    Another value is a 400 naming the field."""
    tok, complete = reference
    want, _ = complete(tok.encode_chat(MESSAGES), 12)
    defaults = {"min_p": 0.0, "repetition_penalty": 1.0, "length_penalty": 1, "use_beam_search": False,
                "skip_special_tokens": True, "spaces_between_special_tokens": True, "add_generation_prompt": True,
                "continue_final_message": False}
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body=defaults)
    assert r.choices[0].message.content == want
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0,
                                       safety_identifier="u-1", prompt_cache_key="chats",
                                       prompt_cache_retention="in_memory")  # OpenAI's successors of `user`
    assert r.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError, match="'prompt_cache_key' must be a string"):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4,
                                       extra_body={"prompt_cache_key": 5})
    for field, value in (("min_p", 0.05), ("repetition_penalty", 1.1), ("use_beam_search", 0),
                         ("prompt_cache_retention", "24h")):
        with pytest.raises(openai.BadRequestError, match=f"'{field}' is not supported"):
            client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4,
                                           extra_body={field: value})


def test_stop_strings_and_seeded_sampling(client, reference) -> None:
    tok, complete = reference
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    full, _ = complete(tok.encode_chat(msgs), 40)
    words = full.split()
    stop = words[len(words) // 2]
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].message.content == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40, temperature=0, stop=[stop],
                                       extra_body={"include_stop_str_in_output": True})  # vLLM's field
    assert r.choices[0].message.content == full[:full.index(stop) + len(stop)]
    sampled = [client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20, temperature=1.0,
                                              seed=seed).choices[0].message.content for seed in (5, 5, 6)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_chat_template_kwargs_pass_through_the_server(client, server: TorchServe) -> None:
    """vLLM's ``chat_template_kwargs`` through TorchServe and the SDK's ``extra_body``: SmolLM2's
    template has no ``enable_thinking``, so the answer is the one without it; a variable the server
    sets itself is the request's 400."""
    msgs = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6, temperature=0)
    with_kwargs = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=6, temperature=0,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert with_kwargs.choices[0].message.content == plain.choices[0].message.content
    assert with_kwargs.usage.prompt_tokens == plain.usage.prompt_tokens
    status, answer = post(server, "v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"tools": []}})
    assert status == 400 and "cannot set 'tools'" in answer["error"]["message"]


def test_bad_requests_get_their_own_errors_within_a_shared_batch(server: TorchServe, reference) -> None:
    tok, complete = reference
    want, _ = complete(tok.encode_chat(MESSAGES), 8)
    good = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    bodies = [good, {"messages": [], "max_tokens": 8}, {**good, "max_tokens": 100_000}, {**good, "frobnicate": 2}]
    before = metric_sum(server, "servekit_batches_total")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda b: post(server, "v1/chat/completions", b), bodies))
    assert [s for s, _ in results] == [200, 400, 400, 400]
    assert results[0][1]["choices"][0]["message"]["content"] == want
    assert [b["error"]["code"] for _, b in results[1:]] == ["empty_messages", "invalid_value", "unknown_field"]
    assert "max_tokens" in results[2][1]["error"]["message"]
    assert wait_for_change(server, "servekit_batches_total", before) - before == 1  # the four shared one batch


@pytest.mark.parametrize("route, body, status, code", [
    ("v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}]}, 400,
     "context_length_exceeded"),
    ("v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "missing_field"),  # no tool_call_id
    ("v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_type"),
    ("v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, 400, "invalid_type"),
    ("v1/chat/completions", {"messages": MESSAGES, "n": 0}, 400, "invalid_value"),
    ("v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, 400, "too_many_choices"),
    ("v1/completions", {"prompt": ""}, 400, "empty_prompt"),
    ("v1/completions", {"prompt": [[5, 6], []]}, 400, "empty_prompt"),
    ("v1/completions", {"prompt": [5, -1]}, 400, "invalid_value"),
    ("v1/completions", {"prompt": [5, True]}, 400, "invalid_type"),
    ("v1/completions", {"prompt": "x", "speculate": "yes"}, 400, "invalid_type"),
    ("v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "invalid_type"),
    ("v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "invalid_value"),
    ("v1/completions", {"prompt": "x", "stop_token_ids": 5}, 400, "invalid_type"),
    ("v1/completions", {"prompt": "x", "include_stop_str_in_output": "yes"}, 400, "invalid_type"),
    ("v1/chat/completions", {"messages": MESSAGES, "stop_token_ids": list(range(65))}, 400, "invalid_value"),
    ("v1/chat/completions", {"messages": MESSAGES, "ignore_eos": True, "response_format": {"type": "json_object"}},
     400, "invalid_value"),
    ("v1/embeddings", {"input": "x"}, 404, "unknown_route"),
])
def test_invalid_requests(server: TorchServe, route: str, body: dict, status: int, code: str) -> None:
    got, answer = post(server, route, body)
    assert (got, answer["error"]["code"]) == (status, code)


def test_llm_metrics_are_exported(server: TorchServe, client) -> None:
    before = metric_sum(server, "servekit_llm_completion_tokens_total")
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6, temperature=0)
    assert wait_for_change(server, "servekit_llm_completion_tokens_total", before) - before == r.usage.completion_tokens
    assert metric_sum(server, "servekit_llm_prompt_tokens_total") > 0
    assert metric_sum(server, "servekit_llm_ttft_seconds_count") > 0
    assert metric_sum(server, "servekit_llm_itl_seconds_count") > 0
    assert metric_sum(server, "servekit_llm_ttft_seconds_bucket") > 0


def test_speculative_decoding_is_exact_and_reports_acceptance(server: TorchServe, client, reference) -> None:
    tok, complete = reference
    msgs = [{"role": "user", "content": "Count to three."}]  # a prompt the fixture's heads trained on
    want, tokens = complete(tok.encode_chat(msgs), 32)
    proposed = [metric_sum(server, "servekit_spec_proposed_total", Position=str(j)) for j in range(3)]
    accepted = [metric_sum(server, "servekit_spec_accepted_total", Position=str(j)) for j in range(3)]
    chunks = list(client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert len(content_chunks) < len(tokens) - 1, "no step delivered more than one token"
    wait_for_change(server, "servekit_spec_proposed_total", sum(proposed))
    new_proposed = [metric_sum(server, "servekit_spec_proposed_total", Position=str(j)) - proposed[j]
                    for j in range(3)]
    new_accepted = [metric_sum(server, "servekit_spec_accepted_total", Position=str(j)) - accepted[j]
                    for j in range(3)]
    # Every verify step proposes at each position; a draft counts as accepted only after the ones before it.
    assert new_proposed[0] == new_proposed[1] == new_proposed[2] > 0, new_proposed
    assert new_proposed[0] >= new_accepted[0] >= new_accepted[1] >= new_accepted[2], new_accepted
    # Tokens = prefill's first + per verify step (1 + accepted drafts), the last step cut short by
    # max_tokens or the stop token by at most its 3 accepted drafts.
    emitted = 1 + new_proposed[0] + sum(new_accepted)
    assert emitted - 3 <= len(tokens) <= emitted, (new_proposed, new_accepted, len(tokens))
    assert metric_sum(server, "servekit_plan_info", Plan="fp32+spec3") == 1


def test_requests_can_opt_out_of_speculation(server: TorchServe, reference) -> None:
    tok, complete = reference
    want, _ = complete(tok.encode_chat(MESSAGES), 12)
    before = metric_sum(server, "servekit_spec_proposed_total")
    tokens_before = metric_sum(server, "servekit_llm_completion_tokens_total")
    status, body = post(server, "v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                                         "speculate": False})
    assert status == 200 and body["choices"][0]["message"]["content"] == want
    wait_for_change(server, "servekit_llm_completion_tokens_total", tokens_before)
    assert metric_sum(server, "servekit_spec_proposed_total") == before


def test_stop_token_ids_end_the_answer_unprinted_and_wait_for_min_tokens(server: TorchServe, reference) -> None:
    """vLLM's ``stop_token_ids``: the answer ends at the first of them, which is not printed, beside
    the model's own stop tokens (also with ignore_eos); with ``min_tokens`` they are held back as the
    model's are."""
    tok, complete = reference
    prompt = "The capital of France is"
    text, tokens = complete(tok.encode(prompt), 8)
    stop = tokens[3]
    cut = tokens[:tokens.index(stop)]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}
    # The same tokens cut by max_tokens: the answer's text as the server detokenizes them
    status, shorter = post(server, "v1/completions", {"prompt": prompt, "max_tokens": len(cut), "temperature": 0})
    assert status == 200 and shorter["usage"]["completion_tokens"] == len(cut), shorter
    for extra in ({}, {"ignore_eos": True}):
        status, got = post(server, "v1/completions", {**body, **extra})
        assert status == 200 and got["choices"][0]["finish_reason"] == "stop", got
        assert got["choices"][0]["text"] == shorter["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == len(cut) + 1
    first = {**body, "stop_token_ids": [tokens[0]]}
    status, got = post(server, "v1/completions", first)
    assert status == 200 and got["choices"][0]["text"] == "" and got["usage"]["completion_tokens"] == 1
    status, got = post(server, "v1/completions", {**first, "min_tokens": 4})
    assert status == 200 and got["usage"]["completion_tokens"] >= 4, got


def test_ignore_eos_generates_max_tokens_past_the_stop_token(server: TorchServe, reference) -> None:
    """vLLM's ``ignore_eos``: a logit_bias makes the end-of-turn token the model's every pick, so
    the answer stops at once; with ignore_eos the same request runs to max_tokens (the benchmarks'
    way of timing decode steps with every row busy), streamed as not."""
    tok, _ = reference
    body = {"messages": MESSAGES, "max_tokens": 7, "temperature": 0, "logit_bias": {str(tok.eos_token_id): 100}}
    status, stopped = post(server, "v1/chat/completions", body)
    assert status == 200 and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    status, got = post(server, "v1/chat/completions", {**body, "ignore_eos": True})
    assert status == 200 and got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 7
    req = urllib.request.Request(f"{server.inference_url}/predictions/smollm2/1.0/v1/chat/completions",
                                 data=json.dumps({**body, "ignore_eos": True, "stream": True,
                                                  "stream_options": {"include_usage": True}}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 7


def test_serving_benchmark_measures_the_live_server(server: TorchServe) -> None:
    """benchmarks/llm_serve_bench's measurement against this server (the GPU figures come from it)."""
    from servekit.benchmarks.llm_serve_bench import measure

    prompts = ["Say hello.", "Name a colour."]
    res = measure(server, prompts, concurrency=[1, 2], rounds=1, max_tokens=8, ttft_requests=1)
    assert res["ttft_probe"]["failed"] == 0 and res["ttft_probe"]["prompt_tokens"] >= 100
    for level in res["levels"]:
        c = level["concurrency"]
        assert level["requests"] == c and level["failed"] == 0, level
        assert c <= level["completion_tokens"] <= 8 * c and level["tokens_per_chunk"] >= 1.0, level
        assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"] and 0 < level["itl_ms_p50"] <= level["itl_ms_p99"]
        # Per sequence, 1/ITL (between the slowest and the fastest request's); in total, every token
        # of the level over its round time, which lasts at least one TTFT.
        # (the speed is rounded to 0.1 token/s, hence the 0.05 either side, and ITLs to 0.001 ms,
        # hence the 0.0005 ms: tokens of one speculative step arrive ~0.016 ms apart, where that
        # rounding alone moves 1/ITL by 3%)
        speed = level["tok_per_s_per_seq_p50"]
        slowest, fastest = level["itl_ms_p99"] + 0.0005, max(level["itl_ms_p50"] - 0.0005, 1e-6)
        assert 1e3 / slowest * 0.99 - 0.05 <= speed <= 1e3 / fastest * 1.01 + 0.05
        # (tok/s total is rounded to 0.1: a round that ends with its first chunk, the whole answer
        # in it, gives exactly the bound, rounded up by up to 0.05)
        assert 0 < level["tok_per_s_total"] <= level["completion_tokens"] / (level["ttft_ms_p50"] / 1e3) + 0.05
    assert set(res["texts"]) == {"Say hello."} and res["texts"]["Say hello."]


def test_openai_sdk_multi_turn_with_its_own_message_objects(client, reference) -> None:
    """The SDK's assistant message sent back as it came (`model_dump()`: refusal, annotations, audio,
    function_call, tool_calls all null), with null and no-op fields the SDK and its users send."""
    tok, complete = reference
    first = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0,
                                           tools=None, tool_choice=None, metadata={"team": "search"}, store=False,
                                           user="u-1", parallel_tool_calls=None)
    assert first.system_fingerprint and first.system_fingerprint.startswith("servekit-")
    turn = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(turn)
    follow_up = {"role": "user", "content": "And of Italy?"}
    second = client.chat.completions.create(model="smollm2", messages=[*MESSAGES, turn, follow_up],
                                            max_tokens=8, temperature=0)
    plain = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}, follow_up]
    assert second.choices[0].message.content == complete(tok.encode_chat(plain), 8)[0]


def test_openai_models_api(client) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    card = client.models.retrieve("smollm2")
    assert card.owned_by == "servekit" and card.max_model_len == 1024  # smollm2-cpu.yaml's max_seq_len
    assert card.max_num_seqs == 4  # its batchSize: the requests the engine runs at once
    with pytest.raises(openai.NotFoundError, match="serves 'smollm2'"):
        client.models.retrieve("gpt-4o")


def test_stream_chunks_carry_usage_null_until_the_last(server: TorchServe) -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{server.inference_url}/predictions/smollm2/1.0/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert isinstance(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"], int)
    assert all(c["system_fingerprint"].startswith("servekit-") for c in chunks)


def test_n_choices_and_lists_of_prompts(client, reference) -> None:
    """`n` choices of a seeded request: choice k is what the request alone gives with seed + k; a
    list of prompts: one choice per prompt, each the prompt's own greedy completion."""
    tok, complete = reference
    sampled = dict(model="smollm2", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11)
    both = client.chat.completions.create(n=2, **sampled)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [client.chat.completions.create(**{**sampled, "seed": 11 + k}).choices[0].message.content
             for k in (0, 1)]
    assert [c.message.content for c in both.choices] == alone
    assert both.usage.prompt_tokens == len(tok.encode_chat(MESSAGES))  # the prompt counts once, whatever n
    prompts = ["The capital of France is", "One, two, three,"]
    listed = client.completions.create(model="smollm2", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in listed.choices] == [0, 1]
    assert [c.text for c in listed.choices] == [complete(tok.encode(p), 6)[0] for p in prompts]
    assert listed.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    chunks = list(client.chat.completions.create(n=2, stream=True, **{**sampled, "seed": 11}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == alone


def test_completions_take_prompts_as_token_ids(client, reference) -> None:
    """``prompt`` as token ids (one list, or a list of lists), as OpenAI's API allows: used as they
    are, not tokenized again. The ids need not be any text's encoding."""
    tok, complete = reference
    ids = [tok.encode("The capital of France is"), [1, 2, 3, 500, 1000, 77]]
    one = client.completions.create(model="smollm2", prompt=ids[1], max_tokens=6, temperature=0)
    assert one.choices[0].text == complete(ids[1], 6)[0] and one.usage.prompt_tokens == len(ids[1])
    both = client.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in both.choices] == [complete(q, 6)[0] for q in ids]
    assert both.usage.prompt_tokens == sum(map(len, ids))


def test_openai_logprobs_chat_streamed_and_text_completions(client, reference_runner) -> None:
    """`logprobs`/`top_logprobs` through the SDK: each text token's logprob and its top alternatives,
    as the in-process runner reports them; the tokens' texts make up the answer."""
    tok, run = reference_runner
    want = run(tok.encode_chat(MESSAGES), 10, logprobs=3)
    reported = want.logprobs[:len(want.tokens) - (want.finish_reason == "stop")]  # a stop token is not text
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    assert len(content) == len(reported)
    for got, ref in zip(content, reported):
        assert got.logprob == pytest.approx(ref.logprob, abs=2e-3)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in ref.top], abs=2e-3)
        assert [t.token for t in got.top_logprobs] == [tok.token_text(t) for t, _ in ref.top]
        assert got.token == bytes(got.bytes).decode(errors="replace")
    streamed = [t for ch in client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3, stream=True)
        if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content  # logprobs change no token

    prompt = "The three primary colors are"
    c = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(alts) == 2 and max(alts.values()) == pytest.approx(v) for alts, v in
               zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the chosen token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]


def test_logprobs_with_n_choices(client) -> None:
    both = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6, temperature=1.0,
                                          seed=5, n=2, logprobs=True)
    for choice in both.choices:
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
        assert all(t.logprob <= 0 and t.top_logprobs == [] for t in choice.logprobs.content)


def test_presence_and_frequency_penalties_match_the_runner(client, reference_runner) -> None:
    tok, run = reference_runner
    messages = [{"role": "user", "content": "Write the word cat ten times."}]
    want = run(tok.encode_chat(messages), 24, presence_penalty=0.8, frequency_penalty=1.5)
    tokens = want.tokens[:-1] if want.finish_reason == "stop" else want.tokens
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                       presence_penalty=0.8, frequency_penalty=1.5)
    assert r.choices[0].message.content == tok.decode(tokens)
    assert r.usage.completion_tokens == len(want.tokens)


COMPLETION = "servekit_llm_completion_tokens_total"


def test_the_warm_up_streams_chats_to_an_llm_and_leaves_them_out_of_the_request_metrics(server: TorchServe,
                                                                                          client) -> None:
    """An LLM's inference warm-up (servekit.torchserve.warm_up_inference) also sends streamed two-token
    chats, then bursts of as many concurrent chats as its card's max_num_seqs, so that the
    frontend's streaming path and a burst's paths run before users' first requests; marked, they
    are not counted as requests or tokens. A user's chat after them is."""
    from servekit.benchmarks.llm_workload_bench import warm_up_counts
    from servekit.torchserve import WARM_UP_BURSTS, warm_up_inference

    def chats() -> int:
        return server.log_text("access_log.log").count('"POST /predictions/smollm2/1.0/v1/chat/completions HTTP/1.1"')

    def models() -> int:
        return server.log_text("access_log.log").count('"POST /predictions/smollm2/1.0/v1/models HTTP/1.1"')

    assert chats() >= 1  # registration's warm-up sent one (tests/conftest.py: one request per warm-up)
    before_chats = chats()
    served, completed = metric_sum(server, "servekit_requests_total"), metric_sum(server, COMPLETION)
    assert warm_up_inference(server.inference_url, "smollm2", "1.0", requests=3, budget_s=120) == 200
    sent = 3 + WARM_UP_BURSTS * client.models.retrieve("smollm2").max_num_seqs  # 3 alone, 2 bursts of 4
    deadline = time.monotonic() + 10  # the frontend logs asynchronously
    while chats() < before_chats + sent and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chats() == before_chats + sent
    # The workload benchmark reports the warm-up's requests the same way.
    assert models() >= 4  # registration's one, then these 3
    assert warm_up_counts(server, "smollm2") == {"models_requests": models(), "chats": before_chats + sent}
    # More requests than the budget holds: the models route stops at half of it, the chats get the rest.
    before = warm_up_counts(server, "smollm2")
    t0 = time.monotonic()
    assert warm_up_inference(server.inference_url, "smollm2", "1.0", requests=10**6, budget_s=1.0) == 200
    took = time.monotonic() - t0
    after = warm_up_counts(server, "smollm2")
    assert after["models_requests"] > before["models_requests"] and after["chats"] > before["chats"]
    assert took < 1.0 + 5  # the last chat started before the deadline
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    # The worker writes metric lines in order: once the user's chat shows, so would the warm-up's.
    deadline = time.monotonic() + 15
    while metric_sum(server, COMPLETION) < completed + r.usage.completion_tokens and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric_sum(server, COMPLETION) - completed == r.usage.completion_tokens
    assert metric_sum(server, "servekit_requests_total") == served + 1
