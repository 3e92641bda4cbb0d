"""Structured outputs served: every answer parses and validates, and what a schema costs in time.

SmolLM2 (or the checkpoint of ``--model-dir``) served by its own TorchServe (continuous batching,
the plan of ``--config``) answers OpenAI chat completions with ``response_format: {"type":
"json_schema", ...}``:

1. Validity: each of the 24 schemas below (nested objects, arrays with minItems/maxItems, enums,
   integer and number bounds, string patterns and lengths, optional properties, anyOf) with
   ``--prompts`` prompts, sampled (temperature 0.8, a seed per request), sent ``--concurrency`` at a
   time, once as JSON answers and once streamed. An answer counts as valid when it finished with
   ``stop``, its text parses as JSON and ``jsonschema`` validates it against its schema. Before
   these runs each schema is used once, alone (``--no-warm-schemas``: not), so that the runs
   measure decoding rather than several first compilations queued behind each other.
2. Added TTFT: one streamed request at a time, nothing else running. Free requests (no format) and
   requests whose schema is compiled already (cached) alternate, ``--ttft-requests`` of each; the
   added TTFT is the difference of their medians. Then ``--first-use`` schemas never seen before (a
   schema of the set with a new ``description``, so a new cache key): each one's TTFT minus the
   cached median is the first use's added time (compiling the grammar).
3. Tokens/s with constrained and free rows mixed: ``--concurrency`` streamed requests at a time,
   all free, half constrained, all constrained; total tokens/s per mix. ``--load`` says how they
   are sent: ``rounds`` of ``--concurrency`` requests released at the same instant, each round
   waiting for its slowest answer (every round pays a burst of first tokens and a tail of a few
   long answers), or ``streams``: ``--concurrency`` clients that each send their ``--rounds``
   requests one after the other, a new one as soon as the last ends (the closed-loop streams of
   the LLM benchmarks). The
   schemas' answers are about half as long as free ones, so rows sit empty between a short answer's
   end and the round's last one: a fourth mix sends free requests exactly as long as the
   constrained answer of the same round and position (``max_tokens`` its length, ``ignore_eos``:
   "free, matched lengths"), and the comparison
   gives the all-constrained tokens/s against both (``compare()``). Per mix also the answers'
   length, TTFT and tokens per engine step (tokens/s x the handler's mean inter-token time).

    # GPU (benchmarks/gpu_run_extra.sh structured):
    python3 -m servekit.benchmarks.structured_bench --out DIR
    # another converted checkpoint under the same plan, e.g. a shaped one (random weights: the
    # grammar still decides what they write):
    python3 -m servekit.benchmarks.shaped_models --out /opt/shaped --models qwen2.5-0.5b
    python3 -m servekit.benchmarks.structured_bench --out DIR --model-dir /opt/shaped/qwen2.5-0.5b
    # CPU smoke run:
    python -m servekit.benchmarks.structured_bench --out /tmp/structured-cpu --config config/models/smollm2-cpu.yaml \\
        --prompts 1 --ttft-requests 2 --first-use 2 --rounds 1

Writes ``structured_bench.json`` and ``structured_bench.md``; exits 1 if any answer is invalid or a
step failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import requests

from servekit.benchmarks.bench.stats import percentile
from servekit.benchmarks.llm_inprocess import environment as llm_environment
from servekit.benchmarks.llm_serve_bench import post_events, read_events, run_together, variant_config
from servekit.benchmarks.llm_workload_bench import HandlerSplit
from servekit.model_source import LLM
from servekit.resources import model_config
from servekit.torchserve import TorchServe

if TYPE_CHECKING:
    from servekit.archive import ArchiveSpec

MODEL = "smollm2"


def _str(max_len: int = 24, **kw: Any) -> dict:
    # Every string is bounded: an unbounded string lets a sampled answer run into max_tokens.
    return {"type": "string", "minLength": 1, "maxLength": max_len, **kw}


def _obj(props: dict, optional: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "required": [k for k in props if k not in optional],
            "additionalProperties": False}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> dict:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _arr(items: dict, lo: int, hi: int) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


DATE = {"type": "string", "pattern": "^2026-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])$"}
COUNTRY = {"enum": ["US", "FR", "DE", "JP", "BR"]}

# (name, what to ask about, schema)
SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "a person", _obj({"name": _str(), "age": _int(0, 120),
                                 "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
                                 "nickname": _str(12)}, optional=("nickname",))),
    ("address", "a postal address", _obj({"street": _str(30), "city": _str(),
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": COUNTRY})),
    ("order", "a shop order", _obj({
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": _arr(_obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": _int(1, 10),
                            "price": _num(0, 1000)}), 1, 3),
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]}})),
    ("weather", "today's weather in a city", _obj({"city": _str(), "temp_c": _num(-60, 60),
                                                   "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                                                   "humidity": _int(0, 100)})),
    ("review", "a product review", _obj({"rating": _int(1, 5), "title": _str(40), "pros": _arr(_str(20), 0, 3),
                                         "cons": _arr(_str(20), 0, 3)}, optional=("cons",))),
    ("event", "a meetup", _obj({"name": _str(30), "date": DATE,
                                "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                                "attendees": _int(1, 500), "online": {"type": "boolean"}})),
    ("book", "a novel", _obj({"title": _str(40), "author": _obj({"first": _str(16), "last": _str(16)}),
                              "year": _int(1450, 2026),
                              "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science",
                                                                             "poetry", "crime"]},
                                         "minItems": 1, "maxItems": 3}})),
    ("recipe", "a recipe", _obj({"name": _str(30), "servings": _int(1, 12),
                                 "ingredients": _arr(_obj({"item": _str(20), "grams": _int(1, 2000)}), 2, 5),
                                 "vegetarian": {"type": "boolean"}})),
    ("movie", "a film", _obj({"title": _str(40), "year": _int(1900, 2026), "rating": _num(0, 10),
                              "cast": _arr(_str(24), 1, 3)})),
    ("invoice", "an invoice", _obj({"number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                                    "currency": {"enum": ["USD", "EUR", "JPY"]},
                                    "lines": _arr(_obj({"desc": _str(30), "amount": _num(0, 10000)}), 1, 3),
                                    "paid": {"type": "boolean"}, "note": _str(40)}, optional=("note",))),
    ("flight", "a flight booking", _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "seat": {"type": "string", "pattern": "^[1-9][0-9]?[A-F]$"},
                                         "class": {"enum": ["economy", "business", "first"]}})),
    ("color", "a colour", _obj({"name": _str(16), "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
                                "rgb": _arr(_int(0, 255), 3, 3)})),
    ("task", "a to-do item", _obj({"title": _str(40), "priority": {"enum": ["low", "medium", "high"]},
                                   "done": {"type": "boolean"},
                                   "tags": _arr({"type": "string", "pattern": "^[a-z]{2,8}$"}, 0, 4), "due": DATE},
                                  optional=("due",))),
    ("place", "a place on the map", _obj({"lat": _num(-90, 90), "lon": _num(-180, 180), "label": _str(30)},
                                         optional=("label",))),
    ("company", "a company", _obj({"name": _str(30), "founded": _int(1800, 2026), "employees": _int(1, 1000000),
                                   "hq": _obj({"city": _str(), "country": COUNTRY}), "public": {"type": "boolean"}})),
    ("sensor", "a temperature sensor's readings", _obj({"id": {"type": "string", "pattern": "^S[0-9]{3}$"},
                                                        "readings": _arr(_num(-40, 125), 1, 4),
                                                        "unit": {"enum": ["C", "F"]}})),
    ("settings", "an app's user settings", _obj({
        "theme": {"enum": ["light", "dark", "system"]},
        "notifications": _obj({"email": {"type": "boolean"}, "sms": {"type": "boolean"}}),
        "language": {"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"}, "font_size": _int(8, 32)})),
    ("quiz", "a quiz question", _obj({"question": _str(60), "choices": _arr(_str(20), 2, 4), "answer": _int(0, 3)})),
    ("transfer", "a bank transfer", _obj({
        "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,12}$"},
        "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 100000},
        "currency": {"enum": ["USD", "EUR", "GBP"]}, "reference": _str(30)}, optional=("reference",))),
    ("product", "a product listing", _obj({
        "name": _str(30), "price": _num(0.01, 9999), "in_stock": {"type": "boolean"},
        "size": _obj({"w": _num(0, 500), "h": _num(0, 500), "d": _num(0, 500)}),
        "variants": _arr({"enum": ["red", "blue", "black", "white"]}, 0, 3)}, optional=("variants",))),
    ("sentiment", "the sentiment of a tweet", _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                                                    "confidence": _num(0, 1), "keywords": _arr(_str(16), 1, 3)})),
    ("tree", "a small family tree", _obj({"name": _str(16), "children": _arr(_obj({
        "name": _str(16), "children": _arr(_obj({"name": _str(16)}), 0, 2)}), 0, 2)})),
    ("log", "a server log line", _obj({"level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "code": _int(100, 599),
                                       "message": _str(50),
                                       "at": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]:[0-5][0-9]$"}})),
    ("contact", "how to contact someone", _obj({
        "method": {"enum": ["email", "phone"]},
        "value": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
                            {"type": "string", "pattern": "^\\+[0-9]{8,12}$"}]}})),
]
PROMPTS = ("Give me {topic} as JSON.", "Invent {topic} for a test, in JSON.", "Describe {topic}. Answer with JSON only.",
           "Write {topic} for a children's story, as JSON.")
FREE_PROMPT = "Give me a person as JSON."


@dataclass
class Answer:
    """One chat completion, times in seconds from its send (TTFT only when streamed)."""

    schema: str | None
    stream: bool
    status: int
    finish: str | None
    text: str
    tokens: int
    ttft_s: float | None
    total_s: float
    error: str = ""
    valid: bool = False


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat(url: str, prompt: str, max_tokens: int, stream: bool, schema: tuple[str, dict] | None = None,
         seed: int | None = None, temperature: float = 0.8, timeout: float = 600.0, ignore_eos: bool = False) -> Answer:
    """One chat completion, JSON or streamed (OpenAI SSE chunks), with `schema` as its response_format;
    `ignore_eos`: only `max_tokens` ends the answer (vLLM's extension, which servekit takes)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    if ignore_eos:
        body["ignore_eos"] = True
    if schema is not None:
        body["response_format"] = response_format(*schema)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    name = schema[0] if schema else None
    t0 = time.perf_counter()
    if stream:  # the same light client as the LLM benchmarks: raw lines timed, decoded afterwards
        status, lines, error = post_events(url, body, timeout, t0)
        total = time.perf_counter() - t0
        if status != 200:
            return Answer(name, stream, status, None, "", 0, None, total, error)
        a = read_events(lines)
        return Answer(name, stream, 200, a.finish, a.text, a.usage.get("completion_tokens", 0), a.first_s, total)
    try:
        with requests.post(url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return Answer(name, stream, r.status_code, None, "", 0, None, time.perf_counter() - t0, r.text[:300])
            got = r.json()
            choice = got["choices"][0]
            return Answer(name, stream, 200, choice.get("finish_reason"), choice["message"].get("content") or "",
                          got["usage"]["completion_tokens"], None, time.perf_counter() - t0)
    except (requests.RequestException, ValueError, KeyError) as e:
        return Answer(name, stream, -1, None, "", 0, None, time.perf_counter() - t0, f"{type(e).__name__}: {e}")


def check(answer: Answer, schema: dict) -> Answer:
    """Mark `answer` valid when it finished with stop, parses and validates against `schema`."""
    if answer.status != 200:
        return answer
    if answer.finish != "stop":
        answer.error = f"finish_reason {answer.finish!r}"
        return answer
    try:
        jsonschema.validate(json.loads(answer.text), schema)
    except json.JSONDecodeError as e:
        answer.error = f"not JSON: {e}"
    except jsonschema.ValidationError as e:
        answer.error = f"invalid at {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:200]}"
    else:
        answer.valid = True
    return answer


def validity(url: str, n_prompts: int, concurrency: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    """Every schema x `n_prompts` prompts, `concurrency` requests in flight."""
    jobs = [(name, topic, schema, k) for name, topic, schema in SCHEMAS for k in range(n_prompts)]

    def one(job: tuple[str, str, dict, int]) -> Answer:
        name, topic, schema, k = job
        prompt = PROMPTS[k % len(PROMPTS)].format(topic=topic)
        return check(chat(url, prompt, max_tokens, stream, (name, schema), seed=1000 + k), schema)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    bad = [a for a in answers if not a.valid]
    finishes: dict[str, int] = {}
    for a in answers:
        finishes[str(a.finish)] = finishes.get(str(a.finish), 0) + 1
    return {"stream": stream, "schemas": len(SCHEMAS), "prompts_per_schema": n_prompts, "requests": len(answers),
            "valid": len(answers) - len(bad), "valid_rate": round((len(answers) - len(bad)) / len(answers), 4),
            "refused": sum(a.status != 200 for a in answers),
            "finish_reasons": finishes, "completion_tokens": sum(a.tokens for a in answers),
            "wall_s": round(wall, 2), "failures": [asdict(a) for a in bad[:10]],
            "examples": {a.schema: a.text for a in answers[::max(1, n_prompts)]}}


def warm_schemas(url: str) -> dict[str, Any]:
    """Each schema used once, alone (a 1-token request): its grammar compiled before the validity
    runs, where first uses arriving together share the worker's compile threads and time limit."""
    times, refused = [], {}
    for name, _, schema in SCHEMAS:
        a = chat(url, FREE_PROMPT, 1, False, (name, schema), temperature=0)
        times.append(a.total_s)
        if a.status != 200:
            refused[name] = a.error
    return {"schemas": len(SCHEMAS), "request_ms_p50": ms(times, 50), "request_ms_max": ms(times, 100),
            "refused": refused}


def ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1e3, 2) if values else None


def added(ms_: float | None, base: float | None) -> float | None:
    """``ms_ - base`` in ms, rounded as ``ms`` rounds; None where either is missing."""
    return round(ms_ - base, 2) if ms_ is not None and base is not None else None


def added_ttft(url: str, n: int, first_use: int, nonce: str) -> dict[str, Any]:
    """Free vs cached-schema TTFT, alternating one request at a time; then schemas never seen before."""
    name, topic, schema = SCHEMAS[0]
    free, cached = [], []
    chat(url, FREE_PROMPT, 8, True, (name, schema), temperature=0)  # compiles it: every later use is cached
    for _ in range(n):
        a = chat(url, FREE_PROMPT, 8, True, temperature=0)
        b = chat(url, FREE_PROMPT, 8, True, (name, schema), temperature=0)
        free += [a.ttft_s] if a.ttft_s is not None else []
        cached += [b.ttft_s] if b.ttft_s is not None else []
    fresh, per_schema = [], {}
    for k in range(first_use):
        fname, ftopic, fschema = SCHEMAS[k % len(SCHEMAS)]
        new = {**fschema, "description": f"first use {nonce} {k}"}  # a new cache key, the same language
        a = chat(url, PROMPTS[0].format(topic=ftopic), 8, True, (fname, new), temperature=0)
        if a.ttft_s is not None:
            fresh.append(a.ttft_s)
        per_schema[f"{fname}#{k}"] = round(a.ttft_s * 1e3, 2) if a.ttft_s is not None else a.error[:200]
    free_p50, cached_p50 = ms(free, 50), ms(cached, 50)
    return {"requests_each": n, "free_ttft_ms_p50": free_p50, "free_ttft_ms_p90": ms(free, 90),
            "cached_ttft_ms_p50": cached_p50, "cached_ttft_ms_p90": ms(cached, 90),
            "added_cached_ms_p50": added(cached_p50, free_p50),
            "first_use_requests": len(fresh), "first_use_ttft_ms_p50": ms(fresh, 50),
            "first_use_ttft_ms_max": ms(fresh, 100),
            "added_first_use_ms_p50": added(ms(fresh, 50), cached_p50),
            "added_first_use_ms_max": added(ms(fresh, 100), cached_p50),
            "first_use_ttft_ms_by_schema": per_schema}


MATCHED = "free, matched lengths"


def matched_max_tokens(constrained: list[list["Answer"]]) -> list[list[int]]:
    """Per round and request, the ``max_tokens`` of a free request as long as the constrained
    answer of the same round and position: its completion tokens (at least 1). The request is sent
    with ``ignore_eos``, so that it is exactly that long rather than at most."""
    return [[max(1, a.tokens) for a in answers] for answers in constrained]


def mix_row(name: str, share: float, concurrency: int, answers: list["Answer"], wall: float,
            handler: dict[str, Any], load: str = "rounds") -> dict[str, Any]:
    """One mix's figures: tokens/s over the rounds' wall time, answer length, TTFT, and tokens per
    engine step estimated as tokens/s x the handler's mean inter-token time (its ITL histogram:
    one step per token of a decoding row)."""
    ok = [a for a in answers if a.status == 200]
    ttft = [a.ttft_s for a in ok if a.ttft_s is not None]
    tokens = sum(a.tokens for a in ok)
    tok_s = tokens / wall if wall else None
    itl = handler.get("handler_itl_ms_mean")
    return {"mix": name, "load": load, "constrained_share": share, "concurrency": concurrency, "requests": len(answers),
            "failed": len(answers) - len(ok), "completion_tokens": tokens,
            "mean_answer_tokens": round(tokens / len(ok), 1) if ok else None,
            "tok_per_s_total": round(tok_s, 1) if tok_s else None,
            "tokens_per_step": round(tok_s * itl / 1e3, 1) if tok_s and itl else None,
            "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99), **handler}


def compare(mixes: list[dict[str, Any]], target: float = 0.9) -> dict[str, Any]:
    """All constrained tokens/s as a share of free tokens/s at the same load: against free answers
    of their natural length (the target's wording) and against free answers of the constrained
    answers' lengths (the same rows busy for the same steps). With each, how much later a
    constrained request's first token came under that load: the clients' TTFT p50 and the
    handler's mean (a cached schema's added TTFT is measured one request at a time, ``added_ttft()``;
    under load the constrained steps are longer, and so is the way to a first token)."""
    by = {m["mix"]: m for m in mixes}
    json_ = by.get("all constrained")
    out: dict[str, Any] = {"target": target}
    for key, name in (("vs_free", "all free"), ("vs_free_matched", MATCHED)):
        free = by.get(name)
        if json_ and free and json_["tok_per_s_total"] and free["tok_per_s_total"]:
            share = json_["tok_per_s_total"] / free["tok_per_s_total"]
            out[key] = {"share": round(share, 3), "met": share >= target,
                        "constrained_tok_per_s": json_["tok_per_s_total"], "free_tok_per_s": free["tok_per_s_total"],
                        "constrained_answer_tokens": json_["mean_answer_tokens"],
                        "free_answer_tokens": free["mean_answer_tokens"],
                        "ttft_later_ms_p50": added(json_["ttft_ms_p50"], free["ttft_ms_p50"]),
                        "handler_ttft_later_ms_mean": added(json_.get("handler_ttft_ms_mean"),
                                                            free.get("handler_ttft_ms_mean"))}
    return out


MIXES = {"free": ("all free", 0.0), "half": ("half constrained", 0.5), "constrained": ("all constrained", 1.0),
         "matched": (MATCHED, 0.0)}


# How the mixes' requests are sent (mixed()), and how the report names each.
LOAD_WORDS = {"rounds": "at once", "streams": "streams"}
LOADS = tuple(LOAD_WORDS)


def mixed(url: str, concurrency: int, rounds: int, max_tokens: int, split: Any = None,
          mixes: tuple[str, ...] = tuple(MIXES), load: str = "rounds") -> list[dict[str, Any]]:
    """`rounds` x `concurrency` streamed requests: all free, half constrained, all constrained, then
    free again with each request exactly as long as the constrained answer of its round and
    position (`mixes`: which of these, by their keys in MIXES; "matched" needs "constrained").
    `load` "rounds": each round's requests sent at once, the next round when all have answered;
    "streams": `concurrency` clients, client i sending request i of each round in turn, the next as
    soon as its last one ends. `split`: the handler's metrics (start/stop) around each mix."""
    if load not in LOADS:
        raise ValueError(f"load {load!r}: one of {', '.join(LOADS)}")
    out = []
    constrained: list[list[Answer]] = []
    caps: list[list[int]] = []
    for name, share in (MIXES[m] for m in MIXES if m in mixes):
        if name == MATCHED:
            caps = matched_max_tokens(constrained)
        n_constrained = round(concurrency * share)
        answers: list[Answer] = []
        wall = 0.0
        if split is not None:
            split.start()
        got: list[list[Answer | None]] = [[None] * concurrency for _ in range(rounds)]
        asks = []
        for r in range(rounds):
            asks.append([])
            for i in range(concurrency):
                schema_name, topic, schema = SCHEMAS[(r * concurrency + i) % len(SCHEMAS)]
                asks[r].append((PROMPTS[i % len(PROMPTS)].format(topic=topic),
                                (schema_name, schema) if i < n_constrained else None,
                                caps[r][i] if name == MATCHED else max_tokens))

        def send(r: int, i: int, got: list = got, asks: list = asks, exact: bool = name == MATCHED) -> None:
            got[r][i] = chat(url, asks[r][i][0], asks[r][i][2], True, asks[r][i][1], seed=i, ignore_eos=exact)

        if load == "rounds":
            for r in range(rounds):
                wall += run_together(lambda i, r=r: send(r, i), concurrency)
        else:
            wall = run_together(lambda i: [send(r, i) for r in range(rounds)], concurrency)
        for round_got in got:
            answers += [a for a in round_got if a is not None]
            if share == 1.0:
                constrained.append([a if a is not None else Answer(None, True, -1, None, "", 0, None, 0.0)
                                    for a in round_got])
        out.append(mix_row(name, share, concurrency, answers, wall, split.stop() if split is not None else {}, load))
        print(f"  mixed, {name}: {json.dumps(out[-1])}", flush=True)
    return out


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [f"# Structured outputs served: SmolLM2, {env.get('gpu') or 'CPU'}", "",
             f"`{env.get('command', '')}`", "",
             "| run | requests | valid | refused (not 200) | finish reasons | completion tokens | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in res.get("validity", []):
        lines.append(f"| {'streamed' if v['stream'] else 'JSON'} | {v['requests']} | {v['valid']} "
                     f"({v['valid_rate']:.1%}) | {v['refused']} | {v['finish_reasons']} | {v['completion_tokens']} | "
                     f"{v['wall_s']} |")
    w = res.get("warm_schemas")
    if w:
        lines += ["", f"Each schema used once first, alone: request p50 {w['request_ms_p50']} ms, max "
                      f"{w['request_ms_max']} ms; refused: {w['refused'] or 'none'}."]
    t = res.get("ttft")
    if t:
        lines += ["", "| TTFT, one request at a time | p50 ms | added (p50) ms |", "| --- | --- | --- |",
                  f"| free | {t['free_ttft_ms_p50']} | |",
                  f"| cached schema | {t['cached_ttft_ms_p50']} | {t['added_cached_ms_p50']} |",
                  f"| first use of a schema ({t['first_use_requests']}) | {t['first_use_ttft_ms_p50']} "
                  f"(max {t['first_use_ttft_ms_max']}) | {t['added_first_use_ms_p50']} "
                  f"(max {t['added_first_use_ms_max']}) |",
                  "", "First-use TTFT by schema (ms): " + ", ".join(
                      f"{k} {v}" for k, v in t.get("first_use_ttft_ms_by_schema", {}).items())]
    if res.get("mixed"):
        lines += ["", "| mix (requests in flight) | requests | tokens per answer | tokens/s total | tokens per step "
                      "(tokens/s x handler ITL) | TTFT p50 ms | TTFT p99 ms |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {m['mix']} ({m['concurrency']} {LOAD_WORDS[m['load']]}) | {m['requests']} | "
                  f"{m['mean_answer_tokens']} | {m['tok_per_s_total']} | {m['tokens_per_step']} | {m['ttft_ms_p50']} | "
                  f"{m['ttft_ms_p99']} |" for m in res["mixed"]]
        for load, c in res.get("comparison", {}).items():
            for key, what in (("vs_free", "free answers"), ("vs_free_matched", "free answers of the constrained "
                                                                                "answers' lengths")):
                if key in c:
                    v = c[key]
                    lines.append(f"\n{LOAD_WORDS[load].capitalize()}, all constrained against {what}: "
                                 f"{v['constrained_tok_per_s']} / {v['free_tok_per_s']} tokens/s = {v['share']:.0%} "
                                 f"(target {c['target']:.0%}: {'met' if v['met'] else 'missed'}; "
                                 f"{v['constrained_answer_tokens']} against {v['free_answer_tokens']} tokens per answer). "
                                 f"A constrained first token came {v['ttft_later_ms_p50']} ms later at the median "
                                 f"(the handler's mean: {v['handler_ttft_later_ms_mean']} ms).")
    if res.get("error"):
        lines += ["", f"**error:** {res['error']}"]
    return "\n".join(lines) + "\n"


def served_model(model_dir: Path | None) -> tuple[str, ArchiveSpec | None]:
    """The name the bench archives and calls the model by, and its archive spec: SmolLM2's (None)
    without ``model_dir``; else the folder's (ValueError / FileNotFoundError naming what cannot be
    served, or when it is not an LLM)."""
    if model_dir is None:
        return MODEL, None
    from servekit.benchmarks.bench.archives import model_spec
    from servekit.benchmarks.llm_continuous_bench import served_name

    spec = model_spec(str(model_dir))
    if spec.kind != LLM:
        raise ValueError(f"a {spec.kind} model, not an LLM")
    return served_name(str(model_dir)), spec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.structured_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for structured_bench.json / .md")
    p.add_argument("--config", type=Path, default=model_config("smollm2"), help="model-config (continuous batching)")
    p.add_argument("--prompts", type=int, default=3, help=f"prompts per schema (at most {len(PROMPTS)})")
    p.add_argument("--concurrency", type=int, default=16 if cuda else 4, help="requests in flight (the batch size)")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--ttft-requests", type=int, default=20 if cuda else 2)
    p.add_argument("--first-use", type=int, default=len(SCHEMAS) if cuda else 2,
                   help="schemas used for the first time (default on CUDA: each of the set)")
    p.add_argument("--rounds", type=int, default=3 if cuda else 1,
                   help="rounds per mix of constrained rows (with --load streams: requests per stream)")
    p.add_argument("--load", nargs="+", choices=LOADS, default=["rounds"],
                   help="how the mixes' requests are sent: rounds released at once, closed-loop streams, or "
                        "both one after the other (default: rounds)")
    p.add_argument("--mixed-max-tokens", type=int, default=128 if cuda else 24)
    p.add_argument("--warm-schemas", action=argparse.BooleanOptionalAction, default=True,
                   help="use each schema once, alone, before the validity runs (default on; off: their "
                        "first uses arrive concurrently)")
    p.add_argument("--mixes", nargs="+", choices=list(MIXES), default=list(MIXES),
                   help="which mixes of constrained rows to run (default: all four; matched needs constrained)")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--model-dir", type=Path, help="a converted LLM checkpoint to serve instead of SmolLM2")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS) or args.concurrency < 2 or args.rounds < 1:
        p.error(f"--prompts must be 1..{len(PROMPTS)}, --concurrency >= 2, --rounds >= 1")
    if "matched" in args.mixes and "constrained" not in args.mixes:
        p.error("--mixes matched needs constrained: its caps are the constrained answers' lengths")
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    try:
        name, spec = served_model(args.model_dir)
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--model-dir {args.model_dir}: {e}")
    from servekit.archive import build_archive

    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"environment": llm_environment(argv, "servekit.benchmarks.structured_bench"),
                           "args": {k: str(v) for k, v in vars(args).items()}, "validity": []}

    def save() -> None:
        (args.out / "structured_bench.json").write_text(json.dumps(res, indent=1))
        (args.out / "structured_bench.md").write_text(markdown(res))

    with tempfile.TemporaryDirectory(prefix="servekit-structured-") as tmp:
        work = Path(tmp)
        config = work / "config.yaml"
        import yaml

        cfg = variant_config(args.config, [1, args.concurrency], 5, None)
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        build_archive(name, work / "store", config=config, compress=False, spec=spec)
        try:
            with TorchServe(work / "run", work / "store") as ts:
                t0 = time.perf_counter()
                ts.register(f"{name}.mar", name, timeout=args.ready_timeout)
                res["ready_s"] = round(time.perf_counter() - t0, 1)
                url = f"{ts.inference_url}/predictions/{name}/1.0/v1/chat/completions"
                chat(url, FREE_PROMPT, 4, False)  # the first request after start: not measured
                if args.warm_schemas:
                    res["warm_schemas"] = warm_schemas(url)
                    print(f"== schemas warmed: {json.dumps(res['warm_schemas'])}", flush=True)
                for stream in (False, True):
                    res["validity"].append(validity(url, args.prompts, args.concurrency, args.max_tokens, stream))
                    v = res["validity"][-1]
                    print(f"== validity ({'streamed' if stream else 'JSON'}): {v['valid']}/{v['requests']} "
                          f"{v['finish_reasons']}", flush=True)
                    save()
                res["ttft"] = added_ttft(url, args.ttft_requests, args.first_use, f"{time.time_ns()}")
                print(f"== TTFT: {json.dumps(res['ttft'])}", flush=True)
                save()
                res["mixed"], res["comparison"] = [], {}
                for load in args.load:
                    rows = mixed(url, args.concurrency, args.rounds, args.mixed_max_tokens,
                                 HandlerSplit(ts.metrics_url), tuple(args.mixes), load)
                    res["mixed"] += rows
                    res["comparison"][load] = compare(rows)
                    save()
        except Exception as e:  # keep what was measured
            res["error"] = f"{type(e).__name__}: {e}"
    save()
    print(markdown(res))
    all_valid = bool(res["validity"]) and all(v["valid"] == v["requests"] for v in res["validity"])
    return 0 if all_valid and "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
