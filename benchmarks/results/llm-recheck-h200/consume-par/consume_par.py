"""llguidance's LLExecutor.consume_token_par against consume_token one row after another: 32 rows in
lockstep, each walking SmolLM2's recorded constrained answers (../../mask-fill-threads-h200/answers.json)
one after another, every step each row taking its next token. Prints the mean and median microseconds
a step for each way, and beside them what the 32 rows' compute_ff_bytes took after it, two passes.
Run from the checkout's root with a SmolLM2 model folder (its tokenizer and config):

    python3 benchmarks/results/llm-recheck-h200/consume-par/consume_par.py ~/.cache/servekit/smollm2-135m-instruct-bfloat16
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import llguidance

from servekit.benchmarks.grammar_mask_costs import grammar_of
from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import llg_tokenizer
from servekit.optimizations.llm.plan import stop_token_ids

ROWS = 32
ANSWERS = Path("benchmarks/results/mask-fill-threads-h200/answers.json")

Pairs = list[tuple[llguidance.LLMatcher, int]]


def lockstep(grammars: dict[int, llguidance.LLMatcher], answers: list[dict], consume: Callable[[Pairs], object]
             ) -> tuple[float, float, float]:
    """Mean and median us a step of ``consume`` over the rows' next tokens, and the mean us of the
    rows' ``compute_ff_bytes`` after it."""
    taken = 0

    def start() -> list:
        nonlocal taken
        a = answers[taken % len(answers)]
        taken += 1
        return [grammars[a["schema"]].deep_copy(), a["tokens"], 0]

    rows = [start() for _ in range(ROWS)]
    steps, ff = [], []
    for _ in range(sum(len(a["tokens"]) for a in answers) * 2 // ROWS):
        pairs = [(m, tokens[i]) for m, tokens, i in rows]
        t0 = time.perf_counter()
        consume(pairs)
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for m, _, _ in rows:
            m.compute_ff_bytes()
        ff.append(time.perf_counter() - t0)
        for j, row in enumerate(rows):
            row[2] += 1
            if row[2] >= len(row[1]):
                rows[j] = start()
    return statistics.mean(steps) * 1e6, statistics.median(steps) * 1e6, statistics.mean(ff) * 1e6


def one_by_one(pairs: Pairs) -> None:
    for m, token in pairs:
        m.consume_token(token)


def main(model_dir: Path) -> None:
    answers = json.loads(ANSWERS.read_text())
    chat = ChatTokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer, why = llg_tokenizer(chat, vocab, stop_token_ids(model_dir, chat))
    print("native" if why is None else why)  # llguidance reads tokenizer.json itself
    grammars = {i: llguidance.LLMatcher(tokenizer, grammar_of(schema)) for i, (_, _, schema) in enumerate(SCHEMAS)}
    for _ in range(2):
        print("serial consume: mean/p50 us per step %.1f / %.1f; ff_bytes serial mean %.1f"
              % lockstep(grammars, answers, one_by_one))
        for threads in (2, 4, 8):
            pool = llguidance.LLExecutor(threads)
            print(f"consume_token_par {threads} threads: mean/p50 us per step %.1f / %.1f; ff %.1f"
                  % lockstep(grammars, answers, pool.consume_token_par))


if __name__ == "__main__":
    main(Path(sys.argv[1]).expanduser())
