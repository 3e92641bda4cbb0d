"""Grammar-constrained decoding in the continuous engine (CPU): a tiny random Llama with SmolLM2's
vocabulary and tokenizer, so a grammar compiled for SmolLM2 drives it. A random model under a
grammar still writes only what the grammar allows: every output parses and validates over the
schemas below; rows with a grammar, logit_bias or min_tokens share the batch with free, logprobs
and sampled rows, and each row gets what it gets alone."""
from __future__ import annotations

import json
import random
import re
import threading
import time
from dataclasses import replace
from typing import Callable

import jsonschema
import pytest
import torch

from engine_steps import Counted
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import FINISH_ERROR, ContinuousBatcher, SeqUpdate
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.grammar import (CHOICE, GRAMMAR, JSON, JSON_OBJECT, REGEX, GrammarCompiler,
                                                GrammarError, GrammarSpec)
from servekit.optimizations.models.gguf_weights import smollm2_archive_files
from servekit.optimizations.models.llama import LlamaConfig, init_random

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

VOCAB = 49152  # SmolLM2's
STR = {"type": "string", "maxLength": 8}  # strings end: a random model would otherwise write on

# >= 20 schemas: nested objects, arrays with min/max items, enums, bounded numbers, string
# patterns, optional fields, unions, constants.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50,
                                                                       "maximum": 50}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"a": STR, "b": STR}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                      {"enum": ["none"]}]}}, "required": ["v"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "user"}, "id": {"type": "integer", "minimum": 1,
                                                                          "maximum": 999}},
     "required": ["kind", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": STR, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"],
     "additionalProperties": False},
    {"type": "object", "properties": {"nothing": {"type": "null"}}, "required": ["nothing"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "boolean"}}}}, "required": ["matrix"],
     "additionalProperties": False},
    {"type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]}, "note": STR},
     "required": ["day"], "additionalProperties": False},
    {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
     "required": ["hex"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": STR, "address": {
        "type": "object", "properties": {"city": STR}, "required": ["city"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 5}},
     "required": ["flag", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": {"type": ["string", "null"],
                                                                                "maxLength": 6}},
     "required": ["answer", "why"], "additionalProperties": False},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [STR, {"type": "boolean"}],
                                               "items": False, "minItems": 2}},
     "required": ["pair"], "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,6}$"}}, "required": ["word"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer(smollm2_archive_files(torch.bfloat16)[0].parent)


@pytest.fixture(scope="module")
def stops(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    return (tokenizer.eos_token_id, tokenizer.token_id("<|endoftext|>"))


@pytest.fixture(scope="module")
def compiler(tokenizer: ChatTokenizer, stops: tuple[int, ...]) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, stops)


@pytest.fixture(scope="module")
def runner() -> LlamaRunner:
    model = init_random(LlamaConfig.tiny(vocab_size=VOCAB), seed=0)
    return LlamaRunner(model, max_seq_len=256, batch_buckets=(1, 2, 4), prefill_buckets=(16, 32, 64),
                       kv_buckets=(128, 256))


Requests = dict[str, tuple[list[int], SamplingParams]]


def _run(runner: LlamaRunner, requests: Requests, max_num_seqs: int = 4) -> dict[str, tuple[list, str]]:
    b = ContinuousBatcher(runner, max_num_seqs, prefill_chunk=32, max_num_batched_tokens=64)
    out: dict[str, list] = {k: [] for k in requests}
    finish: dict[str, str] = {}
    for key, (prompt, params) in requests.items():
        b.add(key, prompt, params)
    for _ in range(5000):
        if not b.has_work:
            break
        for key, u in b.step().items():
            out[key] += u.tokens
            if u.finish_reason is not None:
                finish[key] = u.finish_reason
    assert not b.has_work
    return {k: (out[k], finish[k]) for k in requests}


def _run_arriving(b: ContinuousBatcher, requests: Requests, first: list[str],
                  arrivals: dict[int, str], step: Callable[[], dict]) -> dict[str, list[int]]:
    """``first`` added at once, then ``arrivals[n]`` before the n-th call of ``step`` (the batcher's
    or a counting wrapper of it), until the last has arrived and the batcher is done: each
    request's tokens."""
    out: dict[str, list[int]] = {k: [] for k in requests}
    for key in first:
        b.add(key, *requests[key])
    n = 0
    while b.has_work or n <= max(arrivals):
        if n in arrivals:
            b.add(arrivals[n], *requests[arrivals[n]])
        for key, u in step().items():
            out[key] += u.tokens
        n += 1
    return out


def _riders(compiler: GrammarCompiler, tokenizer: ChatTokenizer,
            stops: tuple[int, ...]) -> tuple[Requests, list[str], dict[int, str]]:
    """A grammar row and a sampled min_tokens row decode while free and constrained prompts arrive
    every other step: (requests, those added first, arrivals by step)."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Ride along."}])
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[3]))
    held = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[0]), min_tokens=8)
    rows = {"json": (prompt, SamplingParams(max_tokens=60, stop_token_ids=stops, constraint=c)),
            "sampled": (prompt[1:], SamplingParams(max_tokens=60, temperature=0.9, seed=3, stop_token_ids=stops,
                                                   constraint=held))}
    arrivals = {}
    for i, step in enumerate((3, 5, 7, 9, 11)):
        key = f"new{i}"
        params = (SamplingParams(max_tokens=6, stop_token_ids=stops, constraint=c) if i % 2 else
                  SamplingParams(max_tokens=5, temperature=0.7, seed=i, stop_token_ids=stops))
        rows[key] = (prompt[i + 2:], params)
        arrivals[step] = key
    return rows, ["json", "sampled"], arrivals


def _back_and_forth(compiler: GrammarCompiler, tokenizer: ChatTokenizer,
                    stops: tuple[int, ...]) -> tuple[Requests, list[str], dict[int, str]]:
    """A free row decodes throughout while short grammar rows and free prompts arrive every third
    step and end within a few, so steps move between split and pipelined ones."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Back and forth, a longer prompt here."}]) * 3
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[3]))
    rows = {"free": (prompt[:30], SamplingParams(max_tokens=60, stop_token_ids=()))}
    arrivals = {}
    for i in range(12):  # every other one constrained, 8 tokens (its start run among them)
        key = f"r{i}"
        params = (SamplingParams(max_tokens=8, stop_token_ids=stops, constraint=c) if i % 2 == 0 else
                  SamplingParams(max_tokens=2, temperature=0.8, seed=i, stop_token_ids=()))
        rows[key] = (prompt[:20 + i], params)
        arrivals[1 + 3 * i] = key
    return rows, ["free"], arrivals


def _forced(compiler: GrammarCompiler, tokenizer: ChatTokenizer,
            stops: tuple[int, ...]) -> tuple[Requests, list[str], dict[int, str]]:
    """Greedy and sampled rows under grammars that force runs of tokens (property names, a const),
    one cut by max_tokens inside a run, and a free prompt arriving at the third step."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "A user and their city."}])
    nested = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[17]))
    const = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[9]))
    rows = {"greedy": (prompt, SamplingParams(max_tokens=80, stop_token_ids=stops, constraint=nested)),
            "sampled": (prompt[1:], SamplingParams(max_tokens=80, temperature=1.0, seed=5, stop_token_ids=stops,
                                                   constraint=const)),
            "free": (prompt[2:], SamplingParams(max_tokens=6, temperature=0.8, seed=1, stop_token_ids=stops)),
            "cut": (prompt[3:], SamplingParams(max_tokens=4, stop_token_ids=stops, constraint=nested))}
    return rows, ["greedy", "sampled", "cut"], {2: "free"}


def _with_and_without_runs(runner: LlamaRunner, scenario: tuple[Requests, list[str], dict[int, str]],
                           budget: int = 64) -> tuple[dict[bool, dict], dict[bool, int], list[int]]:
    """``scenario`` on engines with forced runs on and off (4 rows, chunks of at most ``budget``
    tokens, as is the step's budget): each request's tokens and the steps taken by each engine, and
    the tokens of each packed forward of the one with runs (``Counted.tokens``)."""
    out, steps, tokens = {}, {}, []
    for jump in (True, False):
        b = ContinuousBatcher(runner, 4, prefill_chunk=min(32, budget), max_num_batched_tokens=budget,
                              jump_forced=jump)
        counted = Counted(b)
        out[jump] = _run_arriving(b, *scenario, counted.step)
        steps[jump] = counted.steps
        tokens = tokens or counted.tokens
    return out, steps, tokens


def _text(tokenizer: ChatTokenizer, tokens: list[int], finish: str) -> str:
    return tokenizer.decode(tokens[:-1] if finish == "stop" else tokens)


def test_every_output_parses_and_validates(runner, compiler, tokenizer, stops) -> None:
    assert len(SCHEMAS) >= 20
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Give me JSON."}])
    requests = {}
    for i, schema in enumerate(SCHEMAS):
        c = compiler.constraint(GrammarSpec.of(JSON, schema))
        for seed in (i,):  # a sampled draw per schema, and greedy
            requests[f"{i}-{seed}"] = (prompt, SamplingParams(max_tokens=160, temperature=1.0, seed=seed,
                                                              stop_token_ids=stops, constraint=c))
        requests[f"{i}-g"] = (prompt, SamplingParams(max_tokens=160, stop_token_ids=stops, constraint=c))
    results = _run(runner, requests)
    for key, (tokens, finish) in results.items():
        schema = SCHEMAS[int(key.split("-")[0])]
        text = _text(tokenizer, tokens, finish)
        assert finish == "stop", (key, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("kind,value,check", [
    (REGEX, r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    (CHOICE, ["alpha", "beta gamma", 'quote"d'], lambda t: t in ("alpha", "beta gamma", 'quote"d')),
    (GRAMMAR, 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?', lambda t: re.fullmatch(
        r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t) and len(t) < 200),
    (JSON_OBJECT, None, lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object(runner, compiler, tokenizer, stops, kind, value, check) -> None:
    c = compiler.constraint(GrammarSpec.of(kind, value))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Answer."}])
    requests = {str(seed): (prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=seed, stop_token_ids=stops,
                                                   constraint=c)) for seed in range(3)}
    for key, (tokens, finish) in _run(runner, requests).items():
        text = _text(tokenizer, tokens, finish)
        if kind == JSON_OBJECT and finish == "length":  # free-form JSON may run long: its prefix is still JSON-ish
            continue
        assert finish == "stop" and check(text), (key, text)


@pytest.mark.parametrize("max_num_seqs", [4, 2])
def test_a_mixed_batch_gives_each_row_its_solo_output(runner, compiler, tokenizer, stops, max_num_seqs) -> None:
    """Each row gets its solo tokens; with 2 slots, waiting requests take slots that finished rows
    free while the next split step's forward is already launched."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Mixed batch."}])
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[0]))
    bias = compiler.constraint(logit_bias=((tokenizer.encode("Hello")[0], 6.0),), min_tokens=4)
    rows = {
        "constrained": (prompt, SamplingParams(max_tokens=40, stop_token_ids=stops, constraint=c)),
        "free": (prompt[:-2], SamplingParams(max_tokens=12, stop_token_ids=stops)),
        "logprobs": (prompt[1:], SamplingParams(max_tokens=10, stop_token_ids=stops, logprobs=2)),
        "sampled": (prompt, SamplingParams(max_tokens=14, temperature=0.9, top_k=40, seed=7, stop_token_ids=stops,
                                           constraint=c)),
        "biased": (prompt[2:], SamplingParams(max_tokens=9, stop_token_ids=stops, constraint=bias)),
    }
    together = _run(runner, rows, max_num_seqs)
    for key, request in rows.items():
        assert _run(runner, {key: request})[key] == together[key], key


def test_a_request_taking_a_freed_slot_mid_batch_gets_its_solo_output(runner, compiler, tokenizer, stops) -> None:
    """Two slots: a constrained request ends early and a free one takes its slot while a second
    constrained one runs, its next forward already launched. The new row is loaded only after that
    step's sampling (which still covers the slot): it gets what it gets alone (a free row, so that
    its tokens are the model's, not ones its grammar forces)."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Slots."}])
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[0]))
    rows = {"short": (prompt, SamplingParams(max_tokens=3, stop_token_ids=stops, constraint=c)),
            "long": (prompt[1:], SamplingParams(max_tokens=30, stop_token_ids=stops, constraint=c)),
            "late": (prompt[2:], SamplingParams(max_tokens=12, stop_token_ids=stops))}
    together = _run(runner, rows, max_num_seqs=2)
    for key, request in rows.items():
        assert _run(runner, {key: request})[key] == together[key], key


def test_a_split_step_admits_the_requests_that_arrived_since_it_began(runner, compiler, tokenizer, stops) -> None:
    """While a grammar row runs, each step admits midway, after its sampling half is launched; the
    requests that arrive meanwhile (``intake``, which the engine thread points at its commands) are
    admitted in that step, not the next. Every request still gets what it gets alone."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Arrive midway."}])
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[3]))
    rows = {"json": (prompt, SamplingParams(max_tokens=40, stop_token_ids=stops, constraint=c)),
            "late": (prompt[1:], SamplingParams(max_tokens=8, stop_token_ids=stops)),
            "late_json": (prompt[2:], SamplingParams(max_tokens=12, stop_token_ids=stops, constraint=c))}
    arrive = {"late": 3, "late_json": 6}  # the step during which each arrives
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    step, taken, admitted = 0, {}, {}

    def intake(updates: dict) -> None:
        for key, at in arrive.items():
            if at <= step and key not in taken:
                b.add(key, *rows[key])
                taken[key] = step

    b.intake = intake
    out: dict[str, list[int]] = {k: [] for k in rows}
    b.add("json", *rows["json"])
    while b.has_work or len(taken) < len(arrive):
        step += 1
        for key, u in b.step().items():
            out[key] += u.tokens
        seated = {s.key for s in b.slots if s is not None}
        for key in taken:
            if key not in admitted and (key in seated or out[key]):
                admitted[key] = step
        assert step < 500
    assert taken == arrive  # each came in through a split step's intake
    assert admitted == taken  # and was admitted in that same step
    for key, request in rows.items():
        assert _run(runner, {key: request})[key][0] == out[key], key


def test_the_engine_threads_intake_takes_new_requests_up_to_any_other_command(runner, compiler, tokenizer,
                                                                           stops) -> None:
    """``EngineThread._intake`` adds the new requests at the head of the commands and leaves the rest
    in order: a cancellation still follows the request it cancels, and what comes after it waits
    for the loop; every request then ends as it would have."""
    from servekit.optimizations.llm.continuous import EngineThread

    prompt = tokenizer.encode_chat([{"role": "user", "content": "In order."}])
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    engine = EngineThread(b)
    assert b.intake == engine._intake
    params = SamplingParams(max_tokens=5, stop_token_ids=stops)
    # Queued without waking the idle engine thread, as if they arrived during a step.
    engine._commands.extend([("add", "a", prompt, params, True), ("add", "b", prompt[1:], params, True),
                             ("cancel", "a"), ("add", "c", prompt[2:], params, True)])
    updates: dict = {}
    engine._intake(updates)
    assert set(b.by_key) == {"a", "b"} and not updates
    assert [cmd[:2] for cmd in engine._commands] == [("cancel", "a"), ("add", "c")]
    engine._wake.set()
    got: dict[str, list[int]] = {"b": [], "c": []}
    finished: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while len(finished) < 2 and time.monotonic() < deadline:
        for key, u in engine.take(["a", "b", "c"], 1.0).items():
            assert key != "a" or not u.tokens  # cancelled before any step ran it
            if key != "a":
                got[key] += u.tokens
                if u.finish_reason is not None:
                    finished[key] = u.finish_reason
    assert set(finished) == {"b", "c"}
    assert got == {k: _run(runner, {k: (p, params)})[k][0] for k, p in (("b", prompt[1:]), ("c", prompt[2:]))}


def test_constrained_rows_ride_in_the_packed_forwards_of_prompts_arriving_beside_them(runner, compiler, tokenizer,
                                                                                     stops) -> None:
    """Grammar and min_tokens rows decode while new prompts (free and constrained) keep arriving:
    their decode steps ride in the prompts' packed forwards, whose sampling half waits for their
    masks as a split step's does and samples the new rows' first tokens too; no decode forward
    is launched for the riders' token (a step may launch the next one after that sampling half).
    Every request gets what it gets alone."""
    rows, first, arrivals = _riders(compiler, tokenizer, stops)
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    counted = Counted(b)
    events: list[tuple[int, str]] = []
    for name in ("_sample", "_launch"):
        def logged(*args, real=getattr(b, name), name=name, **kwargs):
            out = real(*args, **kwargs)
            if out is not None:
                events.append((counted.steps, name))
            return out
        setattr(b, name, logged)
    packed = b.packed.run
    b.packed.run = lambda chunks: (events.append((counted.steps, "packed")), packed(chunks))[1]
    firsts = []
    first_tokens = b._first_tokens
    b._first_tokens = lambda *args: (firsts.append(counted.steps), first_tokens(*args))[1]
    together = _run_arriving(b, rows, first, arrivals, counted.step)
    ridden = {step for step, prompt_tokens, _, riders in counted.calls if riders and prompt_tokens}
    assert len(ridden) >= len(arrivals) - 1, counted.calls
    for step in ridden:  # after the packed forward, its sampling half before any decode forward
        names = [name for n, name in events if n == step]
        after = names[names.index("packed") + 1:]
        assert "_launch" not in after or after.index("_sample") < after.index("_launch"), (step, names)
    assert not set(firsts) & ridden  # the prompts' first tokens were not sampled on their own
    for key, request in rows.items():
        assert _run(runner, {key: request})[key][0] == together[key], key


def test_steps_moving_between_split_and_pipelined_never_overrun_the_host_copies(runner, compiler, tokenizer, stops,
                                                                              monkeypatch) -> None:
    """A free row decodes throughout while short grammar rows and free prompts keep arriving and
    ending, so steps move between split and pipelined ones with prompts riding in either. No step
    has more host copies outstanding than ContinuousBatcher._host says (four), no ring more than it
    holds, and every request gets what it gets alone."""
    from servekit.optimizations.llm import generate
    from servekit.optimizations.llm.continuous import HOST_COPIES

    unread: dict[int, int] = {}
    most = {"all": 0, "one": 0}
    start_next, wait = generate.HostCopies.start_next, generate.HostCopies.wait

    def started(self, t):
        unread[id(self)] = unread.get(id(self), 0) + 1
        most["all"] = max(most["all"], sum(unread.values()))
        most["one"] = max(most["one"], unread[id(self)])
        return start_next(self, t)

    def read(self, slot):
        unread[id(self)] -= 1
        return wait(self, slot)

    monkeypatch.setattr(generate.HostCopies, "start_next", started)
    monkeypatch.setattr(generate.HostCopies, "wait", read)
    rows, first, arrivals = _back_and_forth(compiler, tokenizer, stops)
    # Forced runs off: they shorten the grammar rows' answers by steps, and with them the overlap
    # of split and pipelined steps.
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64, jump_forced=False)
    together = _run_arriving(b, rows, first, arrivals, b.step)
    assert not any(unread.values())
    assert 2 <= most["all"] <= 4 and most["one"] < HOST_COPIES, most
    for key, request in rows.items():
        assert _run(runner, {key: request})[key][0] == together[key], key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scenario", [_riders, _back_and_forth, _forced])
def test_captured_steps_with_riders_and_split_sampling_equal_eager_on_cuda(compiler, tokenizer, stops,
                                                                         scenario) -> None:
    """The scenarios above on a GPU with CUDA graphs: the packed forward with constrained rows
    riding (forced runs among them), its captured sampling half after the masks' upload and the
    host-copy ring give every request what eager steps give it, and rows did ride."""
    rows, first, arrivals = scenario(compiler, tokenizer, stops)

    def run(cuda_graphs: bool) -> tuple[dict[str, list[int]], int]:
        model = init_random(LlamaConfig.tiny(vocab_size=VOCAB), seed=0).cuda()
        r = LlamaRunner(model, max_seq_len=256, batch_buckets=(1, 2, 4), prefill_buckets=(16, 32, 64),
                        kv_buckets=(128, 256), cuda_graphs=cuda_graphs)
        r.warmup()
        b = ContinuousBatcher(r, 4, prefill_chunk=32, max_num_batched_tokens=64)
        b.warmup()  # captures the packed forwards: without it they cannot run on graphs
        counted = Counted(b)
        out = _run_arriving(b, rows, first, arrivals, counted.step)
        return out, sum(1 for _, prompt_tokens, _, riders in counted.calls if riders and prompt_tokens)

    (graphed, ridden), (eager, _) = run(True), run(False)
    assert ridden >= len(arrivals) - 1
    assert graphed == eager


@pytest.mark.parametrize("scenario", [_riders, _back_and_forth, _forced])
def test_masks_fill_on_the_engine_thread_after_the_matchers_took_their_tokens(
        runner, compiler, tokenizer, stops, scenario, monkeypatch) -> None:
    """Each split step's grammar masks are filled on the engine's own thread, right before its
    sampling half, once every step launched before it has been read (while its forward runs) and its
    grammar rows took those tokens; every request gets what it gets alone."""
    from servekit.optimizations.llm import grammar

    fill = grammar.MaskUpload.__call__
    fills, seen = [], []
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)

    def checked_fill(self, matchers, dest, caps=()):
        fills.append(threading.current_thread())
        # Every step launched before this one has been read: its tokens are in the matchers.
        seen.append(not b._inflight and b._forward is not None and dest is b._forward.sample.state.packed)
        fill(self, matchers, dest, caps)

    monkeypatch.setattr(grammar.MaskUpload, "__call__", checked_fill)
    rows, first, arrivals = scenario(compiler, tokenizer, stops)
    together = _run_arriving(b, rows, first, arrivals, b.step)
    assert len(fills) >= 10 and set(fills) == {threading.current_thread()} and all(seen), (fills, seen)
    monkeypatch.undo()
    for key, request in rows.items():
        assert _run(runner, {key: request})[key][0] == together[key], key


@pytest.mark.parametrize("constraint", ["grammar", "logit_bias"])
def test_a_speculating_batch_takes_plain_steps_while_a_constrained_row_runs(runner, compiler, tokenizer, stops,
                                                                           constraint: str) -> None:
    """Drafts are not checked against a grammar, and the verify step applies no bias: while a row under
    a grammar (its steps split) or with a logit_bias (its steps whole) runs beside speculating rows,
    every step is a plain one (no drafts proposed), and the batch speculates again once that row has
    ended. Every row gets what it gets alone (the bias applied)."""
    from servekit.optimizations.llm.speculative import SpeculativeDecoding, Speculator, SpeculatorConfig

    model = init_random(LlamaConfig.tiny(vocab_size=VOCAB), seed=0)  # the module runner's weights
    spec_runner = LlamaRunner(model, max_seq_len=256, batch_buckets=(1, 2, 4), prefill_buckets=(16, 32, 64),
                              kv_buckets=(128, 256))
    heads = Speculator(SpeculatorConfig.for_model(model, n_heads=2)).reset_parameters(seed=1, random_out=True)
    spec_runner.speculation = SpeculativeDecoding(spec_runner, heads, max_spec_batch=4)
    spec_runner.speculation.warmup()
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Speculate."}])
    c = (compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[0])) if constraint == "grammar" else
         compiler.constraint(logit_bias=((tokenizer.token_id("{"), 5.0), (tokenizer.token_id("a"), 5.0))))
    rows = {"free": (prompt, SamplingParams(max_tokens=40, stop_token_ids=())),
            "constrained": (prompt[1:], SamplingParams(max_tokens=30, stop_token_ids=stops, constraint=c))}
    b = ContinuousBatcher(spec_runner, 4)
    for key, request in rows.items():
        b.add(key, *request)
    out: dict[str, list[int]] = {k: [] for k in rows}
    proposed = {"constrained running": 0, "after": 0}
    while b.has_work:
        running = "constrained" in b.by_key
        before = b.spec_stats.proposed[0]
        for key, u in b.step().items():
            out[key] += u.tokens
        proposed["constrained running" if running else "after"] += b.spec_stats.proposed[0] - before
    assert proposed["constrained running"] == 0 and proposed["after"] > 0, proposed
    assert len(out["free"]) == 40
    if constraint == "grammar":
        jsonschema.validate(json.loads(tokenizer.decode(out["constrained"][:-1])), SCHEMAS[0])
    for key, request in rows.items():
        assert _run(runner, {key: request})[key][0] == out[key], key


def test_tokens_a_grammar_forces_go_in_one_forward_and_change_no_output(runner, compiler, tokenizer, stops) -> None:
    """Where a grammar allows one token after another (``{"user": {"name": "`` once ``{`` is out),
    the row feeds that run in one forward instead of a step a token: greedy and sampled rows,
    beside a free one, get exactly the tokens they get a token a step, in fewer steps; a run is
    cut at ``max_tokens``."""
    out, steps, _ = _with_and_without_runs(runner, _forced(compiler, tokenizer, stops))
    assert out[True] == out[False]
    for key in ("greedy", "sampled"):
        jsonschema.validate(json.loads(tokenizer.decode(out[True][key][:-1])), SCHEMAS[17 if key == "greedy" else 9])
    assert len(out[True]["cut"]) == 4
    # {"user": {"name": " and "address": {"city": " are forced: several tokens each
    assert steps[True] <= steps[False] - 6, steps


def test_a_sampled_token_and_the_run_its_grammar_forces_after_it_go_in_one_forward(runner, compiler, tokenizer,
                                                                                   stops) -> None:
    """A choice of two long strings: once its first tokens pick one, the grammar forces the rest.
    The forward after the sampled token from which the rest is forced feeds that token and the
    rest together (the token is read before the forward is launched): the answer's last forward
    feeds a token the grammar did not force, followed by every token it forced after it."""
    c = compiler.constraint(GrammarSpec.of(CHOICE, ["the quick brown fox jumps over the lazy dog",
                                                    "a slow green turtle naps under the warm sun"]))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Pick one."}])
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    fed: list[list[int]] = []
    run = b.packed.run

    def recording(chunks: list) -> torch.Tensor:
        fed.extend(list(ch.tokens) for ch in chunks if not ch.from_state)
        return run(chunks)

    b.packed.run = recording
    b.add("a", prompt, SamplingParams(max_tokens=40, stop_token_ids=stops, constraint=c))
    out = []
    while b.has_work:
        out += b.step().get("a", SeqUpdate()).tokens
    assert out[-1] in stops and tokenizer.decode(out[:-1]) in c.spec.text
    assert len(fed) == 2 and fed[0] == prompt, fed
    head = len(out) - 1 - len(fed[1])  # where the last forward's tokens start in the answer
    assert fed[1] == out[head:-1] and len(fed[1]) >= 4, (fed, out)
    m = c.grammar.deep_copy()
    assert m.consume_tokens(out[:head]) and m.compute_ff_tokens()[:1] != out[head:head + 1]  # sampled, not forced


def test_a_grammars_start_run_goes_in_with_the_prompt(runner, compiler, tokenizer, stops) -> None:
    """``{"user": {"name":`` is forced before a nested schema's first choice: the prompt's
    prefill feeds it after the prompt, the first update brings it with the first token sampled
    after it, and the answers (greedy, sampled, one cut by max_tokens inside the run) are the ones
    a token a step gives. The prefix cache keeps the run's K/V with the prompt's: the same request
    again prefills only what the cache lacks of them and reports only the prompt's share as cached."""
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[17]))
    run = c.grammar.deep_copy().compute_ff_tokens()
    assert tokenizer.decode(run) == '{"user": {"name":', run  # the space and quote may merge with what follows
    prompt = tokenizer.encode_chat([{"role": "user", "content": "A user."}])
    requests = {"greedy": (prompt, SamplingParams(max_tokens=40, stop_token_ids=stops, constraint=c)),
                "sampled": (prompt[1:], SamplingParams(max_tokens=40, temperature=0.9, seed=2, stop_token_ids=stops,
                                                       constraint=c)),
                "cut": (prompt[2:], SamplingParams(max_tokens=3, stop_token_ids=stops, constraint=c))}
    out, steps, _ = _with_and_without_runs(runner, (requests, ["greedy", "sampled"], {1: "cut"}))
    assert out[True] == out[False]
    assert steps[True] < steps[False], steps
    assert out[True]["cut"][:2] == run[:2] and len(out[True]["cut"]) == 3  # two fed with the prompt, one sampled
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    fed: list[list[int]] = []
    packed = b.packed.run
    b.packed.run = lambda chunks: (fed.extend(list(ch.tokens) for ch in chunks if not ch.from_state),
                                   packed(chunks))[1]
    firsts, answers = [], []
    for _ in range(2):  # the second time the prefix cache holds the first's prompt and run
        fed.clear()
        b.add("a", *requests["greedy"])
        updates = []
        while b.has_work:
            if (u := b.step().get("a")) is not None:
                updates.append(u)
        firsts.append(updates[0])
        answers.append([t for u in updates for t in u.tokens])
    whole = prompt + run
    assert 0 < len(fed[0]) < len(whole) and fed[0] == whole[len(whole) - len(fed[0]):]  # the cached head not fed again
    assert firsts[0].tokens[:len(run)] == run and len(firsts[0].tokens) == len(run) + 1, firsts[0]
    assert firsts[0].cached_tokens == 0 and 0 < firsts[1].cached_tokens <= len(prompt)
    assert answers[0] == answers[1] == out[True]["greedy"]


def _walk_forced_runs(compiler: GrammarCompiler, spec: GrammarSpec, seed: int, steps: int = 80) -> int:
    """A row of ``spec`` walked from its start, at each state taking the run its grammar forces and
    then a random token its mask allows (``seed``), every run checked against llguidance's own for
    that state. Returns the runs of two or more tokens seen."""
    from servekit.benchmarks.grammar_refusals import allowed_tokens

    rng, row, longer = random.Random(seed), compiler.constraint(spec).start(), 0
    for _ in range(steps):
        expected = row.matcher.deep_copy().compute_ff_tokens()
        run = row.forced()
        assert run == expected, (spec.text[:80], row.last, run, expected)
        longer += len(run) > 1
        if not all(row.accept(t) for t in run) or row.matcher.is_stopped():
            break
        allowed = torch.nonzero(allowed_tokens(row.matcher, VOCAB)).flatten().tolist()
        if not row.accept(allowed[rng.randrange(len(allowed))]) or row.matcher.is_stopped():
            break
    return longer


def test_a_grammars_forced_runs_come_from_its_cache_and_are_llguidances_own(compiler) -> None:
    """Random walks through every schema here and in the structured benchmark: at each state the run
    a row gets through its grammar's ``ForcedRuns`` is the run llguidance computes for that state,
    also where it comes from the cache (runs the same walk filled, or another walk's). Walking a
    schema again the same way computes no run: each comes from the cache."""
    from servekit.benchmarks.structured_bench import SCHEMAS as BENCH

    specs = [GrammarSpec.of(JSON, s) for s in SCHEMAS + [schema for _, _, schema in BENCH]]
    longer = 0
    for i, spec in enumerate(specs):
        runs = compiler.constraint(spec).runs
        assert runs is not None
        longer += _walk_forced_runs(compiler, spec, seed=i)
        misses, hits = runs.misses, runs.hits
        _walk_forced_runs(compiler, spec, seed=i)
        assert runs.misses == misses and (runs.hits > hits or misses == 0), (spec.text[:80], runs.hits, misses)
        _walk_forced_runs(compiler, spec, seed=1000 + i)
    assert longer >= len(specs), longer  # runs of several tokens were checked, not only empty ones
    assert compiler.constraint(specs[0]).portable().runs is None  # it never leaves its process


def test_rows_with_cached_forced_runs_decode_what_rows_computing_them_do(runner, compiler, tokenizer, stops) -> None:
    """The same greedy and sampled requests under a nested schema three times: twice through the
    grammar's ``ForcedRuns`` (the second time every run comes from it), once with each run
    computed by llguidance: the same tokens each time."""
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[17]))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "A user and their city, again."}])

    def requests(constraint) -> Requests:
        return {"greedy": (prompt, SamplingParams(max_tokens=60, stop_token_ids=stops, constraint=constraint)),
                "sampled": (prompt[1:], SamplingParams(max_tokens=60, temperature=1.0, seed=7, stop_token_ids=stops,
                                                       constraint=constraint))}

    first = _run(runner, requests(c))
    misses, hits = c.runs.misses, c.runs.hits
    second = _run(runner, requests(c))
    assert c.runs.misses == misses and c.runs.hits > hits
    assert first == second == _run(runner, requests(replace(c, runs=None)))
    for tokens, finish in first.values():
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMAS[17])


def test_forced_runs_longer_than_the_token_budget_are_cut_to_fit_it(runner, compiler, tokenizer, stops) -> None:
    """A const string forces runs longer than a step's token budget (16 here) for three rows at
    once: each packed forward keeps the budget, the runs are cut to what fits, and every row gets
    the output it gets a token a step, in fewer steps."""
    schema = {"type": "object", "properties": {"motto": {
        "const": "the quick brown fox jumps over the lazy dog and keeps on running far away"}},
        "required": ["motto"], "additionalProperties": False}
    c = compiler.constraint(GrammarSpec.of(JSON, schema))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Motto."}])
    requests = {str(i): (prompt[i:], SamplingParams(max_tokens=60, stop_token_ids=stops, constraint=c))
                for i in range(3)}
    out, steps, tokens = _with_and_without_runs(runner, (requests, ["0", "1"], {1: "2"}), budget=16)
    assert max(tokens) <= 16, tokens
    assert out[True] == out[False]
    assert all(json.loads(tokenizer.decode(t[:-1])) == {"motto": schema["properties"]["motto"]["const"]}
               for t in out[True].values())
    assert steps[True] < steps[False] // 2, steps


def test_constrained_rows_left_in_high_rows_move_down_and_keep_their_output(runner, compiler, tokenizer,
                                                                            stops) -> None:
    """Four rows (bucket 4): the three short ones end, and the long constrained rows still running
    move down into the freed rows while grammar rows keep the batch in split steps (their masks
    filled at the new rows from the next step on, their min_tokens bias rows and penalty counts
    moved with them). Each request gets what it gets alone."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Rows."}])
    c = compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[11]), min_tokens=6)
    rows = {"a": (prompt, SamplingParams(max_tokens=2, stop_token_ids=stops)),
            "b": (prompt[1:], SamplingParams(max_tokens=3, stop_token_ids=stops, constraint=c)),
            "c": (prompt[2:], SamplingParams(max_tokens=4, stop_token_ids=stops)),
            "d": (prompt[3:], SamplingParams(max_tokens=40, temperature=0.9, seed=5, frequency_penalty=0.5,
                                             stop_token_ids=stops, constraint=c))}
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    together: dict[str, list[int]] = {k: [] for k in rows}
    for key, (p, params) in rows.items():
        b.add(key, p, params)
    slots = []
    while b.has_work:
        for key, u in b.step().items():
            together[key] += u.tokens
        if "d" in b.by_key:
            slots.append(b.by_key["d"].slot)
    assert slots[0] == 3 and slots[-1] == 0 and b.moves >= 1
    for key, request in rows.items():
        assert _run(runner, {key: request})[key][0] == together[key], key


def test_logit_bias_and_min_tokens(runner, compiler, tokenizer, stops) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    word = tokenizer.encode(" banana")[0]
    forced = compiler.constraint(logit_bias=((word, 100.0),))
    tokens, _ = _run(runner, {"a": (prompt, SamplingParams(max_tokens=6, stop_token_ids=stops, constraint=forced))})["a"]
    assert tokens == [word] * 6
    # The stop token pushed to the top: without min_tokens the row ends at once, with it after 5 tokens.
    eager_stop = compiler.constraint(logit_bias=((stops[0], 100.0),))
    held = compiler.constraint(logit_bias=((stops[0], 100.0),), min_tokens=5)
    out = _run(runner, {"now": (prompt, SamplingParams(max_tokens=20, stop_token_ids=stops, constraint=eager_stop)),
                        "held": (prompt, SamplingParams(max_tokens=20, stop_token_ids=stops, constraint=held))})
    assert out["now"] == ([stops[0]], "stop")
    assert len(out["held"][0]) == 6 and out["held"][0][-1] == stops[0] and stops[0] not in out["held"][0][:-1]


def test_a_complete_grammar_ends_before_min_tokens(runner, compiler, tokenizer, stops) -> None:
    """The split steps apply the grammar's packed masks inside the sampling step, after the bias
    rows that hold the stop tokens back: once the grammar allows only a stop, the grammar wins."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Yes or no?"}])
    eos = (tokenizer.eos_token_id,)  # one stop, not id 0: a row left with no finite logit would sample id 0
    c = GrammarCompiler(tokenizer, VOCAB, eos).constraint(GrammarSpec.of(CHOICE, ["yes", "no"]), min_tokens=20)
    tokens, finish = _run(runner, {"a": (prompt, SamplingParams(max_tokens=30, stop_token_ids=eos, constraint=c))})["a"]
    assert finish == "stop" and len(tokens) < 20 and tokens[-1] == eos[0]
    assert tokenizer.tokenizer.decode(tokens[:-1], skip_special_tokens=False) in ("yes", "no")


def test_masked_bias_applies_packed_masks_and_lets_a_grammar_win() -> None:
    from servekit.optimizations.llm.sampling import masked_bias

    vocab = 40  # two words, the second partly past the vocabulary
    packed = torch.tensor([[-1, -1], [0b101, 0], [0, 1 << 3]], dtype=torch.int32)
    bias = torch.zeros(3, vocab)
    bias[1, 2], bias[2, 35] = 4.0, float("-inf")  # row 2: its only allowed token (35) held back
    got = masked_bias(bias, packed, torch.randn(3, vocab))
    assert torch.equal(got[0], bias[0])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [0, 2] and got[1, 2] == 4.0
    assert torch.isfinite(got[2]).nonzero().flatten().tolist() == [35] and got[2, 35] == 0.0


def test_masks_filled_on_threads_equal_one_by_one(compiler, tokenizer) -> None:
    """fill_masks on llguidance's threads (the engine's path on a GPU host) and packed_masks (rows
    without a grammar all ones) give the masks of the rows filled one after another."""
    import llguidance

    from servekit.optimizations.llm.grammar import MaskUpload, fill_masks, packed_masks

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": STR},
              "required": ["n", "s"], "additionalProperties": False}
    rows = [compiler.constraint(GrammarSpec.of(JSON, schema)).start() for _ in range(3)]
    for row, text in zip(rows, ('{"n": 4', '{"n": 42, "s": "a', "")):
        for t in tokenizer.encode(text) if text else []:
            assert row.accept(t)
    matchers = [(rows[0].matcher, 0), (rows[1].matcher, 2), (rows[2].matcher, 3)]
    words = (VOCAB + 31) // 32
    one_by_one, threads = torch.zeros(5, words, dtype=torch.int32), torch.zeros(5, words, dtype=torch.int32)
    fill_masks(matchers, one_by_one, None)
    fill_masks(matchers, threads, llguidance.LLExecutor(2))
    assert torch.equal(one_by_one, threads) and len({tuple(one_by_one[i].tolist()) for i in (0, 2, 3)}) == 3
    packed = packed_masks(matchers, 5, words, torch.device("cpu"))
    assert torch.equal(packed[[0, 2, 3]], one_by_one[[0, 2, 3]]) and (packed[[1, 4]] == -1).all()
    # The engine's path: its kept host block, refilled each step, into the sampling step's buffer.
    upload, dest = MaskUpload(), torch.zeros(5, words, dtype=torch.int32)
    upload(matchers[:1], dest)
    assert torch.equal(dest[0], one_by_one[0]) and (dest[1:] == -1).all()
    upload(matchers, dest)
    assert torch.equal(dest, packed)


def test_masks_fill_without_calling_into_python_and_equal_the_byte_tables(compiler, tokenizer, stops) -> None:
    """SmolLM2's tokenizer.json read by llguidance itself agrees with servekit's byte table, so the
    compiler uses it: filling masks then never calls the Python encoder (which needs the GIL from
    llguidance's threads), and along every schema's answer the masks equal the byte table's."""
    import llguidance
    import numpy as np

    from servekit.optimizations.llm import grammar
    from servekit.optimizations.llm.grammar import fill_masks

    assert compiler.python_tokenize is None
    vocab = grammar._Vocab(tokenizer, VOCAB)
    calls = []
    encode = vocab._encode
    vocab._encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
    table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=VOCAB, eos_token=list(stops))
    words = (VOCAB + 31) // 32
    ex = llguidance.LLExecutor(2)
    for schema in SCHEMAS:
        native = compiler.constraint(GrammarSpec.of(JSON, schema)).start().matcher
        by_table = llguidance.LLMatcher(table, GrammarSpec.of(JSON, schema).grammar(), log_level=0)
        for step in range(40):  # along a path the masks allow, a different allowed token each step
            a, b = torch.zeros(2, words, dtype=torch.int32), torch.zeros(2, words, dtype=torch.int32)
            before = len(calls)
            fill_masks([(native, 0), (native.deep_copy(), 1)], a, ex)
            assert len(calls) == before, "the native tokenizer called the Python encoder"
            fill_masks([(by_table, 0), (by_table.deep_copy(), 1)], b, ex)
            assert torch.equal(a, b), (schema, step)
            bits = np.unpackbits(a[0].numpy().view(np.uint8), bitorder="little")[:VOCAB]
            allowed = np.flatnonzero(bits).tolist()
            t = allowed[(step * 7919) % len(allowed)]
            assert native.consume_token(t) and by_table.consume_token(t)
            if native.is_stopped():
                break
    assert calls, "the byte table's tokenizer was never asked to tokenize: the check above proves nothing"


def test_a_tokenizer_that_reads_a_token_otherwise_keeps_the_byte_table(tokenizer, stops) -> None:
    """Where llguidance's own reading differs from the byte table (here: one token's bytes changed
    in the table), the difference is named and the byte table is the one to use. The native reading
    is of the tokenizer as a plain byte-level BPE, as ``llg_tokenizer`` reads it whichever way this
    transformers converted SmolLM2's GGUF (below)."""
    import llguidance

    from servekit.optimizations.llm import grammar

    raw = tokenizer.tokenizer.to_str()
    native = llguidance.LLTokenizer(grammar.byte_level_json(raw) or raw, n_vocab=VOCAB, eos_token=list(stops))
    vocab = grammar._Vocab(tokenizer, VOCAB)
    assert grammar.tokenizer_mismatch(native, llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(vocab), n_vocab=VOCAB, eos_token=list(stops))) is None
    vocab.tokens[300] = b"<changed>"
    changed = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=VOCAB, eos_token=list(stops))
    assert grammar.tokenizer_mismatch(native, changed) == f"token 300 reads {native.decode_bytes([300])!r}, not b'<changed>'"
    other_stops = llguidance.LLTokenizer(llguidance.TokenizerWrapper(grammar._Vocab(tokenizer, VOCAB)), n_vocab=VOCAB,
                                         eos_token=[stops[0]])
    assert "stop tokens" in grammar.tokenizer_mismatch(native, other_stops)


def test_a_byte_level_bpe_converted_with_byte_fallback_is_read_as_byte_level(tokenizer, stops) -> None:
    """transformers 5.17 converts SmolLM2's GGUF with byte fallback and a SentencePiece-style decoder
    chain around ByteLevel; llguidance reads that tokenizer.json as SentencePiece (token 111: the
    UTF-8 of "¡", not the byte 0xA1). Rewritten as a plain byte-level BPE it agrees with the byte
    table, so that tokenizer is read natively too. (transformers 5.24 converts it plain: the test
    builds 5.17's form from the plain one, whichever this transformers gave.)"""
    import copy

    import llguidance
    from tokenizers import Tokenizer

    from servekit.optimizations.llm.grammar import byte_level_json, llg_tokenizer

    raw = tokenizer.tokenizer.to_str()
    plain = byte_level_json(raw) or raw
    assert byte_level_json(plain) is None  # plain already: nothing left to rewrite
    d = json.loads(plain)
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        d["decoder"]]}
    d["model"]["byte_fallback"] = True
    converted = copy.copy(tokenizer)
    converted.tokenizer = Tokenizer.from_str(json.dumps(d))
    as_is = llguidance.LLTokenizer(converted.tokenizer.to_str(), n_vocab=VOCAB, eos_token=list(stops))
    assert as_is.decode_bytes([111]) == "¡".encode() != tokenizer.token_bytes(111) == b"\xa1"
    native, reason = llg_tokenizer(converted, VOCAB, stops)
    assert reason is None and native.decode_bytes([111]) == b"\xa1"


def test_a_tokenizer_with_too_many_added_tokens_keeps_the_byte_table(tokenizer, stops, monkeypatch) -> None:
    """llguidance's reading of a tokenizer.json takes time growing with the square of its added
    tokens (minutes for the 102,000 of a Qwen-shaped benchmark model): past the limit the byte table
    is used without that reading, and says why."""
    from servekit.optimizations.llm import grammar

    added = len(tokenizer.tokenizer.get_added_tokens_decoder())
    assert grammar.llg_tokenizer(tokenizer, VOCAB, stops)[1] is None
    monkeypatch.setattr(grammar, "MAX_NATIVE_ADDED_TOKENS", added - 1)
    table, reason = grammar.llg_tokenizer(tokenizer, VOCAB, stops)
    assert reason == (f"the tokenizer has {added} added tokens; llguidance's reading of it takes time that grows "
                      f"with their square, so more than {added - 1} are not read")
    assert table.decode_bytes([300]) == tokenizer.token_bytes(300)


def _allowed(words: torch.Tensor) -> torch.Tensor:
    """A packed bitmask row (int32 words) as one bool per token, bit by bit in Python."""
    return torch.tensor([bool((int(words[t // 32]) >> (t % 32)) & 1) for t in range(VOCAB)])


def test_bias_rows_are_the_matchers_own_masks(compiler, tokenizer, stops) -> None:
    """Packed bitmasks unpacked on the device allow exactly the tokens llguidance's own CPU masking
    keeps (cut to a bounded string's characters left), row by row, at several states of several
    grammars, beside rows without a grammar, with logit_bias, and with stop tokens held back by
    min_tokens."""

    from servekit.optimizations.llm.grammar import bias_rows

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": STR},
              "required": ["n", "s"], "additionalProperties": False}
    json_rows = [compiler.constraint(GrammarSpec.of(JSON, schema)).start() for _ in range(3)]
    text = '{"n": 42, "s": "ab'
    for row, upto in zip(json_rows, (0, 5, len(text))):  # three states of one grammar
        for t in tokenizer.encode(text[:upto]) if upto else []:
            assert row.accept(t)
    choice = compiler.constraint(GrammarSpec.of(CHOICE, ["yes", "no"]), logit_bias=((7, 5.0),)).start()
    biased = compiler.constraint(logit_bias=((11, -3.0), (12, 2.5))).start()
    held = compiler.constraint(min_tokens=2).start()
    rows = [json_rows[0], None, json_rows[1], choice, biased, json_rows[2], held]
    got = bias_rows(rows, VOCAB, torch.device("cpu"))
    assert got.shape == (len(rows), VOCAB)
    for r, row in zip(got, rows):
        want = torch.zeros(VOCAB)
        if row is not None and row.static is not None:
            want += row.static
        if row is not None and row.matcher is not None:
            words = torch.frombuffer(bytearray(row.matcher.compute_bitmask()), dtype=torch.int32)
            if row.cap() is not None:  # inside "s": its maxLength cuts the mask (string_bounds)
                words[:row.cap().size] &= torch.from_numpy(row.cap())
            want = want.masked_fill(~_allowed(words), float("-inf"))
        if row is held:
            want[list(stops)] = float("-inf")
        assert torch.equal(r, want)
    assert json_rows[2].cap() is not None and json_rows[0].cap() is None
    assert torch.isfinite(got[1]).all() and got[4, 11] == -3.0 and got[4, 12] == 2.5
    assert 0 < int(torch.isfinite(got[3]).sum()) < 10  # "yes" / "no" starts only


@pytest.mark.parametrize("kind,value,message", [
    (JSON, {"type": "objekt"}, "invalid JSON schema at type"),
    (JSON, "{not json", "not valid JSON"),
    (JSON, {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                       "uniqueItems": True}}}, "uniqueItems at properties/tags"),
    # valid JSON and a valid schema, but llguidance takes no integer beyond 64 bits, even in a keyword it ignores
    (JSON, {"x-note": {"type": 10 ** 30}}, "json cannot be used: .*not JSON serializable"),
    (JSON, {"type": "integer", "maximum": -10 ** 25}, "json cannot be used"),
    (REGEX, "[a-", "regex cannot be used"),
    # the error quotes the request's regex, not its ASCII rewrite
    (REGEX, r"\d{2}(", r'regex cannot be used: .*invalid regex "\\\\d\{2\}\(".*unclosed group'),
    (GRAMMAR, 'root ::= "(" num', "grammar cannot be used: .*Rule 'num' not found"),
    (CHOICE, [], "non-empty list"),
    # compiles, but nothing satisfies it: llguidance's first mask allows only the end
    (JSON, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "json admits no output"),
    (REGEX, "[^\\x00-\\U0010FFFF]", "regex admits no output"),
    # compiles in milliseconds, but its first mask takes ~0.3 s of CPU (development VM)
    (REGEX, "a{300000}", "regex makes decoding too slow: one token's mask took [0-9]+ ms \\(the limit is 50 ms\\)"),
])
def test_bad_specs_are_named(compiler, kind, value, message) -> None:
    cached = len(compiler)
    with pytest.raises(GrammarError, match=message):
        compiler.compile(GrammarSpec.of(kind, value))
    assert len(compiler) == cached  # nothing cached


def test_the_probe_holds_a_grammars_first_mask_to_the_limit(tokenizer, stops) -> None:
    spec = GrammarSpec.of(REGEX, "[a-z]+")
    assert GrammarCompiler(tokenizer, VOCAB, stops).compile(spec) is not None
    with pytest.raises(GrammarError, match="makes decoding too slow"):
        GrammarCompiler(tokenizer, VOCAB, stops, mask_limit_s=0.0).compile(spec)


def test_a_grammar_that_turns_slow_or_breaks_mid_answer_ends_its_request_alone(runner, compiler, tokenizer,
                                                                               stops) -> None:
    """A grammar whose start is cheap can reach states whose masks cost far more (``a{30000}`` after
    three letters: ~8 ms a mask on the development VM) or where llguidance gives up (``a{100000}``:
    too many expressions). Every row of a step waits for the slowest mask, so the engine ends such
    a request with a GrammarError naming why (the worker's 400, or an error event once streaming),
    and its batch mates get what they get alone."""
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Spell something."}])

    def params(spec: GrammarSpec | None, max_tokens: int = 12) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, stop_token_ids=stops,
                              constraint=None if spec is None else compiler.constraint(spec))

    requests = {"slow": (prompt, params(GrammarSpec.of(REGEX, "[a-z]{3}a{30000}"), 40)),
                "broken": (prompt, params(GrammarSpec.of(REGEX, "[a-z]{3}a{100000}"), 40)),
                "choice": (prompt, params(GrammarSpec.of(CHOICE, ["yes", "no"]))),
                "free": (prompt, params(None))}
    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    b._masks.limit_s = 0.002  # the slow grammar's masks take ~4x that; the choice's microseconds
    out, finish, errors = {k: [] for k in requests}, {}, {}
    for key, request in requests.items():
        b.add(key, *request)
    for _ in range(500):
        if not b.has_work:
            break
        for key, u in b.step().items():
            out[key] += u.tokens
            if u.finish_reason is not None:
                finish[key], errors[key] = u.finish_reason, u.error
    assert not b.has_work
    assert finish["slow"] == FINISH_ERROR and isinstance(errors["slow"], GrammarError)
    assert "made decoding too slow: one token's mask took" in str(errors["slow"]) and "limit is 2 ms" in str(errors["slow"])
    assert finish["broken"] == FINISH_ERROR and isinstance(errors["broken"], GrammarError)
    assert "could not be followed further: lexer error: too many expressions" in str(errors["broken"])
    assert len(out["slow"]) < 40 and len(out["broken"]) < 40
    for key in ("choice", "free"):
        assert (out[key], finish[key]) == _run(runner, {key: requests[key]})[key], key


def test_compiled_grammars_are_cached_by_canonical_text_and_bounded(tokenizer, stops) -> None:
    small = GrammarCompiler(tokenizer, VOCAB, stops, cache_size=2)
    a = small.compile(GrammarSpec.of(JSON, {"type": "object", "properties": {"x": {"type": "integer"}}}))
    same = small.compile(GrammarSpec.of(JSON, '{"type":"object",  "properties": {"x": {"type": "integer"}}}'))
    assert same is a and len(small) == 1
    # Another key order is another grammar: properties come out in the schema's order.
    other = small.compile(GrammarSpec.of(JSON, '{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert other is not a and len(small) == 2
    small.compile(GrammarSpec.of(REGEX, "a+"))
    small.compile(GrammarSpec.of(REGEX, "b+"))
    assert len(small) == 2
    assert small.compile(GrammarSpec.of(JSON, {"type": "object", "properties": {"x": {"type": "integer"}}})) is not a


def test_objects_take_only_the_listed_properties_and_strings_no_control_characters(compiler, tokenizer) -> None:
    """A schema that lists properties and says nothing of others still gets no others (OpenAI's
    strict mode: the answer validates either way, and a model cannot wander into new keys); inside a
    string a raw control character is refused (invalid JSON); the listed answer is accepted."""
    spec = GrammarSpec.of(JSON, {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}})

    def consumed(text: str) -> bool:
        row = compiler.constraint(spec).start()
        return all(row.accept(t) for t in tokenizer.encode(text))

    assert consumed('{"a": "xy"}')
    assert not consumed('{"a": "xy", "b"')
    assert not consumed('{"a": "x\x01')


@pytest.mark.parametrize("regex,text,matches", [
    (r"\d{4}", "2024", True), (r"\d{4}", "٢٠٢٤", False), (r"\d", "\U0001FBF8", False),
    (r"\w+", "a_Z9", True), (r"\w+", "été", False),
    (r"[\d-]+", "12-3", True), (r"[\d-]+", "١٢", False), (r"[]\d]+", "]1", True),
    (r"\D+", "١٢", True), (r"\D", "1", False), (r"[^\D]+", "12", True), (r"[^\D]+", "١٢", False),
    (r"[x\W]+", "x é", True), (r"[x\W]+", "xa", False),
    (r"\p{Nd}{4}", "٢٠٢٤", True), (r"\\d", "\\d", True), (r"[[:digit:]]+", "12", True),
])
def test_regex_shorthands_are_ascii_as_in_json_schema_patterns(compiler, tokenizer, regex, text, matches) -> None:
    """\\d and \\w in a regex request mean what they mean in a JSON schema's pattern (ECMA-262) and in
    vLLM's default backend: ASCII digits and word characters, inside classes and negated too
    (llguidance's Rust syntax alone would let a model write any Unicode digit into a date)."""
    row = compiler.constraint(GrammarSpec.of(REGEX, regex)).start()
    assert (all(row.accept(t) for t in tokenizer.encode(text)) and row.matcher.is_accepting()) == matches
    schema = GrammarSpec.of(JSON, {"type": "string", "pattern": f"^{regex}$"})
    if "[]" not in regex and "[[:" not in regex and "\\p" not in regex:  # ECMA syntax reads those otherwise
        row = compiler.constraint(schema).start()
        assert (all(row.accept(t) for t in tokenizer.encode(json.dumps(text, ensure_ascii=False)))
                and row.matcher.is_accepting()) == matches


def test_numbers_end(compiler, tokenizer) -> None:
    """A number the schema leaves open still ends: at most 9 decimals, within +-(2^53 - 1)."""
    spec = GrammarSpec.of(JSON, {"type": "array", "items": {"type": "number"}})
    ints = GrammarSpec.of(JSON, {"type": "array", "items": {"type": "integer"}})

    def complete(s: GrammarSpec, text: str) -> bool:
        row = compiler.constraint(s).start()
        return all(row.accept(t) for t in tokenizer.encode(text)) and row.matcher.is_accepting()

    assert complete(spec, "[8495.011111111, -2.5, 9007199254740991]")
    assert not complete(spec, "[8495.0111111111]")
    assert not complete(ints, "[90071992547409910]") and complete(ints, "[-9007199254740991]")


def test_properties_come_out_in_the_schemas_order(runner, compiler, tokenizer, stops) -> None:
    schema = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "alpha": {"type": "boolean"},
                                               "mid": {"type": "string", "maxLength": 3}},
              "required": ["zeta", "alpha", "mid"], "additionalProperties": False}
    c = compiler.constraint(GrammarSpec.of(JSON, schema))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Give me JSON."}])
    out = _run(runner, {"r": (prompt, SamplingParams(max_tokens=60, stop_token_ids=stops, constraint=c))})
    assert out["r"][1] == "stop"
    assert list(json.loads(_text(tokenizer, *out["r"]))) == ["zeta", "alpha", "mid"]


def test_a_slow_compile_is_an_error_not_a_stall(tokenizer, stops) -> None:
    impatient = GrammarCompiler(tokenizer, VOCAB, stops, timeout_s=0.0005)
    # A large schema takes several milliseconds to compile, far over the limit.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i}}}x$"}
                                               for i in range(1, 60)}}
    with pytest.raises(GrammarError, match="did not compile within"):
        impatient.compile(GrammarSpec.of(JSON, schema))
    # The compile went on in the background: once done, the same schema is served from the cache.
    deadline = time.monotonic() + 30
    while len(impatient) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(impatient) == 1
    impatient.compile(GrammarSpec.of(JSON, schema))


def test_servekit_slices_extend_llguidances_and_leave_the_masks_as_they_were(compiler, tokenizer) -> None:
    """The compiler's tokenizer carries MASK_SLICES (llguidance's default slices and more steps of
    string lengths); along a walk of every schema, its masks equal those with the default slices
    alone: slices change what a mask costs, never what it allows."""
    import llguidance
    import numpy as np

    from servekit.optimizations.llm.grammar import MASK_SLICES, fill_masks

    assert set(llguidance.LLTokenizer.general_slices()) < set(MASK_SLICES)
    default = compiler.tokenizer.with_slices(llguidance.LLTokenizer.general_slices())
    words = (VOCAB + 31) // 32
    walked = 0
    for schema in [*SCHEMAS, {"type": "object", "properties": {"s": {"type": "string", "maxLength": 40}},
                              "required": ["s"], "additionalProperties": False}]:
        grammar = GrammarSpec.of(JSON, schema).grammar()
        ours, theirs = llguidance.LLMatcher(compiler.tokenizer, grammar), llguidance.LLMatcher(default, grammar)
        for step in range(60):
            a, b = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
            fill_masks([(ours, 0)], a, None)
            fill_masks([(theirs, 0)], b, None)
            assert torch.equal(a, b), (schema, step)
            allowed = np.flatnonzero(np.unpackbits(a[0].numpy().view(np.uint8), bitorder="little")[:VOCAB])
            t = int(allowed[(step * 7919) % len(allowed)])  # a different allowed token each step
            assert ours.consume_token(t) and theirs.consume_token(t)
            walked += 1
            if ours.is_stopped():
                break
    assert walked > 200



def test_the_engine_profiles_closed_loop_keeps_its_rows_busy_with_one_forward_a_step(runner, compiler, tokenizer,
                                                                                    stops, monkeypatch) -> None:
    """benchmarks/structured_engine_profile.py's closed loop: 7 constrained requests, 3 at a time,
    each finished one replaced by the next; every request is answered, never more than 3 run, and
    the steps run one forward each on average (the arrivals ride with the decoding rows), counting
    one more for each step in which every row that was decoding ended (the arrivals' first tokens
    and their next forward then go at once). Its fine phases time the parts of the engine thread's
    work."""
    from servekit.benchmarks.llm_workload_bench import PhaseTimer
    from servekit.benchmarks.structured_engine_profile import (DECODE_FORWARDS, FORWARDS, count_forwards, fine_phases,
                                                               run_once)
    from servekit.optimizations.llm import continuous, grammar

    b = ContinuousBatcher(runner, 4, prefill_chunk=32, max_num_batched_tokens=64)
    timer = PhaseTimer(exclusive=True)
    count_forwards(b, timer)
    # fine_phases wraps a class's and a module's functions: undone after the test
    monkeypatch.setattr(grammar.RowConstraint, "accept", grammar.RowConstraint.accept)
    monkeypatch.setattr(continuous, "upload", continuous.upload)
    fine_phases(b, timer)
    running: list[int] = []
    emptied = []  # steps in which every row that was decoding ended
    step = b.step

    def counted_step() -> dict:
        decoding = {s.key for s in b.slots if s is not None and not s.done and s.launched}
        out = step()
        running.append(b.running)
        if decoding and decoding <= {k for k, u in out.items() if u.finish_reason is not None}:
            emptied.append(len(running))
        return out

    b.step = counted_step
    prompts = [tokenizer.encode_chat([{"role": "user", "content": f"Loop {i}."}]) for i in range(7)]
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, stop_token_ids=stops,
                             constraint=compiler.constraint(GrammarSpec.of(JSON, SCHEMAS[i % 4]))) for i in range(7)]
    r = run_once(b, timer, prompts, params, "loop", at_once=3)
    assert all(n > 0 for n in r["lengths"]) and r["tokens"] == sum(r["lengths"])
    assert max(running) == 3 and not b.has_work
    assert timer.calls[FORWARDS] >= 4  # the first 3 prompts in one, the next 4 as rows freed (some together)
    forwards = timer.calls[FORWARDS] + timer.calls[DECODE_FORWARDS]
    assert 0 < forwards <= r["steps"] + len(emptied), (forwards, r["steps"], emptied)
    # every token a matcher took, and each packed forward's tables, timed
    assert timer.calls["  accept tokens"] >= r["tokens"] and timer.calls["  packed tables"] == timer.calls[FORWARDS]
    assert timer.calls["  mixed decode"] > 0 and r["host_ms_per_step"]["  read rows"] > 0


def test_the_profiles_requests_take_the_benchmarks_schemas_in_turn(compiler, tokenizer, stops) -> None:
    """``schema_requests``: request i asks about schema i's topic (in turn past the last), free and
    constrained alike seeded i; the constrained one under that schema, without its maxLengths when
    asked."""
    from servekit.benchmarks.structured_bench import SCHEMAS as BENCH
    from servekit.benchmarks.structured_engine_profile import schema_requests, without_max_length

    n = len(BENCH) + 2
    prompts, free, constrained = schema_requests(tokenizer, compiler, stops, n, max_tokens=9)
    _, _, stripped = schema_requests(tokenizer, compiler, stops, 2, strip_max_length=True)
    assert len(prompts) == len(free) == len(constrained) == n
    for i, (prompt, f, c) in enumerate(zip(prompts, free, constrained)):
        _, topic, schema = BENCH[i % len(BENCH)]
        assert f"Describe {topic} as JSON." in tokenizer.decode(prompt)
        assert (f.seed, c.seed, f.max_tokens, f.constraint) == (i, i, 9, None)
        assert c.constraint.spec == GrammarSpec.of(JSON, schema)
    assert [c.constraint.spec for c in stripped] == [GrammarSpec.of(JSON, without_max_length(BENCH[i][2]))
                                                     for i in range(2)]
    assert any(a.constraint.spec != b.constraint.spec for a, b in zip(stripped, constrained))


def test_the_profiles_host_walk_takes_one_path_through_every_schema(compiler) -> None:
    """The profile's host calibration walks the benchmark's schemas along the same path every time
    (so that its time compares between processes), each token one its mask allowed, and finishes
    grammars on the way."""
    from servekit.benchmarks.structured_bench import SCHEMAS as BENCH
    from servekit.benchmarks.structured_engine_profile import host_walk

    schemas = [schema for _, _, schema in BENCH]
    first, second = host_walk(compiler, schemas), host_walk(compiler, schemas)
    assert first[0] == second[0] and len(schemas) < first[0] < 60 * len(schemas), (first, second)
    assert first[1] > 0 and second[1] > 0


def test_the_profiles_schemas_without_max_length_keep_everything_else() -> None:
    from servekit.benchmarks.structured_bench import SCHEMAS as BENCH
    from servekit.benchmarks.structured_engine_profile import without_max_length

    for _, _, schema in BENCH:
        stripped = without_max_length(schema)
        assert '"maxLength"' not in json.dumps(stripped)
        assert json.dumps(stripped).count('"minLength"') == json.dumps(schema).count('"minLength"')
    book = next(s for n, _, s in BENCH if n == "book")
    assert without_max_length(book)["properties"]["title"] == {"type": "string", "minLength": 1}


def _consumed(compiler: GrammarCompiler, tokenizer: ChatTokenizer, spec: GrammarSpec, text: str) -> str:
    """Whether ``spec``'s grammar takes ``text``'s tokens: "accepting" (a whole answer),
    "incomplete" or "rejected"."""
    row = compiler.constraint(spec).start()
    if not all(row.accept(t) for t in tokenizer.encode(text)):
        return "rejected"
    return "accepting" if row.matcher.is_accepting() else "incomplete"


def test_a_thinking_block_before_each_kind_of_grammar(compiler, tokenizer) -> None:
    """GrammarSpec.think: with MAY_THINK the answer may open a <think> block (any text up to
    </think>, then newlines) before what the spec asks for, or answer at once; with THINKING the
    prompt opened it, so the answer starts inside it. After </think> the spec holds."""
    import dataclasses

    from servekit.optimizations.llm.grammar import MAY_THINK, THINKING

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    want = {  # text: (no block, MAY_THINK, THINKING)
        '<think>\nA {"brace\n</think>\n\n{"n": 1}': ("rejected", "accepting", "accepting"),
        '{"n": 1}': ("accepting", "accepting", "incomplete"),
        'So.</think>\n\n{"n": 2}': ("rejected", "rejected", "accepting"),
        '<think>a</think>{"n": 3}': ("rejected", "accepting", "accepting"),
        '<think>a</think>\n\nno JSON': ("rejected", "rejected", "rejected"),
    }
    for text, states in want.items():
        for think, state in zip(("", MAY_THINK, THINKING), states):
            spec = dataclasses.replace(GrammarSpec.of(JSON, schema), think=think)
            assert _consumed(compiler, tokenizer, spec, text) == state, (text, think)
    for kind, value, answer in ((REGEX, "[0-9]{3}", "123"), (CHOICE, ["yes", "no"], "no"),
                                (GRAMMAR, 'root ::= "a" "b"', "ab"), (JSON_OBJECT, None, '{"a": 1}')):
        spec = dataclasses.replace(GrammarSpec.of(kind, value), think=MAY_THINK)
        assert _consumed(compiler, tokenizer, spec, "<think>\nq\n</think>\n\n" + answer) == "accepting", kind
        assert _consumed(compiler, tokenizer, spec, answer) == "accepting", kind
        assert _consumed(compiler, tokenizer, spec, "<think>q</think>zz") == "rejected", kind
    assert compiler.constraint(dataclasses.replace(GrammarSpec.of(JSON, schema), think=THINKING)).spec.think == THINKING


def test_the_engine_decodes_a_thinking_block_then_the_schema(tmp_path, stops) -> None:
    """In the engine, with Qwen3's kind of tokenizer (<think> and </think> added as tokens of their
    own): a row whose prompt opened the thinking block thinks (here ended at once by a logit_bias
    on </think>, which the grammar allows until the block closes) and then answers under the
    schema, the bias no longer mattering: the text after </think> validates."""
    import dataclasses
    import shutil

    from tokenizers import AddedToken, Tokenizer

    from servekit.handlers.llm_openai_reasoning import ThinkingSplit
    from servekit.optimizations.llm.grammar import THINKING

    for f in smollm2_archive_files(torch.bfloat16)[0].parent.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = ChatTokenizer(tmp_path)
    close, vocab = tokenizer.token_id("</think>"), VOCAB + 2
    assert close == VOCAB + 1 and tokenizer.encode("</think>") == [close]
    runner = LlamaRunner(init_random(LlamaConfig.tiny(vocab_size=vocab), seed=0), max_seq_len=256,
                         batch_buckets=(1, 2, 4), prefill_buckets=(32, 64), kv_buckets=(128, 256))
    compiler = GrammarCompiler(tokenizer, vocab, stops)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    c = compiler.constraint(dataclasses.replace(GrammarSpec.of(JSON, schema), think=THINKING),
                            logit_bias=((close, 100.0),))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "A number, please."}]) + tokenizer.encode("<think>\n")
    (tokens, finish), = _run(runner, {"t": (prompt, SamplingParams(max_tokens=40, stop_token_ids=stops,
                                                                     constraint=c))}).values()
    text = tokenizer.decode(tokens)
    assert tokens[0] == close and finish == "stop", text
    thought, answer = ThinkingSplit(inside=True).feed(text, final=True)
    assert thought == ""
    jsonschema.validate(json.loads(answer), schema)
