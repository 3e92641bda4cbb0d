"""Where a constrained decode step's time goes: the continuous engine in-process (no TorchServe),
the same requests free, each under a JSON schema of the structured benchmark, and free again at
the constrained answers' lengths; host time per engine step in each of the engine's phases
(reading tokens, filling and loading the grammar masks, launching the halves of a split step),
tokens/s, tokens per step and TTFT. Each phase's time leaves out the phases it calls (the prefill
reads the tokens sampled before it: that counts as "read tokens" only), so the engine thread's
phases add up; the masks' fill is timed on its own ("of which: fill masks", outside "load masks").

The schemas' answers are shorter than free ones (about 50 tokens against 100+ at 128 at most), so
rows sit empty after a short answer ends and the plain comparison weighs per-request costs twice.
"free, matched lengths" gives each request exactly as many tokens as its constrained answer had
(``max_tokens`` set to it, stop tokens off): the same rows busy for the same steps, so tokens/s
and ms per step compare the steps alone (``comparison()``).

All requests start together by default, so no prompt arrives while rows decode. ``--closed-loop
N`` serves N requests with ``--requests`` of them running at a time, each finished one replaced
by the next, as the served benchmark's streams do: constrained answers are short, so a new prompt
then comes every step or two and rides with the decoding rows (``forwards per step`` counts the
packed forwards and the decode forwards launched).

    python3 -m servekit.benchmarks.structured_engine_profile --requests 32 16   # GPU, shipped smollm2.yaml
    python -m servekit.benchmarks.structured_engine_profile --config config/models/smollm2-cpu.yaml \\
        --requests 2 --max-tokens 16 --repeats 1                               # CPU smoke run
    python3 -m servekit.benchmarks.structured_engine_profile --requests 32 --closed-loop 256

Each process first times a fixed grammar walk on its own thread (``host_walk``: every schema's
grammar stepped along one path, a mask filled, a token taken and the forced tokens asked for at each
step, as a constrained row's host work goes): the same code's host phases moved 10-30% between
processes on one H200 machine (benchmarks/results/start-run-h200/), and the walk's time says how
fast the host ran this process, so that runs of two codes in different processes can be weighed.

``--fine-phases`` also times the parts of those phases (the packed forward's host tables, the
mixed decode, new rows, uploads, the matchers taking their tokens); each wrapped call costs a few
microseconds of its own. ``--mask-threads`` repeats the constrained runs with llguidance's mask
fill on that many threads (0 or 1: one row after another on the engine's thread) instead of the
engine's choice;
``--without-max-length`` serves every schema with its ``maxLength`` keywords removed: a mask a few
characters short of a ``maxLength`` is llguidance's slowest (``grammar_mask_costs``), so this says
what those masks cost the step;
``--no-forced-runs`` repeats them with each token a grammar forces decoded in a step of its own
(``ContinuousBatcher(jump_forced=False)``). ``--model-dir`` profiles another converted checkpoint
under the same plan, e.g. a Llama-3.1-8B-shaped one from ``shaped_models`` (random weights: a
grammar still decides what they write, and the steps cost what the real model's do):

    python3 -m servekit.benchmarks.shaped_models --out /opt/shaped --models llama-3.1-8b
    python3 -m servekit.benchmarks.structured_engine_profile --model-dir /opt/shaped/llama-3.1-8b \
        --requests 32 --closed-loop 256 --no-forced-runs
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from servekit.benchmarks.grammar_refusals import allowed_tokens
from servekit.benchmarks.llm_inprocess import plan_runner
from servekit.benchmarks.llm_workload_bench import PhaseTimer
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm import grammar
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.plan import LlmPlan, stop_token_ids
from servekit.resources import model_config

PHASES = {"_read_all": "read tokens", "_load_bias": "load masks", "_sample": "launch sampling",
          "_launch": "launch step/forward", "_prefill": "prefill", "_admit": "admit",
          "_forced_runs": "forced runs", "_compact": "compact"}
# --fine-phases: parts of the phases above, each left out of the phase that calls it.
FINE_PHASES = {"_decode_from": "  mixed decode", "_start_rows": "  new rows", "_sampling": "  new rows' sampling",
               "_read": "  read rows", "_host": "  output copies"}
FREE, JSON, MATCHED = "free", "JSON schema", "free, matched lengths"
FORWARDS, DECODE_FORWARDS = "packed forwards", "decode forwards"  # counted in PhaseTimer.calls, not timed


def run_once(engine: ContinuousBatcher, timer: PhaseTimer, prompts: list[list[int]],
             params: list[SamplingParams], key: Any, at_once: int | None = None) -> dict[str, Any]:
    """The requests stepped until done, all added at once or ``at_once`` of them running at a time
    (each finished one replaced by the next): tokens/s, ms, tokens and forwards per step, TTFT from
    each request's add, each request's answer length and host ms per step in each phase."""
    timer.seconds.clear()
    timer.calls.clear()
    at_once = at_once or len(prompts)
    lengths, ttft, added = [0] * len(prompts), [0.0] * len(prompts), [0.0] * len(prompts)
    t0 = time.perf_counter()
    queued = 0

    def add_next() -> None:
        nonlocal queued
        engine.add((key, queued), prompts[queued], params[queued])
        added[queued] = time.perf_counter() - t0
        queued += 1

    while queued < min(at_once, len(prompts)):
        add_next()
    steps = 0
    while engine.has_work:
        updates = engine.step()
        now = time.perf_counter() - t0
        steps += 1
        for (_, i), u in updates.items():
            if u.tokens and not lengths[i]:
                ttft[i] = now - added[i]
            lengths[i] += len(u.tokens)
            if u.finish_reason is not None and queued < len(prompts):
                add_next()
    wall = time.perf_counter() - t0
    tokens = sum(lengths)
    forwards = timer.calls[FORWARDS] + timer.calls[DECODE_FORWARDS]
    return {"steps": steps, "tokens": tokens, "tok_per_s": tokens / wall, "ms_per_step": wall / steps * 1e3,
            "tokens_per_step": tokens / steps, "mean_length": tokens / len(lengths), "lengths": lengths,
            "forwards_per_step": forwards / steps,
            "ttft_ms_p50": statistics.median(ttft) * 1e3, "ttft_ms_max": max(ttft) * 1e3,
            "host_ms_per_step": {k: v / steps * 1e3 for k, v in sorted(timer.seconds.items())}}


def count_forwards(engine: ContinuousBatcher, timer: PhaseTimer) -> None:
    """Count in ``timer.calls`` the packed forwards the engine runs and the decode forwards it
    launches (a whole decode step or a split step's forward half)."""
    run, launch = engine.packed.run, engine._launch

    def packed(*args: Any, **kwargs: Any) -> Any:
        timer.calls[FORWARDS] += 1
        return run(*args, **kwargs)

    def launched(*args: Any, **kwargs: Any) -> Any:
        out = launch(*args, **kwargs)
        timer.calls[DECODE_FORWARDS] += out is not None
        return out

    engine.packed.run, engine._launch = packed, launched


def fine_phases(engine: ContinuousBatcher, timer: PhaseTimer) -> None:
    """Time the parts of the engine thread's phases too (``--fine-phases``)."""
    from servekit.optimizations.llm import continuous

    for name, label in FINE_PHASES.items():
        timer.instrument(engine, name, label)
    timer.instrument(engine.packed, "_load", "  packed tables")
    timer.instrument(continuous, "upload", "  uploads")
    timer.instrument(grammar.RowConstraint, "accept", "  accept tokens")


def matched(params: list[SamplingParams], lengths: list[int]) -> list[SamplingParams]:
    """Free requests of exactly the constrained answers' lengths: each request's ``max_tokens`` set
    to its constrained answer's length and its stop tokens off, without its constraint."""
    return [SamplingParams(max_tokens=max(1, n), temperature=p.temperature, seed=p.seed, stop_token_ids=())
            for p, n in zip(params, lengths)]


def comparison(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Constrained tokens/s as a share of free tokens/s, plain and at matched lengths (best run of
    each), and the ms per step of each."""
    best = {k: max(v, key=lambda r: r["tok_per_s"]) for k, v in runs.items() if v}
    out: dict[str, float] = {f"ms_per_step {k}": round(r["ms_per_step"], 3) for k, r in best.items()}
    if JSON in best:
        for k in (FREE, MATCHED):
            if k in best:
                out[f"JSON / {k}"] = round(best[JSON]["tok_per_s"] / best[k]["tok_per_s"], 3)
    return out


def line(name: str, rep: int, r: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.3f}" for k, v in r["host_ms_per_step"].items())
    return (f"{name} (run {rep + 1}): {r['steps']} steps, {r['tokens']} tokens (mean {r['mean_length']:.1f} per "
            f"answer), {r['tok_per_s']:.0f} tokens/s, {r['ms_per_step']:.2f} ms per step, "
            f"{r['tokens_per_step']:.1f} tokens per step, {r['forwards_per_step']:.2f} forwards per step, "
            f"TTFT p50 {r['ttft_ms_p50']:.1f} ms (max {r['ttft_ms_max']:.1f}); host ms per step: {phases}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=model_config("smollm2"), help="LLM model-config")
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 16],
                    help="requests at once (one per schema, in order); one profile per value")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--closed-loop", type=int, default=0, metavar="N",
                    help="serve N requests in all, --requests of them at a time (a finished one replaced by the "
                         "next) instead of all at once")
    ap.add_argument("--mask-threads", type=int, nargs="*", default=[],
                    help="also run the constrained requests with the masks filled on this many threads")
    ap.add_argument("--no-forced-runs", action="store_true",
                    help="also run the constrained requests with each forced token decoded in a step of its own")
    ap.add_argument("--model-dir", type=Path, help="a converted checkpoint to serve instead of SmolLM2")
    ap.add_argument("--fine-phases", action="store_true", help="also time the parts of the engine thread's phases")
    ap.add_argument("--without-max-length", action="store_true",
                    help="the schemas with every maxLength removed (what the masks near a maxLength cost)")
    args = ap.parse_args()
    if args.closed_loop and args.closed_loop < max(args.requests):
        ap.error(f"--closed-loop {args.closed_loop} is fewer requests than --requests {max(args.requests)} at a time")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        ap.error(f"--model-dir {args.model_dir} is not a model folder (no config.json)")
    runner, plan, tokenizer, stops, compiler = load_model(args.config, args.model_dir)
    walks = [host_walk(compiler, [schema for _, _, schema in SCHEMAS]) for _ in range(5)]
    print(f"host: a fixed walk of {walks[0][0]} grammar steps took "
          f"{statistics.median(t for _, t in walks) * 1e3:.2f} ms (median of 5)", flush=True)
    engine = ContinuousBatcher(runner, min(32, runner.max_batch))
    engine.warmup()
    timer = PhaseTimer(exclusive=True)
    for name, label in PHASES.items():
        timer.instrument(engine, name, label)
    timer.instrument(grammar, "fill_masks", "  of which: fill masks")
    if args.fine_phases:
        fine_phases(engine, timer)
    count_forwards(engine, timer)
    engine_executor = grammar._executor
    for n in args.requests:
        if n > engine.max_num_seqs:
            raise SystemExit(f"--requests {n}: the plan runs at most {engine.max_num_seqs} requests at once "
                             f"(its largest batch bucket)")
        total = max(args.closed_loop, n)
        shape = f"{total} requests, {n} at a time" if args.closed_loop else f"{n} requests"
        print(f"{plan.label()}, {shape}, of at most {args.max_tokens} tokens, temperature 0.8", flush=True)
        prompts, free, constrained = schema_requests(tokenizer, compiler, stops, total, args.max_tokens,
                                                     args.without_max_length)
        runs: dict[str, list[dict[str, Any]]] = {FREE: [], JSON: [], MATCHED: []}
        for name, params in ((FREE, free), (JSON, constrained)):
            for rep in range(args.repeats):
                runs[name].append(run_once(engine, timer, prompts, params, (name, rep), n))
                print(line(name, rep, runs[name][-1]), flush=True)
        # Sampled with a seed each, the constrained answers have the same lengths every run.
        same = matched(free, runs[JSON][0]["lengths"])
        for rep in range(args.repeats):
            runs[MATCHED].append(run_once(engine, timer, prompts, same, (MATCHED, rep), n))
            print(line(MATCHED, rep, runs[MATCHED][-1]), flush=True)
        print(f"comparison at {n} rows: {comparison(runs)}", flush=True)
        if args.no_forced_runs:
            engine.jump_forced = False
            off = []
            for rep in range(args.repeats):
                off.append(run_once(engine, timer, prompts, constrained, ("no runs", rep), n))
                print(line(f"{JSON}, forced runs off", rep, off[-1]), flush=True)
            engine.jump_forced = True
            best = max(r["tok_per_s"] for r in off)
            print(f"forced runs at {n} rows: JSON tokens/s with / without "
                  f"{max(r['tok_per_s'] for r in runs[JSON]) / best:.3f}", flush=True)
        for threads in args.mask_threads:
            executor = grammar.llguidance.LLExecutor(threads) if threads > 1 else None
            grammar._executor = functools.cache(lambda e=executor: e)
            for rep in range(args.repeats):
                r = run_once(engine, timer, prompts, constrained, ("threads", threads, rep), n)
                print(line(f"{JSON}, masks on {threads} threads", rep, r), flush=True)
            grammar._executor = engine_executor


def load_model(config: Path, model_dir: Path | None = None) -> tuple[LlamaRunner, LlmPlan, ChatTokenizer,
                                                                    tuple[int, ...], grammar.GrammarCompiler]:
    """SmolLM2 (or the checkpoint in ``model_dir``) under the model-config ``config`` as the worker
    loads it: its runner, plan, tokenizer, stop tokens and grammar compiler."""
    runner, plan, model_dir = plan_runner(yaml.safe_load(config.read_text())["servekit"], model_dir)
    tokenizer = ChatTokenizer(model_dir)
    stops = tuple(stop_token_ids(model_dir, tokenizer))
    return runner, plan, tokenizer, stops, grammar.GrammarCompiler(tokenizer, runner.model.config.vocab_size, stops)


def schema_requests(tokenizer: ChatTokenizer, compiler: grammar.GrammarCompiler, stops: tuple[int, ...], total: int,
                    max_tokens: int = 128, strip_max_length: bool = False
                    ) -> tuple[list[list[int]], list[SamplingParams], list[SamplingParams]]:
    """The profile's ``total`` requests, the structured benchmark's schemas in turn (``Describe
    <topic> as JSON.``, temperature 0.8, seed i): their prompts, free sampling parameters and the
    same under each schema (``strip_max_length``: its ``maxLength`` keywords removed)."""
    prompts, free, constrained = [], [], []
    for i in range(total):
        _, topic, schema = SCHEMAS[i % len(SCHEMAS)]
        schema = without_max_length(schema) if strip_max_length else schema
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": f"Describe {topic} as JSON."}]))
        free.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, stop_token_ids=stops))
        constrained.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, stop_token_ids=stops,
                                          constraint=compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, schema))))
    return prompts, free, constrained


def host_walk(compiler: grammar.GrammarCompiler, schemas: list[dict], steps: int = 60) -> tuple[int, float]:
    """The host's speed at a constrained row's work: each schema's grammar walked from its start
    for up to ``steps`` tokens, each step a mask filled (one row, this thread), a token it allows
    taken (a fixed pick, the same path every time) and the forced tokens asked for. Returns the
    steps walked and the seconds it took."""
    matchers = [compiler.compile(grammar.GrammarSpec.of(grammar.JSON, schema)) for schema in schemas]
    walked, t0 = 0, time.perf_counter()
    for start in matchers:
        m = start.deep_copy()
        for step in range(steps):
            allowed = torch.nonzero(allowed_tokens(m, compiler.vocab_size)).flatten()
            token = int(allowed[(step * 7919) % len(allowed)])
            if not m.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
            m.compute_ff_tokens()
            walked += 1
            if m.is_stopped() or m.is_error():
                break
    return walked, time.perf_counter() - t0


def without_max_length(schema: Any) -> Any:
    """``schema`` with every ``maxLength`` keyword removed, at any depth."""
    if isinstance(schema, dict):
        return {k: without_max_length(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [without_max_length(v) for v in schema]
    return schema


if __name__ == "__main__":
    main()
