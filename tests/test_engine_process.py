"""The engine in a process of its own (servekit.optimizations.llm.engine_process), on conftest's
`tiny_smollm2`, CPU: it answers exactly as the same engine in-process (grammars and seeds crossing
the boundary included), refuses a bad plan with the engine's own reason, fails the requests in flight
when it dies, and does not outlive the worker that started it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import yaml

from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import FINISH_ERROR, ContinuousBatcher, EngineThread
from servekit.optimizations.llm.engine_process import EngineError, EngineProcess, EngineSpec
from servekit.optimizations.llm.generate import SamplingParams
from servekit.optimizations.llm.grammar import JSON, REGEX, DeferredGrammars, GrammarCompiler, GrammarError, GrammarSpec
from servekit.optimizations.llm.plan import LlmPlan, load_llm_runner, parse_llm_plan, stop_token_ids
from servekit.optimizations.plan import PlanError
from servekit.resources import model_config

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _plan() -> LlmPlan:
    cfg = yaml.safe_load(model_config("smollm2-cpu").read_text())["servekit"]
    cfg.update({"max_seq_len": 256, "limits": {"max_tokens": 200},
                "buckets": {"batch_sizes": [1, 2, 4], "prompt_lens": [64, 128], "kv_lens": [256]}})
    return parse_llm_plan(cfg)


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], timeout: float = 60.0) -> dict:
    """Each request's tokens, finish reason and error, submitted together to ``engine``."""
    out = {key: {"tokens": [], "finish": None, "error": None, "cached": 0} for key in requests}
    for key, (prompt, params) in requests.items():
        engine.submit(key, prompt, params)
    deadline = time.monotonic() + timeout
    while any(o["finish"] is None for o in out.values()) and time.monotonic() < deadline:
        for key, u in engine.take(list(requests), 1.0).items():
            o = out[key]
            o["tokens"] += u.tokens
            o["finish"], o["error"] = u.finish_reason, u.error
            o["cached"] = o["cached"] or u.cached_tokens
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_smollm2: list[Path]) -> Path:
    return tiny_smollm2[0].parent


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    engine = EngineProcess(EngineSpec(str(model_dir), _plan(), 4))
    yield engine
    engine.close()


def _requests(model_dir: Path) -> dict[str, tuple[list[int], SamplingParams]]:
    tok = ChatTokenizer(model_dir)
    stops = stop_token_ids(model_dir, tok)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    compiler = GrammarCompiler(tok, vocab_size, stops)
    constraint = compiler.constraint(GrammarSpec.of(JSON, SCHEMA))
    prompt = tok.encode_chat([{"role": "user", "content": "Give me a name and an age as JSON."}])
    return {"greedy": (prompt, SamplingParams(max_tokens=24, stop_token_ids=stops)),
            "seeded": (prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=7, stop_token_ids=stops)),
            "json": (prompt, SamplingParams(max_tokens=60, stop_token_ids=stops, constraint=constraint))}


def test_the_engine_process_answers_as_the_engine_in_process(engine: EngineProcess, model_dir: Path) -> None:
    ready = engine.ready
    assert ready.max_num_seqs == 4 and ready.shape.max_seq_len == 256 and ready.shape.max_prompt_len == 128
    assert engine.pid != os.getpid()
    # The built engine is out of the garbage collector's reach: a full collection would walk it all.
    assert ready.frozen_objects > 10_000, ready.frozen_objects
    requests = _requests(model_dir)
    remote = _run(engine, requests)
    runner, plan, _ = load_llm_runner(str(model_dir), _plan())
    local = _run(EngineThread(ContinuousBatcher(runner, 4, plan.prefill_chunk, plan.max_num_batched_tokens)), requests)
    for key in requests:
        assert remote[key]["error"] is None and remote[key]["finish"] in ("stop", "length"), remote[key]
        assert remote[key]["tokens"] == local[key]["tokens"], key
    text = ChatTokenizer(model_dir).decode([t for t in remote["json"]["tokens"] if t not in requests["json"][1].stop_token_ids])
    jsonschema.validate(json.loads(text), SCHEMA)  # the grammar crossed and held
    again = _run(engine, {"again": requests["greedy"]})["again"]
    assert again["tokens"] == remote["greedy"]["tokens"] and again["cached"] > 0  # the engine's prefix cache
    assert engine.settle(5) and engine.gauges.running == 0 and engine.gauges.waiting == 0
    assert engine.gauges.prefix is not None and engine.gauges.prefix.hit_tokens >= again["cached"]


def test_a_request_the_engine_refuses_gets_its_own_error(engine: EngineProcess, model_dir: Path) -> None:
    prompt, params = _requests(model_dir)["greedy"]
    out = _run(engine, {"long": (prompt, SamplingParams(max_tokens=250)), "ok": (prompt, params)})
    assert out["long"]["finish"] == FINISH_ERROR and "exceeds the context of 256 tokens" in str(out["long"]["error"])
    assert isinstance(out["long"]["error"], ValueError) and out["ok"]["finish"] in ("stop", "length")
    # Cancelled while running: what the engine reported before it took the cancellation in is dropped.
    engine.submit("cancelled", prompt, SamplingParams(max_tokens=150))
    assert engine.take(["cancelled"], 30)["cancelled"].tokens
    engine.cancel("cancelled")
    assert engine.settle(5) and engine.take(["cancelled"], 0.2) == {}


def test_grammars_sent_uncompiled_compile_in_the_engine_and_a_bad_one_fails_alone(engine: EngineProcess,
                                                                                   model_dir: Path) -> None:
    """The worker sends a request's grammar as its spec alone (DeferredGrammars): the engine compiles
    it off its command thread, and one llguidance refuses ends that request with the GrammarError
    while the others run; a request cancelled while its grammar compiles never runs."""
    prompt, params = _requests(model_dir)["greedy"]
    deferred = DeferredGrammars(engine.shape.vocab_size, params.stop_token_ids)
    bad = deferred.constraint(GrammarSpec.of(REGEX, "[a-"))
    assert bad.grammar is None and bad.spec is not None
    # a schema the worker's checks pass and llguidance refuses with its own error (a 64-bit overflow)
    huge = deferred.constraint(GrammarSpec.of(JSON, {"x-note": {"type": 10 ** 30}}))
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    out = _run(engine, {"bad": (prompt, replace(params, constraint=bad)), "free": (prompt, params),
                        "huge": (prompt, replace(params, constraint=huge)),
                        "json": (prompt, replace(params, max_tokens=40,
                                                 constraint=deferred.constraint(GrammarSpec.of(JSON, schema))))})
    assert out["bad"]["finish"] == FINISH_ERROR and isinstance(out["bad"]["error"], GrammarError)
    assert "regex cannot be used" in str(out["bad"]["error"])
    assert out["huge"]["finish"] == FINISH_ERROR and "json cannot be used" in str(out["huge"]["error"])
    assert out["free"]["finish"] in ("stop", "length") and out["json"]["finish"] == "stop"
    text = ChatTokenizer(model_dir).decode([t for t in out["json"]["tokens"] if t not in params.stop_token_ids])
    jsonschema.validate(json.loads(text), schema)
    fresh = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    engine.submit("gone", prompt, replace(params, constraint=deferred.constraint(GrammarSpec.of(JSON, fresh))))
    engine.cancel("gone")
    assert engine.settle(5) and engine.take(["gone"], 1.0) == {}
    assert engine.settle(5) and engine.gauges.running == 0 and engine.gauges.waiting == 0


def test_a_bad_plan_is_refused_with_the_engine_reason(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="batchSize 8 exceeds servekit.buckets.batch_sizes' largest bucket 4"):
        EngineProcess(EngineSpec(str(model_dir), _plan(), 8))
    with pytest.raises(EngineError, match="the engine failed to start: .*config.json"):
        EngineProcess(EngineSpec(str(tmp_path), _plan(), 4))


def test_a_dead_engine_fails_the_requests_in_flight_and_later_ones(model_dir: Path) -> None:
    deaths: list[float] = []
    engine = EngineProcess(EngineSpec(str(model_dir), _plan(), 4), on_death=lambda: deaths.append(time.monotonic()))
    prompt, _ = _requests(model_dir)["greedy"]
    engine.submit("long", prompt, SamplingParams(max_tokens=120))
    assert engine.take(["long"], 30)["long"].tokens  # running
    os.kill(engine.pid, signal.SIGKILL)
    got = engine.take(["long"], 10)
    while got and got["long"].finish_reason is None:  # tokens sent before it died
        got = engine.take(["long"], 10)
    assert got["long"].finish_reason == FINISH_ERROR and "the engine process ended (exit code -9)" in str(got["long"].error)
    assert len(deaths) == 1
    engine.submit("after", prompt, SamplingParams(max_tokens=4))
    after = engine.take(["after"], 1)["after"]
    assert after.finish_reason == FINISH_ERROR and isinstance(after.error, EngineError)


def stall(batcher, tokenizer) -> None:
    """An engine hook (EngineSpec.hook) that never lets the engine finish building."""
    time.sleep(300)


@pytest.mark.parametrize("when", ["serving", "building"])
def test_the_engine_process_ends_with_its_worker(model_dir: Path, when: str) -> None:
    """A worker killed outright (SIGKILL: no clean-up of its own) leaves no engine process behind,
    whether the engine serves or is still building (a worker TorchServe killed for its startup
    timeout)."""
    import psutil

    hook = "test_engine_process:stall" if when == "building" else None
    code = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = {sys.path!r}
        from servekit.optimizations.llm.engine_process import EngineProcess, EngineSpec
        from test_engine_process import _plan
        engine = EngineProcess(EngineSpec({str(model_dir)!r}, _plan(), 2, hook={hook!r}, sys_path=tuple(sys.path)))
        print("ready", flush=True)
        time.sleep(120)
    """)
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent)
    try:
        if when == "serving":
            assert worker.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        engines: list = []
        while not engines and time.monotonic() < deadline:
            engines = [p for p in psutil.Process(worker.pid).children() if "engine_process" in " ".join(p.cmdline())]
            time.sleep(0.2)
        assert len(engines) == 1
        if when == "building":
            time.sleep(3)  # into the build
            assert engines[0].is_running() and worker.poll() is None  # still waiting for the engine
        worker.kill()
        worker.wait()
        engines[0].wait(20)  # raises psutil.TimeoutExpired if it outlives its worker
    finally:
        worker.kill()


def test_an_engine_whose_worker_died_while_it_started_ends_too(model_dir: Path) -> None:
    """A worker that dies while its engine process is still importing (before the engine could look
    at its parent) leaves no engine behind either: the engine is told its worker's pid instead of
    taking whichever process it then finds as its parent for the worker."""
    import psutil

    code = textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path[:0] = {sys.path!r}
        import psutil
        from servekit.optimizations.llm.engine_process import EngineProcess, EngineSpec
        from test_engine_process import _plan
        spec = EngineSpec({str(model_dir)!r}, _plan(), 2, hook="test_engine_process:stall", sys_path=tuple(sys.path))
        threading.Thread(target=EngineProcess, args=(spec,), daemon=True).start()
        while True:  # gone as soon as the engine process exists, long before it has imported anything
            kids = [p for p in psutil.Process().children() if "engine_process" in " ".join(p.cmdline())]
            if kids:
                print(kids[0].pid, flush=True)
                os._exit(0)
            time.sleep(0.005)
    """)
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent)
    engine = None
    try:
        engine = psutil.Process(int(worker.stdout.readline()))
        worker.wait(30)
        engine.wait(30)  # raises psutil.TimeoutExpired if it outlives its worker
    finally:
        worker.kill()
        if engine is not None and engine.is_running():
            engine.kill()
