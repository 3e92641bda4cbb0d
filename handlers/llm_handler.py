"""TorchServe handler: OpenAI-compatible chat and text completions for a Llama-architecture LLM.

One engine path: requests run through the continuous engine (servekit.optimizations.llm.continuous)
in a process of its own that this worker starts (servekit.optimizations.llm.engine_process: the
model lives there, the worker parses and answers), driven by handlers/llm_continuous.py under
TorchServe's continuous batching, which the model-config must turn on (``continuousBatching:
true``; anything else is refused at load). The OpenAI request and response code is
handlers/llm_openai.py: each row stops on its own (stop token, stop string, max_tokens), a
streaming request gets its chunks as its tokens come, and one bad request gets its own 4xx JSON
error while the others are answered.

TorchServe calls the module-level `handle` (a function entry point: this module's state is one
object, `_service`, made at import).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from servekit import __version__
from servekit.handlers.common import CONTINUOUS_ONE_WORKER, registered_batch_size
from servekit.handlers.llm_continuous import ContinuousFrontend
from servekit.handlers.llm_openai import OpenAIApi
from servekit.handlers.metrics import HandlerMetrics
from servekit.handlers.worker_io import install_buffered_reads
from servekit.optimizations.heap import freeze_heap
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.engine_process import EngineProcess, EngineSpec
from servekit.optimizations.llm.grammar import DeferredGrammars
from servekit.optimizations.llm.plan import parse_llm_plan, stop_token_ids
from servekit.optimizations.plan import PlanError

log = logging.getLogger(__name__)
WARM_UP_TEXT = "Summarise this passage of a long document in one short sentence, please. "  # ~13 tokens


def check_continuous_batching(config: dict[str, Any]) -> None:
    """The LLM is served by continuous batching only: a model-config without
    ``continuousBatching: true`` would have TorchServe hand each batch over once and wait for whole
    answers, which this handler does not give; and by one worker (``CONTINUOUS_ONE_WORKER``).
    Refused with the fix, before any weight is loaded."""
    if config.get("continuousBatching") is not True:
        raise PlanError(f"continuousBatching: {config.get('continuousBatching')!r}; the LLM handler serves through "
                        "continuous batching only: set `continuousBatching: true` in the model-config")
    many = [f"{key}: {config[key]!r}" for key in ("minWorkers", "maxWorkers")
            if config.get(key) is not None and not (isinstance(config[key], int) and config[key] <= 1)]
    if many:
        raise PlanError(f"{', '.join(many)}; {CONTINUOUS_ONE_WORKER}: set minWorkers and maxWorkers to 1")


class LlmService:
    """State of one worker: its engine (in a process of its own), plan, metrics and the
    continuous-batching frontend."""

    # "module:function" the engine process calls with its batcher before serving (fault injection in tests).
    engine_hook: str | None = None

    def __init__(self) -> None:
        self.initialized = False

    def initialize(self, context: Any) -> None:
        props = context.system_properties
        model_dir = props["model_dir"]
        model_name = context.model_name  # the registered name: the one clients use in URLs
        config = context.model_yaml_config or {}
        check_continuous_batching(config)
        plan = parse_llm_plan(config.get("servekit"))
        gpu_id = props.get("gpu_id")
        t0 = time.perf_counter()
        # Requests running at once (the engine's max_num_seqs): the batch size TorchServe registered.
        self.batch_size = registered_batch_size(context)
        self.engine = EngineProcess(EngineSpec(model_dir, plan, self.batch_size,
                                               int(gpu_id) if gpu_id is not None else None,
                                               self.engine_hook, tuple(sys.path)))
        self.plan, shape = self.engine.ready.plan, self.engine.shape
        tokenizer = ChatTokenizer(model_dir)
        stop_ids = stop_token_ids(model_dir, tokenizer)
        grammar = DeferredGrammars(shape.vocab_size, tuple(stop_ids))  # compiled by the engine process
        self.metrics = HandlerMetrics(context, model_name)
        self.metrics.emit("servekit_plan_info", "gauge", 1, Plan=self.plan.label())
        # OpenAI's system_fingerprint names the backend configuration: servekit's version and plan.
        self.api = OpenAIApi(shape, self.plan.limits, tokenizer, stop_ids, grammar, model_name,
                             f"servekit-{__version__}-{self.plan.label()}")
        self.frontend = ContinuousFrontend(self.engine, self.api, self.metrics)
        warm = self.api.warm_up()
        # A prompt of a realistic length (~500 tokens) through the engine, as a chat is tokenized.
        try:
            warm_prompt = tokenizer.encode_chat([{"role": "user", "content": WARM_UP_TEXT * 40}])
        except Exception as e:  # a template's own rule: its text instead, warming up never stops a worker
            log.warning("engine warm-up uses plain text, the chat template refused a user message: %s", e)
            warm_prompt = tokenizer.encode(WARM_UP_TEXT * 40)
        engine_warm = self.frontend.warm_up(warm_prompt)
        install_buffered_reads()
        log.info("servekit LLM plan %s ready in %.1f s (engine process %d built in %.1f s with gc_frozen_objects %d, "
                 "request path warmed in %.1f ms, engine in %.1f ms, gc_frozen_objects %d): %s", self.plan.label(),
                 time.perf_counter() - t0, self.engine.pid, self.engine.ready.seconds, self.engine.ready.frozen_objects,
                 warm * 1e3, engine_warm * 1e3, freeze_heap(), json.dumps(self.engine.ready.runner_plan))
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[str]:
        # A call emits a metric line or more per request in it (TTFT, ITL, token counts): one write
        # of them all when it returns, not a write and flush of the worker's stdout per line.
        self.metrics.begin_batch()
        try:
            return self.frontend.handle(data, context)
        finally:
            self.metrics.flush()


_service = LlmService()


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[str] | None:
    """TorchServe's entry point: called once with data=None to initialize, then once per batch."""
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
