"""Compare the grammar engines servekit could use (xgrammar, llguidance) on a model's own
tokenizer: which of a set of JSON schemas each compiles, first compile time, and the per-token
cost of filling the next-token bitmask while the matcher is driven through a valid document.

    python -m servekit.benchmarks.grammar_engine_bench ~/.cache/servekit/smollm2-135m-instruct-bfloat16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

from transformers import AutoTokenizer

# (schema, a document that validates against it): the walk feeds the document's tokens.
CASES: list[tuple[dict[str, Any], Any]] = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
      "maximum": 150}}, "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
      "maxItems": 3}}, "required": ["tags"]}, {"tags": ["a", "bb"]}),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
     {"color": "green"}),
    ({"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
     {"zip": "12345"}),
    ({"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"},
      "y": {"type": "number"}}, "required": ["x", "y"]}, "label": {"type": "string"}}, "required": ["point"]},
     {"point": {"x": 1.5, "y": -2}, "label": "origin-ish"}),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
     {"when": "2024-05-01"}),
    ({"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
      "required": ["v"]}, {"v": "x"}),
    ({"type": "object", "properties": {"n": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5}},
      "required": ["n"]}, {"n": 2.5}),
]


def xgrammar_engine(hf: Any) -> tuple[Callable, Callable]:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_(schema: dict) -> Any:
        return compiler.compile_json_schema(json.dumps(schema))

    def walk(compiled: Any, ids: list[int]) -> list[float]:
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t), t
        return times
    return compile_, walk


def llguidance_engine(hf: Any) -> tuple[Callable, Callable]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))

    def compile_(schema: dict) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        err = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if err:
            raise ValueError(err)
        return grammar

    def walk(grammar: Any, ids: list[int]) -> list[float]:
        m = llguidance.LLMatcher(tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        mask = lt.allocate_token_bitmask(1, tok.vocab_size)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), (t, m.get_error())
        return times
    return compile_, walk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    args = ap.parse_args()
    hf = AutoTokenizer.from_pretrained(args.model_dir)
    for name, make in (("xgrammar", xgrammar_engine), ("llguidance", llguidance_engine)):
        compile_, walk = make(hf)
        ok, compile_ms, mask_us = 0, [], []
        for schema, doc in CASES:
            try:
                t0 = time.perf_counter()
                compiled = compile_(schema)
                compile_ms.append((time.perf_counter() - t0) * 1e3)
                mask_us += [t * 1e6 for t in walk(compiled, hf.encode(json.dumps(doc), add_special_tokens=False))]
                ok += 1
            except Exception as e:  # an unsupported keyword: the coverage figure counts it
                print(f"  {name}: {json.dumps(schema)[:60]}... failed: {type(e).__name__}: {str(e)[:80]}")
        print(f"{name}: {ok}/{len(CASES)} schemas; compile median {statistics.median(compile_ms):.1f} ms "
              f"(max {max(compile_ms):.1f}); mask fill median {statistics.median(mask_us):.0f} us, "
              f"p99 {sorted(mask_us)[int(len(mask_us) * 0.99)]:.0f} us over {len(mask_us)} tokens")


if __name__ == "__main__":
    main()
