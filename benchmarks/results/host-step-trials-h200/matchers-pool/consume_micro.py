"""Taking one token per matcher for 2-32 rows: one ``consume_token`` after another on this thread,
or one ``consume_token_par`` call on the engine's llguidance pool (``grammar._executor()``: 8
threads on a 16-core host; 2 where the engine keeps none).
The rows replay SmolLM2's answers to the structured benchmark's schemas
(``../../mask-fill-threads-h200/answers.json``) in lockstep; µs per step, best of 3. From the
checkout's root, after ``source benchmarks/gpu_env.sh`` and one engine run (the model's converted
folder in ~/.cache/servekit):

    python3 benchmarks/results/host-step-trials-h200/matchers-pool/consume_micro.py
"""
import json
import time
from pathlib import Path

import llguidance

from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm import grammar
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.plan import stop_token_ids

folder = sorted(Path.home().glob(".cache/servekit/smollm2-135m-instruct-*"))[0]
tokenizer = ChatTokenizer(folder)
compiler = grammar.GrammarCompiler(tokenizer, 49152, tuple(stop_token_ids(folder, tokenizer)))
answers = json.loads(Path("benchmarks/results/mask-fill-threads-h200/answers.json").read_text())
starts = [compiler.constraint(grammar.GrammarSpec.of(grammar.JSON, SCHEMAS[a["schema"]][2])) for a in answers]
pool = grammar._executor() or llguidance.LLExecutor(2)  # the engine's pool; 2 threads where it keeps none
print("threads executor", pool)
for n in (2, 4, 8, 16, 32):
    best: dict[str, list[float]] = {}
    for way in ("serial", "par") * 3:
        matchers, tokens = [c.grammar.deep_copy() for c in starts[:n]], [a["tokens"] for a in answers[:n]]
        spent, steps = 0.0, 0
        for step in range(min(map(len, tokens))):
            pairs = [(m, t[step]) for m, t in zip(matchers, tokens)]
            t0 = time.perf_counter()
            if way == "serial":
                for m, tok in pairs:
                    m.consume_token(tok)
            else:
                pool.consume_token_par(pairs)
            spent += time.perf_counter() - t0
            steps += 1
        best.setdefault(way, []).append(spent / steps * 1e6)
    print(n, {k: round(min(v), 1) for k, v in best.items()}, "us per step")
