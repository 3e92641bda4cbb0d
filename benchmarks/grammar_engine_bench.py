"""Compare the grammar engines servekit could use (llguidance, xgrammar) on a model's own
tokenizer: which JSON schemas each compiles, the time to build a schema's grammar (what its first
request waits for), and the per-token cost of filling the next-token bitmask while the matcher is
driven through a valid document (what every step of every constrained row pays).

The schemas: the structured benchmark's 24 (benchmarks/structured_bench.py: nested objects, arrays
with min/max items, enums, bounds, patterns, length-bounded strings) and 8 more with keywords those
leave out (formats, ``multipleOf``, unbounded strings). Each one's document is a random walk under
llguidance's mask (seeded; the stop token taken as soon as it is allowed), fed to both engines.

    python -m servekit.benchmarks.grammar_engine_bench ~/.cache/servekit/smollm2-135m-instruct-bfloat16

Needs xgrammar (the ``bench`` extra installs it).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Callable

from transformers import AutoTokenizer

from servekit.benchmarks.structured_bench import SCHEMAS
from servekit.optimizations.llm.grammar import JSON_FORMAT

EXTRA: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
     "maximum": 150}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
     "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"},
     "y": {"type": "number"}}, "required": ["x", "y"]}, "label": {"type": "string"}}, "required": ["point"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5}},
     "required": ["n"]},
]
MAX_DOC_TOKENS = 300


def _bits(mask: Any, vocab: int) -> list[int]:
    row = mask[0].tolist()
    return [t for t in range(vocab) if (row[t // 32] >> (t % 32)) & 1]


def llguidance_engine(hf: Any) -> tuple[Callable, Callable, Callable]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))

    def compile_(schema: dict) -> Any:
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT))
        if m.is_error():
            raise ValueError(m.get_error().splitlines()[0])
        return m

    def walk(compiled: Any, ids: list[int]) -> tuple[list[float], bool]:
        m, mask, times = compiled.deep_copy(), lt.allocate_token_bitmask(1, len(hf)), []
        for t in ids:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            if not m.consume_token(t):
                return times, False
        return times, True

    def document(compiled: Any, rng: random.Random) -> list[int]:
        m, mask, ids = compiled.deep_copy(), lt.allocate_token_bitmask(1, len(hf)), []
        while len(ids) < MAX_DOC_TOKENS:
            lt.fill_next_token_bitmask(m, mask, 0)
            allowed = _bits(mask, len(hf))
            if hf.eos_token_id in allowed:
                break
            ids.append(rng.choice(allowed))
            m.consume_token(ids[-1])
        return ids
    return compile_, walk, document


def xgrammar_engine(hf: Any) -> tuple[Callable, Callable, None]:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_(schema: dict) -> Any:
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def walk(compiled: Any, ids: list[int]) -> tuple[list[float], bool]:
        m, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size), []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                return times, False
        return times, True
    return compile_, walk, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hf = AutoTokenizer.from_pretrained(args.model_dir)
    schemas = [s for _, _, s in SCHEMAS] + EXTRA
    engines = {"llguidance": llguidance_engine(hf), "xgrammar": xgrammar_engine(hf)}
    # The documents: walks under llguidance's masks (every token allowed where it was taken).
    lg_compile, _, document = engines["llguidance"]
    rng = random.Random(args.seed)
    docs = [document(lg_compile(s), rng) for s in schemas]
    for name, (compile_, walk, _) in engines.items():
        ok, compile_ms, mask_us, rejected = 0, [], [], 0
        for schema, ids in zip(schemas, docs):
            try:
                t0 = time.perf_counter()
                compiled = compile_(schema)
                compile_ms.append((time.perf_counter() - t0) * 1e3)
            except Exception as e:  # an unsupported keyword: the coverage figure counts it
                print(f"  {name}: {json.dumps(schema)[:60]}... failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            ok += 1
            times, accepted = walk(compiled, ids)
            mask_us += [t * 1e6 for t in times]
            rejected += not accepted
        mask_us.sort()
        print(f"{name}: {ok}/{len(schemas)} schemas compiled; grammar built in median "
              f"{statistics.median(compile_ms):.1f} ms (max {max(compile_ms):.1f}); mask fill per token mean "
              f"{statistics.fmean(mask_us):.0f} us, median {statistics.median(mask_us):.0f}, p99 "
              f"{mask_us[int(len(mask_us) * 0.99)]:.0f}, max {mask_us[-1]:.0f} over {len(mask_us)} tokens; "
              f"{rejected} documents rejected part-way")


if __name__ == "__main__":
    main()
