"""Offline generation: a list of token-id prompts run to completion through the continuous engine
(continuous.py), the one way this package generates text. For what is not served: training data
for speculator heads, parity checks against reference implementations, benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from servekit.optimizations.llm.continuous import FINISH_ERROR, ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams, TokenLogprob


@dataclass
class Completion:
    tokens: list[int]  # every sampled token, a final stop token included
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for


def generate(runner: LlamaRunner, prompts: list[list[int]], params: list[SamplingParams],
             speculate: list[bool] | None = None, batcher: ContinuousBatcher | None = None) -> list[Completion]:
    """Generate every prompt to its end (stop token or ``max_tokens``), as many at a time as the
    engine runs. ``speculate[i] = False`` keeps prompt i from accepting drafts (where the runner
    has a ``speculation``); ``batcher``: the engine to run on (default: a new one over ``runner``,
    warmed up where it captures graphs; its ``spec_stats`` count the drafts). ``ValueError`` naming the prompt before any work if one
    cannot run; ``RuntimeError`` if the engine fails one."""
    if len(prompts) != len(params) or (speculate is not None and len(speculate) != len(prompts)):
        raise ValueError(f"need one SamplingParams (and speculate flag) per prompt, got {len(prompts)} prompts, "
                         f"{len(params)} params" + (f", {len(speculate)} flags" if speculate is not None else ""))
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        if (err := runner.check(prompt, sp)) is not None:
            raise ValueError(f"request {i}: {err}")
    engine = batcher
    if engine is None:
        engine = ContinuousBatcher(runner)
        if engine.packed.graphs:  # captured prefill: built before its first use (callers that
            engine.warmup()       # generate often pass one warmed-up batcher instead)
    out = [Completion([], "") for _ in prompts]
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add(i, prompt, sp, True if speculate is None else speculate[i])
    while engine.has_work:
        for i, u in engine.step().items():
            if u.finish_reason == FINISH_ERROR:
                raise RuntimeError(f"request {i} failed: {u.error}") from u.error
            out[i].tokens += u.tokens
            out[i].logprobs += u.logprobs
            if u.finish_reason is not None:
                out[i].finish_reason = u.finish_reason
    return out
