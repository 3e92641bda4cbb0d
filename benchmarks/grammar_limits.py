"""What a grammar's token masks cost along a walk, against the limit the engine holds grammars to.

A decode step waits for its slowest row's mask, so one request whose grammar has costly masks slows
every request decoding beside it. ``GrammarCompiler`` refuses a grammar whose first mask takes over
``grammar.DEFAULT_MASK_LIMIT_S`` of CPU (or that nothing satisfies), and the engine ends a request
whose masks turn that slow later (``MaskUpload``'s audit). This script shows where the limit
sits: for the structured benchmark's schemas and for grammars built to be costly, each compiled
without the limit, then walked for ``--steps`` tokens (each step's mask timed in CPU time, the
middle allowed token taken), and the verdict of a compiler with the limit.

    python -m servekit.benchmarks.grammar_limits --out benchmarks/results/grammar-limits-cpu
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import llguidance
import torch

from servekit.benchmarks.grammar_refusals import timed_mask
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import (DEFAULT_MASK_LIMIT_S, JSON, REGEX, GrammarCompiler, GrammarError,
                                                GrammarSpec)
from servekit.optimizations.llm.plan import stop_token_ids

# Grammars whose masks cost far more than a schema's: large counted repetitions (exact counts make
# llguidance's lexer build an expression per remaining count), nested ones, ones that start cheap and
# reach such a count later, a JSON pattern (lexed with the schema's start), and one nothing satisfies.
COSTLY: list[tuple[str, str, Any]] = [
    ("regex a{300000}", REGEX, "a{300000}"),
    ("regex ((a{50}){50}){50}", REGEX, "((a{50}){50}){50}"),
    ("regex (abc){10000}", REGEX, "(abc){10000}"),
    ("regex [a-z]{3}a{30000}", REGEX, "[a-z]{3}a{30000}"),
    ("regex [a-z]{3}a{100000}", REGEX, "[a-z]{3}a{100000}"),
    ("schema with pattern ^a{50000}$", JSON,
     {"type": "object", "properties": {"b": {"type": "string", "pattern": "^a{50000}$"}}, "required": ["b"]}),
    ("regex [0-9]{20000}", REGEX, "[0-9]{20000}"),
    ("schema referring only to itself", JSON, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
]


def walk(matcher: llguidance.LLMatcher, vocab: int, steps: int) -> dict[str, Any]:
    """Up to ``steps`` masks along one answer (the middle allowed token each time), in CPU ms."""
    times, error = [], None
    for _ in range(steps):
        mask, us = timed_mask(matcher, vocab, clock=time.thread_time)
        times.append(us / 1e3)
        if matcher.is_error():
            error = matcher.get_error().splitlines()[0]
            break
        allowed = mask.nonzero().flatten().tolist()
        if matcher.is_stopped() or not allowed or not matcher.consume_token(allowed[len(allowed) // 2]):
            if matcher.is_error():  # llguidance gave up while taking the token
                error = matcher.get_error().splitlines()[0]
            break
    return {"masks": len(times), "first_ms": round(times[0], 3), "max_ms": round(max(times), 3),
            "mean_ms": round(statistics.mean(times), 3), "llguidance_error": error}


def measure(compiler: GrammarCompiler, name: str, kind: str, value: Any, steps: int) -> dict[str, Any]:
    """``value``'s grammar built on ``compiler``'s tokenizer without its limits and walked, then
    ``compiler``'s verdict on it."""
    spec = GrammarSpec.of(kind, value)
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(compiler.tokenizer, spec.grammar(), log_level=0)
    row = {"grammar": name, "compile_ms": round(1e3 * (time.perf_counter() - t0), 2),
           **walk(matcher, compiler.vocab_size, steps)}
    try:
        compiler.compile(spec)
        row["verdict"] = "accepted"
    except GrammarError as e:
        row["verdict"] = f"400: {e}"
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.grammar_limits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="a model folder whose tokenizer to use (default: servekit's SmolLM2)")
    p.add_argument("--steps", type=int, default=40, help="masks timed along each grammar's walk")
    p.add_argument("--out", type=Path, help="also write grammar_limits.json and grammar_limits.md here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    model_dir = args.model_dir
    if model_dir is None:
        from servekit.optimizations.models.gguf_weights import smollm2_archive_files
        model_dir = smollm2_archive_files(torch.bfloat16)[0].parent
    if not (model_dir / "config.json").is_file():
        p.error(f"{model_dir} is not a model folder (no config.json)")
    tokenizer = ChatTokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    stops = tuple(stop_token_ids(model_dir, tokenizer))
    compiler = GrammarCompiler(tokenizer, vocab, stops)  # the shipped limits, for the verdicts
    rows = []
    for name, _, schema in SCHEMAS:
        rows.append(measure(compiler, f"benchmark schema {name}", JSON, schema, args.steps))
    schemas = {"grammar": f"the structured benchmark's {len(SCHEMAS)} schemas (worst of each)",
               **{k: max(r[k] for r in rows) for k in ("compile_ms", "first_ms", "max_ms", "mean_ms")},
               "masks": sum(r["masks"] for r in rows),
               "verdict": "all accepted" if all(r["verdict"] == "accepted" for r in rows) else
               "; ".join(f"{r['grammar']}: {r['verdict']}" for r in rows if r["verdict"] != "accepted")}
    table = [schemas]
    print(json.dumps(schemas), flush=True)
    for name, kind, value in COSTLY:
        table.append(measure(compiler, name, kind, value, args.steps))
        print(json.dumps(table[-1]), flush=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "llguidance": llguidance.__version__, "torch": torch.__version__, "model_dir": str(model_dir),
            "steps": args.steps, "mask_limit_ms": DEFAULT_MASK_LIMIT_S * 1e3,
            "command": " ".join(["python -m servekit.benchmarks.grammar_limits", *(sys.argv[1:] if argv is None else argv)])}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar_limits.json").write_text(json.dumps({"meta": meta, "schemas": rows, "table": table},
                                                                 indent=1) + "\n")
        lines = ["| grammar | compile ms | first mask ms | max mask ms | masks | llguidance error | verdict |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['grammar']} | {r['compile_ms']} | {r['first_ms']} | {r['max_ms']} | {r['masks']} | "
                  f"{r.get('llguidance_error') or ''} | {r['verdict']} |" for r in table]
        (args.out / "grammar_limits.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
