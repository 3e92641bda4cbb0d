"""What llguidance's mask costs along a model's own constrained answers, with llguidance's default
slices and with servekit's (``grammar.MASK_SLICES``), and with every ``maxLength`` in the grammar
against the server's way (bounds of strings counted: ``string_bounds``; a mask's time then includes
cutting it to the characters left).

The answers: each schema of the structured benchmark (benchmarks/structured_bench.py) with its
prompts, decoded under the mask by the model itself (greedy and sampled), as the server builds the
grammar. Each answer is then replayed under each slice set, timing every mask on one thread (what
a row's mask costs), and ``--rows`` answers at a time in lockstep on llguidance's pool (what a
decode step of that many grammar rows waits for: its slowest row), once per ``--threads`` count.
Also each schema's compile time. ``--answers FILE`` keeps the recorded answers in FILE and replays
them from there on later runs (recording decodes on the CPU: minutes), so that hosts compare on the
same tokens.

    python -m servekit.benchmarks.grammar_mask_costs ~/.cache/servekit/smollm2-135m-instruct-float32 \\
        --threads 1 2 4 8 --answers /tmp/mask-answers.json --out /tmp/mask-costs.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance
import numpy
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from servekit.benchmarks.grammar_refusals import allowed_tokens
from servekit.benchmarks.structured_bench import PROMPTS, SCHEMAS
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import (JSON, MASK_SLICES, STRING_CHARS, DecodeConstraint, GrammarSpec,
                                                 RowConstraint, llg_tokenizer, row_caps)
from servekit.optimizations.llm.plan import stop_token_ids
from servekit.optimizations.llm.string_bounds import LengthCaps

BOUNDED_IN_GRAMMAR = "every maxLength in the grammar"  # how the server built grammars before string_bounds
SLICE_SETS = {"llguidance's default": llguidance.LLTokenizer.general_slices(), "servekit's": MASK_SLICES}
# --every-length: a slice per string length up to 30 (each slice then holds the tokens of exactly
# that many characters). llguidance takes a slice whole only where the lexer allows all of it, and
# walks every other slice's tokens, those it allows none of included: the question is whether the
# masks near a maxLength, whose long tokens are all refused, get cheaper with it.
EVERY_LENGTH = [MASK_SLICES[0], *(f"{STRING_CHARS}{{1,{n}}}" for n in range(1, 31)), MASK_SLICES[-1]]


def grammar_of(schema: dict, count_bounds: bool = True) -> str:
    """The grammar the server builds for ``schema`` (``count_bounds=False``: with every ``maxLength``)."""
    return GrammarSpec.of(JSON, schema).grammar(count_bounds)


def record(model_dir: Path, tokenizer: llguidance.LLTokenizer, prompts: int, temperatures: list[float],
           max_tokens: int, seed: int) -> list[dict[str, Any]]:
    """The model's constrained answers: one per schema, prompt and temperature, as token ids."""
    hf = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    # transformers renamed past_key_values to cache (5.2x); the GPU machine's 5.17 has the old name.
    kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    out = []
    for temperature in temperatures:
        for p in range(prompts):
            for i, (name, topic, schema) in enumerate(SCHEMAS):
                matcher = llguidance.LLMatcher(tokenizer, grammar_of(schema, count_bounds=False))
                ids = hf.apply_chat_template([{"role": "user", "content": PROMPTS[(i + p) % len(PROMPTS)].format(topic=topic)}],
                                             add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
                past, tokens = None, []
                for _ in range(max_tokens):
                    with torch.no_grad():
                        o = model(input_ids=ids, use_cache=True, **{kv: past})
                    past, logits = getattr(o, kv), o.logits[0, -1].float()
                    if temperature > 0:
                        u = torch.rand(logits.shape, generator=gen).clamp_(1e-10, 1.0)
                        logits = logits / temperature - torch.log(-torch.log(u))
                    token = int(logits.masked_fill(~allowed_tokens(matcher, vocab), float("-inf")).argmax())
                    tokens.append(token)
                    if not matcher.consume_token(token) or matcher.is_stopped():
                        break
                    ids = torch.tensor([[token]])
                out.append({"schema": i, "temperature": temperature, "tokens": tokens})
                print(f"  {name} (prompt {p}, temperature {temperature}): {len(tokens)} tokens", flush=True)
    return out


def load_answers(path: Path) -> list[dict[str, Any]]:
    """Answers an earlier run recorded (``--answers``), checked against the benchmark's schemas."""
    try:
        answers = json.loads(path.read_text())
        ok = isinstance(answers, list) and answers and all(
            isinstance(a, dict) and isinstance(a.get("schema"), int) and 0 <= a["schema"] < len(SCHEMAS)
            and isinstance(a.get("tokens"), list) and a["tokens"] and all(isinstance(t, int) for t in a["tokens"])
            for a in answers)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--answers {path}: cannot be read: {e}") from None
    if not ok:
        raise SystemExit(f"--answers {path}: not a list of recorded answers ({{'schema': int, 'tokens': [int, ...]}})")
    return answers


def _stats_us(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"mean": round(1e6 * statistics.mean(v), 1), "p50": round(1e6 * v[len(v) // 2], 1),
            "p90": round(1e6 * v[int(0.9 * len(v))], 1), "p99": round(1e6 * v[int(0.99 * len(v))], 1),
            "max": round(1e6 * v[-1], 1)}


def _row_of(compiled: tuple[llguidance.LLMatcher, GrammarSpec | None], caps: LengthCaps | None) -> RowConstraint:
    """A replayed answer's row as the engine keeps it: its matcher, and its budget where the server
    counts its strings' bounds (a spec given)."""
    matcher, spec = compiled
    return DecodeConstraint(grammar=matcher, spec=spec, lengths=caps).start()


def _cut(masks: numpy.ndarray, rows: list[RowConstraint]) -> None:
    """Each row's mask (``masks[i]`` for ``rows[i]``) cut by its budget, as the engine cuts it."""
    for i, cap in row_caps(rows):
        masks[i] &= cap


def replay(tokenizer: llguidance.LLTokenizer, answers: list[dict[str, Any]], rows: int,
           threads: list[int], count_bounds: bool = True) -> dict[str, Any]:
    """Per-mask times on one thread, per-step times of ``rows`` rows in lockstep on each count of
    ``threads``, compile times; the masks cut by each row's budget where ``count_bounds``."""
    words = (tokenizer.vocab_size + 31) // 32
    caps = LengthCaps(tokenizer, tokenizer.vocab_size) if count_bounds else None
    compiles, compiled = [], {}
    for i, (_, _, schema) in enumerate(SCHEMAS):
        grammar = grammar_of(schema, count_bounds)
        spec = GrammarSpec.of(JSON, schema) if count_bounds else None  # its bounds: what the budget counts
        t0 = time.perf_counter()
        compiled[i] = (llguidance.LLMatcher(tokenizer, grammar), spec)
        compiles.append(time.perf_counter() - t0)
    one = torch.empty(1, words, dtype=torch.int32)
    per_mask = []
    for a in answers:
        row = _row_of(compiled[a["schema"]], caps)
        for t in a["tokens"]:
            t0 = time.perf_counter()
            row.matcher.unsafe_compute_mask_ptr(one.data_ptr(), words * 4)
            _cut(one.numpy(), [row])
            per_mask.append(time.perf_counter() - t0)
            assert row.accept(t), "an answer the grammar does not take"
    res = {"masks": len(per_mask), "mask_us": _stats_us(per_mask),
           "compile_ms": {"median": round(1e3 * statistics.median(compiles), 2), "max": round(1e3 * max(compiles), 2)}}
    for n in threads:
        steps = lockstep(compiled, answers, rows, llguidance.LLExecutor(n), words, caps)
        res[f"step_of_{rows}_rows_on_{n}_threads_us"] = _stats_us(steps)
    res["steps"] = len(steps)
    return res


def lockstep(compiled: dict[int, tuple[llguidance.LLMatcher, GrammarSpec | None]], answers: list[dict[str, Any]],
             rows: int, executor: llguidance.LLExecutor, words: int, caps: LengthCaps | None) -> list[float]:
    """Each of ``rows`` rows walks the answers one after another; a step fills every row's mask on
    ``executor``'s threads (and cuts those its budget cuts). The steps' times."""
    block = torch.empty(rows, words, dtype=torch.int32)
    masks = block.numpy()
    nxt, lanes = 0, []
    for _ in range(rows):
        a = answers[nxt % len(answers)]
        lanes.append([_row_of(compiled[a["schema"]], caps), a["tokens"], 0])
        nxt += 1
    per_step = []
    for _ in range(sum(len(a["tokens"]) for a in answers) // rows):
        t0 = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(lane[0].matcher, k) for k, lane in enumerate(lanes)], block.data_ptr(),
                                         words * 4, rows)
        _cut(masks, [lane[0] for lane in lanes])
        per_step.append(time.perf_counter() - t0)
        for k, lane in enumerate(lanes):
            assert lane[0].accept(lane[1][lane[2]]), "an answer the grammar does not take"
            lane[2] += 1
            if lane[2] == len(lane[1]):
                a = answers[nxt % len(answers)]
                lanes[k], nxt = [_row_of(compiled[a["schema"]], caps), a["tokens"], 0], nxt + 1
    return per_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path, help="a Hugging Face model folder (SmolLM2: servekit's bundled one)")
    p.add_argument("--prompts", type=int, default=1, help=f"prompts per schema (at most {len(PROMPTS)})")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--max-tokens", type=int, default=150)
    p.add_argument("--rows", type=int, default=32, help="grammar rows per decode step in the lockstep replay")
    p.add_argument("--threads", type=int, nargs="+", default=[max(2, min(8, (os.cpu_count() or 2) // 2))],
                   help="llguidance's pool for the lockstep replay, one replay per count (default: the "
                        "engine's, half the cores, at most 8)")
    p.add_argument("--answers", type=Path,
                   help="the recorded answers: read from here if the file exists, else recorded and written here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every-length", action="store_true",
                   help="also time a slice set with one slice per string length up to 30")
    p.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        p.error(f"{args.model_dir} is not a model folder (no config.json)")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be between 1 and {len(PROMPTS)}")
    # llguidance's view of the vocabulary as the server builds it (its own reading of tokenizer.json
    # where that agrees with servekit's byte table), then with each slice set.
    chat = ChatTokenizer(args.model_dir)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    served, why = llg_tokenizer(chat, vocab, stop_token_ids(args.model_dir, chat))
    print(f"llguidance's tokenizer: {'its own reading of tokenizer.json' if why is None else why}", flush=True)
    tokenizers = {}
    sets = {**SLICE_SETS, **({"every length to 30": EVERY_LENGTH} if args.every_length else {})}
    for name, slices in sets.items():
        t0 = time.perf_counter()
        tokenizers[name] = served.with_slices(slices)
        print(f"{name} slices: set up in {time.perf_counter() - t0:.2f} s", flush=True)
    if any(n < 1 for n in args.threads):
        p.error("--threads must be at least 1")
    if args.answers is not None and args.answers.is_file():
        answers = load_answers(args.answers)
        print(f"{len(answers)} answers read from {args.answers}", flush=True)
    else:
        print("recording the model's answers", flush=True)
        answers = record(args.model_dir, tokenizers["servekit's"], args.prompts, args.temperatures, args.max_tokens,
                         args.seed)
        if args.answers is not None:
            args.answers.write_text(json.dumps(answers) + "\n")
    res: dict[str, Any] = {"model_dir": str(args.model_dir), "answers": len(answers), "rows": args.rows,
                           "threads": args.threads, "cpu_count": os.cpu_count(), "llguidance": llguidance.__version__,
                           "slice_sets": {}}
    runs = [(name, f"{name} slices", tokenizer, True) for name, tokenizer in tokenizers.items()]
    runs.append((f"servekit's, {BOUNDED_IN_GRAMMAR}", f"servekit's slices, {BOUNDED_IN_GRAMMAR}",
                 tokenizers["servekit's"], False))
    for name, label, tokenizer, count_bounds in runs:
        r = replay(tokenizer, answers, args.rows, args.threads, count_bounds)
        res["slice_sets"][name] = r
        print(f"{label}: {r['masks']} masks, us per mask {r['mask_us']}; compile ms {r['compile_ms']}", flush=True)
        for n in args.threads:
            print(f"  {r['steps']} steps of {args.rows} rows on {n} threads, us per step "
                  f"{r[f'step_of_{args.rows}_rows_on_{n}_threads_us']}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
