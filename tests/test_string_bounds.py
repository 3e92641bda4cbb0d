"""Bounded JSON strings kept by counting (optimizations/llm/string_bounds.py): which ``maxLength``s
the grammar leaves out, and that the relaxed grammar's masks cut by each row's ``StringBudget``
allow what the grammar with the bounds allows, along answers walked token by token with
SmolLM2's real vocabulary (long tokens, escapes and non-ASCII text preferred, to reach the bounds)."""
from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import numpy
import pytest
import torch

from servekit.benchmarks.structured_bench import SCHEMAS as BENCH_SCHEMAS
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import JSON, GrammarCompiler, GrammarSpec
from servekit.optimizations.llm.string_bounds import MAX_REF_DEPTH, StringBudget, relax
from servekit.optimizations.models.gguf_weights import smollm2_archive_files

VOCAB = 49152  # SmolLM2's


def _s(n: int, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# Schemas beyond the structured benchmark's: keys with escapes and other scripts, bounds of 0 and
# 1, prefixItems, additionalProperties, $defs (as pydantic writes them), strings under anyOf.
EXTRA = [
    _obj({'we"ird\\key': _s(5), "名前": _s(3), "empty": _s(0), "one": _s(1, minLength=1)}),
    _obj({"pair": {"type": "array", "prefixItems": [_s(4), {"type": "integer"}, _s(2)], "items": False,
                   "minItems": 3}}),
    {"type": "object", "additionalProperties": _s(6), "minProperties": 1, "maxProperties": 2},
    {"$defs": {"Tag": _obj({"label": _s(7), "parent": {"anyOf": [{"$ref": "#/$defs/Tag"}, {"type": "null"}]}})},
     **_obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "minItems": 1, "maxItems": 2},
             "either": {"anyOf": [_s(3), {"type": "integer"}]}})},
    _obj({"text": _s(40), "list": {"type": "array", "items": {"type": "array", "items": _s(3), "maxItems": 2},
                                    "maxItems": 2}}),
    # A string or something else, as pydantic writes Optional[constr(max_length=n)], and type lists.
    _obj({"nick": {"anyOf": [_s(3), {"type": "null"}], "default": None, "title": "Nick"},
          "tag": {"type": ["string", "null"], "maxLength": 2},
          "mixed": {"oneOf": [_s(4), {"type": "integer"}, _obj({"x": _s(2)})]}}),
]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = ChatTokenizer(smollm2_archive_files(torch.bfloat16)[0].parent)
    return GrammarCompiler(tokenizer, VOCAB, (tokenizer.eos_token_id,))


def test_relax_leaves_out_the_bounds_whose_place_the_answer_names() -> None:
    schema = EXTRA[3]
    relaxed, bounds = relax(schema)
    tag = relaxed["properties"]["tags"]["items"]
    assert "$ref" not in tag and "maxLength" not in tag["properties"]["label"]  # inlined from $defs, relaxed
    assert relaxed["properties"]["either"]["anyOf"] == [{"type": "string"}, {"type": "integer"}]  # a string or not
    assert tag["properties"]["parent"] == schema["$defs"]["Tag"]["properties"]["parent"]  # a $ref's type unknown
    assert bounds is not None and bounds.child("tags").item(5).child("label").max_chars == 7
    assert bounds.child("either").max_chars == 3 and schema["$defs"]["Tag"]["properties"]["label"]["maxLength"] == 7
    union = relax(EXTRA[5])[1]
    assert [union.child(k).max_chars for k in ("nick", "tag", "mixed")] == [3, 2, 4]
    assert union.child("mixed").child("x") is None  # inside the union's object branch: left to the grammar
    pair = relax(EXTRA[1])[1].child("pair")
    assert [b.max_chars if b else None for b in pair.prefix] == [4, None, 2] and pair.item(3) is None
    extra = relax(EXTRA[2])[1]
    assert extra.additional.max_chars == 6 and extra.child("any") is extra.additional and not extra.properties
    # Not counted: strings with a pattern or format, minLength over maxLength, nothing bounded.
    for kept in (_s(5, pattern="^a+$"), _s(5, format="date"), _s(2, minLength=3), _obj({"n": {"type": "integer"}}),
                 {"anyOf": [_s(3), _s(4)]}, {"anyOf": [_s(3), {"enum": ["x"]}]}, {"anyOf": [_s(3), {"type": "null"}],
                                                                                     "maxItems": 1},
                 {"anyOf": [_s(3), {"type": "null"}], "oneOf": [{"type": "string"}]}, True):
        assert relax(kept) == (kept, None)


def test_a_recursive_schema_is_inlined_only_so_deep() -> None:
    schema = {"$defs": {"Node": _obj({"name": _s(4), "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}})},
              "$ref": "#/$defs/Node"}
    relaxed, bounds = relax(schema)
    assert relaxed["$defs"] == schema["$defs"]  # what the innermost reference still names
    levels, node, b = 1, relaxed, bounds
    while "$ref" not in node["properties"]["kids"]["items"]:
        assert "maxLength" not in node["properties"]["name"] and b.child("name").max_chars == 4
        node, b, levels = node["properties"]["kids"]["items"], b.child("kids").item(0), levels + 1
    assert levels == MAX_REF_DEPTH and b.child("kids") is None  # below that the grammar keeps the bound


def _bits(words: numpy.ndarray) -> numpy.ndarray:
    return numpy.unpackbits(words.view(numpy.uint8), bitorder="little")[:VOCAB]


def _walk(compiler: GrammarCompiler, schema: dict, rng: random.Random, interesting: numpy.ndarray,
          steps: int = 400) -> tuple[str, int, int]:
    """One answer under the relaxed grammar cut by its budget, checked against the grammar with
    the bounds at every token: the answer, how many masks were cut, how many steps the strict grammar
    forced text on (where its mask keeps only the forced text's own tokens)."""
    strict = llguidance.LLMatcher(compiler.tokenizer, GrammarSpec.of(JSON, schema).grammar(count_bounds=False))
    row = compiler.constraint(GrammarSpec.of(JSON, schema)).start()
    assert row.budget is not None
    words = (VOCAB + 31) // 32
    want, got = numpy.zeros(words, numpy.int32), numpy.zeros(words, numpy.int32)
    tokens, cut, forced = [], 0, 0
    for _ in range(steps):
        strict.unsafe_compute_mask_ptr(want.ctypes.data, want.nbytes)
        row.matcher.unsafe_compute_mask_ptr(got.ctypes.data, got.nbytes)
        cap = row.cap()
        if cap is not None:
            got &= cap
            cut += 1
        allowed, wanted = _bits(got), _bits(want)
        missing = numpy.flatnonzero(wanted & ~allowed)
        assert not len(missing), f"{schema}: cut mask refuses {[compiler.lengths.token_bytes[t] for t in missing[:5]]}"
        extra = numpy.flatnonzero(allowed & ~wanted)
        if len(extra):  # only another tokenization of text the bounded grammar forces, which it takes
            forced += 1
            assert strict.compute_ff_bytes(), f"{schema}: extra tokens where nothing is forced"
            bad = [compiler.lengths.token_bytes[t] for t in extra if strict.validate_tokens([int(t)]) != 1]
            assert not bad, (schema, b"".join(compiler.lengths.token_bytes[t] for t in tokens), bad[:8], row.budget._left, row.budget._state, strict.compute_ff_bytes())
        choices = numpy.flatnonzero(allowed)
        pick = rng.random()
        quoted = [t for t in compiler.lengths.quoted if allowed[t]]
        if pick < 0.1 and quoted:  # a way out of unbounded keys and strings
            choices = numpy.array(quoted)
        elif pick < 0.3:
            special = choices[interesting[choices]]
            choices = special if len(special) else choices
        if pick < 0.75:  # the longest of a few: strings reach their bounds
            sample = rng.sample(list(choices), min(24, len(choices)))
            token = max(sample, key=lambda t: len(compiler.lengths.token_bytes[t]))
        else:
            token = rng.choice(list(choices))
        assert row.accept(int(token)) and strict.consume_token(int(token))
        tokens.append(int(token))
        if strict.is_stopped():
            break
    assert row.matcher.is_stopped() and strict.is_stopped(), "the walk did not end"
    return b"".join(compiler.lengths.token_bytes[t] for t in tokens).decode(), cut, forced


def test_cut_masks_allow_what_the_bounded_grammar_allows(compiler: GrammarCompiler) -> None:
    table = compiler.lengths.token_bytes
    # Tokens with escapes, quotes or non-ASCII bytes: walks prefer them now and then.
    interesting = numpy.array([any(c in (0x22, 0x5C) or c >= 0x80 for c in b) for b in table])
    rng = random.Random(7)
    cuts = forced = answers = 0
    for schema in [s for _, _, s in BENCH_SCHEMAS] + EXTRA:
        if relax(schema)[1] is None:
            continue
        for _ in range(3):
            text, c, f = _walk(compiler, schema, rng, interesting)
            doc = json.loads(text)
            jsonschema.validate(doc, schema)  # the bounds held
            cuts, forced, answers = cuts + c, forced + f, answers + 1
    assert answers >= 60 and cuts >= 200  # the walks did reach the bounds
    assert forced < cuts
    # Bounds of 0 and 1 had tokens with a quote tried, their verdicts kept for the later walks.
    assert compiler.lengths.verdicts and any(compiler.lengths.verdicts.values())


def test_budget_follows_keys_escapes_and_nesting(compiler: GrammarCompiler) -> None:
    schema = EXTRA[0]
    row = compiler.constraint(GrammarSpec.of(JSON, schema)).start()
    budget: StringBudget = row.budget
    text = '{"we\\"ird\\\\key": "a\\u0007'  # llguidance takes \u escapes of control characters only
    for t in compiler.tokenizer.tokenize_str(text):
        assert row.accept(t)
    # 'a' and one \u escape: 2 of 5 characters, the escape's hex digits inside the token sequence.
    assert budget._left == 3
    for t in compiler.tokenizer.tokenize_str('", "名前": "東京'):
        assert row.accept(t)
    assert budget._left == 1 and row.cap() is not None
    cap = numpy.unpackbits(row.cap().view(numpy.uint8), bitorder="little")
    fits = [i for i in range(VOCAB) if cap[i]]
    assert all(compiler.lengths.before_close[0, i] <= 1 for i in fits)
