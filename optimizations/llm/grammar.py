"""Grammar-constrained decoding with llguidance: compiled grammars, per-row matchers, logit bias.

The engine speaks token ids, so everything here is in token ids too: a ``DecodeConstraint``
(immutable, carried by a request's ``SamplingParams``) holds a compiled grammar, OpenAI's
``logit_bias`` and ``min_tokens``; ``DecodeConstraint.start()`` gives each running row its own
``RowConstraint``, whose ``accept()`` advances the matcher with each sampled token.
``bias_rows()`` builds the additive bias rows of a batch's rows for their next tokens (``-inf``
where a grammar forbids a token or a stop token comes before ``min_tokens``) on the model's
device: the grammars' masks are filled on the host as packed bitmasks (one bit per token, several
rows at once on llguidance's own threads where the host has cores to spare) and only those cross
to the device, where they are unpacked.

Why llguidance (figures: benchmarks/grammar_engine_bench.py, docs/structured-output.md): over the
structured benchmark's 24 schemas, most with length-bounded strings (``minLength``/``maxLength``),
and 8 more, it builds a grammar in 1.4 ms at the median (6 ms at most) where xgrammar 0.2.8 took
0.4 s (1.9 s), and its mask costs 89 µs per token on average against xgrammar's 213 µs, whose
single fills reach 8-22 ms (p99, max). Compilation is paid by a
schema's first request, the mask by every step of every constrained row, so both decide what
users see. llguidance also refuses what it cannot enforce (``uniqueItems``) instead of ignoring it,
and keeps raw control characters out of JSON strings, which xgrammar's masks let in.

Compiled grammars are cached in a bounded LRU keyed by the canonical text of what was asked for
(a schema's JSON), each as a matcher in its start state that rows copy; compilation runs under a
time limit on a helper thread: a schema that takes too long is a ``GrammarError`` for its request,
never a stalled worker (the helper finishes it in the background and caches it).
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import jsonschema
import llguidance
import numpy
import torch
from torch import Tensor

from servekit.optimizations.llm.sampling import unpack_masks, upload
from servekit.optimizations.llm.string_bounds import Bounds, LengthCaps, StringBudget, relax

log = logging.getLogger(__name__)

# What a grammar spec may be (vLLM's structured_outputs names): a JSON schema, any JSON object,
# a regular expression, one of a list of strings, a grammar (GBNF, as llama.cpp and vLLM's
# xgrammar backend take it, or llguidance's Lark dialect).
JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR = "json", "json_object", "regex", "choice", "grammar"
KINDS = (JSON, JSON_OBJECT, REGEX, CHOICE, GRAMMAR)
DEFAULT_CACHE_SIZE = 128
DEFAULT_COMPILE_TIMEOUT_S = 5.0
# A grammar whose first token mask takes longer than this is refused (GrammarCompiler._probe): a
# step waits for its slowest row's mask, so every request decoding beside it would wait that long
# per token. On the development VM the structured benchmark's schemas take under 2 ms a mask, a
# regex such as a{300000} 0.4-0.5 s (benchmarks/results/grammar-limits-cpu/).
DEFAULT_MASK_LIMIT_S = 0.05
# Distinct forced runs a compiled grammar keeps (``ForcedRuns``): the structured benchmark's schemas
# needed ~25 each over 256 answers (benchmarks/results/forced-runs-cache-h200/).
FORCED_RUNS_PER_GRAMMAR = 1024
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# JSON answers as OpenAI writes them: no free whitespace (a model would spend tokens on it),
# ", " and ": " between items and keys.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SAFE_INTEGER = 2**53 - 1  # JSON numbers every parser reads exactly
# A thinking model's block before the grammar's answer (GrammarSpec.think): the model may open one
# (MAY_THINK), or its prompt opened it (THINKING). The thinking is free text up to ``</think>``
# (llguidance's suffix: no backtracking), then the newlines before the answer.
MAY_THINK, THINKING = "may", "inside"
_THOUGHT = '''%llguidance {}
start: {head} @body
think: "<think>" thought NL?
thought[suffix="</think>"]: /(.|\\n)*/
NL: /\\n+/
'''

# What \d and \w stand for in a regex request. llguidance reads regexes as Rust's regex crate does, where
# they are Unicode classes: \d also matches Arabic-Indic digits or U+1FBF8 (a "segmented digit
# eight", which SmolLM2 sampled at temperature 1 into a date). JSON Schema's patterns follow
# ECMA-262, where both are ASCII, and llguidance builds those so; so does vLLM's default xgrammar
# backend for its regexes. A regex request gets the same ASCII classes (\p{Nd}, \p{L} for Unicode).
_ASCII_SHORTHANDS = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_shorthands(regex: str) -> str:
    r"""``regex`` with ``\d``, ``\w`` and their negations ``\D``, ``\W`` as ASCII classes, inside
    character classes too (a negation there as a nested class, which Rust's syntax unites)."""
    out: list[str] = []
    depth, i = 0, 0  # depth: how many character classes the scan is in
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            chars = _ASCII_SHORTHANDS.get(escaped.lower())
            if chars is None:  # another escape (\\, \[, \p{..}, \x41): as it is
                out.append(regex[i:i + 2])
            elif escaped.islower():
                out.append(chars if depth else f"[{chars}]")
            else:
                out.append(f"[^{chars}]")
            i += 2
        elif ch == "[":
            depth += 1
            i += 1
            # A ']' right after '[' or '[^' is a literal, not the class's end.
            head = "^" if regex[i:i + 1] == "^" else ""
            head += "]" if regex[i + len(head):i + len(head) + 1] == "]" else ""
            out.append(ch + head)
            i += len(head)
        else:
            if ch == "]" and depth:
                depth -= 1
            out.append(ch)
            i += 1
    return "".join(out)


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that is invalid, unsupported or too slow to compile."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` (one of ``KINDS``) and its canonical text."""

    kind: str
    text: str
    think: str = ""  # MAY_THINK or THINKING: a thinking block before what kind and text ask for

    @classmethod
    def of(cls, kind: str, value: Any) -> "GrammarSpec":
        """Validate ``value`` for ``kind`` and put it in canonical form (the cache key)."""
        if kind == JSON_OBJECT:
            return cls(kind, "")
        if kind == JSON:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise GrammarError(f"a JSON schema must be an object, got {type(value).__name__}")
            # Keys keep the schema's order: the grammar emits properties in that order, as OpenAI's
            # and vLLM's answers do, so two orders are two grammars (and two cache entries).
            return cls(kind, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        if kind in (REGEX, GRAMMAR):
            if not isinstance(value, str) or not value:
                raise GrammarError(f"a {kind} must be a non-empty string")
            return cls(kind, value)
        if kind == CHOICE:
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise GrammarError("a choice must be a non-empty list of non-empty strings")
            return cls(kind, json.dumps(value, ensure_ascii=False))
        raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")

    @property
    def bounds(self) -> Bounds | None:
        """Where the answer's strings whose ``maxLength`` the grammar leaves to counting lie
        (``string_bounds.relax``); None when there are none."""
        return _json_bounds(self.text) if self.kind == JSON and not self.think else None

    def grammar(self, count_bounds: bool = True) -> str:
        """llguidance's grammar for this spec; ``GrammarError`` naming what is wrong (an invalid
        JSON schema says where, against its metaschema). ``count_bounds=False``: every ``maxLength``
        stays in the grammar, none is left to ``bounds`` (for comparisons)."""
        body = self._body(count_bounds)
        if not self.think:
            return body
        # The thinking block in a Lark grammar of its own, the answer's grammar after it by name.
        top = json.loads(body) if body.lstrip().startswith("{") else {"grammars": [{"lark_grammar": body}]}
        head = {MAY_THINK: "think?", THINKING: "thought NL?"}[self.think]
        grammars = [{"name": "thinking", "lark_grammar": _THOUGHT.replace("{head}", head)},
                    {**top["grammars"][0], "name": "body"}]
        return json.dumps({"grammars": grammars})

    def _body(self, count_bounds: bool = True) -> str:
        """The grammar of what ``kind`` and ``text`` ask for, without a thinking block."""
        if self.kind == JSON:
            schema = json.loads(self.text)
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as e:
                where = "/".join(str(p) for p in e.absolute_path) or "(root)"
                raise GrammarError(f"invalid JSON schema at {where}: {e.message}") from None
            except Exception as e:  # a "$schema" that is no string, nesting too deep to check
                raise GrammarError(f"invalid JSON schema ({type(e).__name__})") from None
            where = _unenforced(schema)
            if where is not None:
                raise GrammarError(f"uniqueItems at {where} is not supported: the grammar cannot keep array items "
                                   "distinct, so answers could break the schema; remove it (or check uniqueness "
                                   "after parsing)")
            schema = _for_grammar(schema)
            if count_bounds and not self.think:  # after a thinking block the JSON starts where no budget looks
                schema = relax(schema)[0]
        elif self.kind == JSON_OBJECT:  # OpenAI's json_object: an object, any keys and values
            schema = {"type": "object"}
        try:
            if self.kind in (JSON, JSON_OBJECT):
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
            if self.kind == REGEX:
                return llguidance.LLMatcher.grammar_from_regex(ascii_shorthands(self.text))
            return llguidance.grammar_from("choice" if self.kind == CHOICE else "grammar", self.text)
        except Exception as e:  # llguidance's own: the GBNF -> Lark conversion's, an integer beyond 64 bits in a schema
            raise GrammarError(f"the {self.kind} cannot be used: {_first_line(e)}") from None


@functools.lru_cache(maxsize=DEFAULT_CACHE_SIZE)
def _json_bounds(text: str) -> Bounds | None:
    """``GrammarSpec.bounds`` of a schema's canonical text: one object per schema, shared by its
    requests' rows (``StringBudget`` keys what it tried by it)."""
    try:
        return relax(_for_grammar(json.loads(text)))[1]
    except (ValueError, RecursionError):  # grammar() says what is wrong with it
        return None


def _for_grammar(schema: Any) -> Any:
    """``schema`` as the grammar is built from it, narrowed so that a model's answer ends, and still
    valid against the schema as sent:

    - ``additionalProperties: false`` on each object that lists its properties and says nothing of
      others (OpenAI's strict mode; xgrammar's ``strict_mode`` did the same): no wandering into
      keys nobody asked for;
    - numbers get at most 9 decimals (``multipleOf: 1e-9``, unless the schema sets a
      ``multipleOf``), and numbers and integers stay within +-(2^53 - 1) where the schema sets no
      bound: an H100 run of SmolLM2 sampled ``"amount": 8495.0111111...`` until ``max_tokens``
      (xgrammar's own number rule caps digits the same way).

    Subschemas of ``allOf`` are left alone (closing each would reject the others' properties)."""
    if isinstance(schema, list):
        return [_for_grammar(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "allOf" else _for_grammar(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") in ("number", "integer"):
        if out["type"] == "number" and "multipleOf" not in out:
            out["multipleOf"] = 1e-9
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


# llguidance's slices: sets of tokens precomputed with the tokenizer. Where the lexer allows every
# token of a slice, a mask takes that set whole and walks only the tokens outside it. Its default
# slices are JSON string contents of 1-10 characters, 1-30 and any length. Inside a string with a
# maxLength, each count of characters left is a lexer state of its own: with 10-29 left, a mask
# walked every token longer than 10 characters. With steps of 2-6 characters up to 30, SmolLM2's
# masks along its answers to the structured benchmark's schemas took 65.7 µs on average instead
# of 98.2 (p90 105.6 against 308.9) on the H100 host, for ~0.15 ms more per schema compiled
# (docs/structured-output.md; benchmarks/grammar_mask_costs.py).
STRING_CHARS = r'[^"\\\x00-\x1F\x7F]'
MASK_SLICES = [r"[\x20\x0A\x0D\x09]+", *(f"{STRING_CHARS}{{1,{n}}}" for n in (4, 6, 8, 10, 12, 14, 16, 20, 24, 30)),
               f"{STRING_CHARS}+"]

# Texts whose tokens llguidance's own reading of tokenizer.json must give as the tokenizer does
# before it is used: what a grammar forces (JSON keys and punctuation), spaces, other scripts.
PROBE_TEXTS = ('{"name": "', ': "', '", "', '{"a": [1, 2.5e-3, true, null]}', "hello world", "  x",
               "\n\t\"", "naïve café 東京 😀", "ANSWER: 42.", "<|im_end|>")


# llguidance's own reading of a tokenizer.json takes time that grows with the square of its added
# tokens: SmolLM2's tokenizer with 51,000 added took 16 s on the development VM, with 102,000 (the
# Qwen2.5-0.5B-shaped benchmark model's 151,936 ids, padded that way until shaped_models used plain
# vocabulary entries) about three minutes of a worker's start on an H200 host, for two readings.
# Real tokenizers add tens to a few thousand (Llama 3: 256).
MAX_NATIVE_ADDED_TOKENS = 16384


def llg_tokenizer(tokenizer: Any, vocab_size: int,
                  stop_token_ids: Sequence[int]) -> tuple[llguidance.LLTokenizer, str | None]:
    """llguidance's view of a ``ChatTokenizer``'s vocabulary: ``vocab_size`` ids, each as the bytes
    it stands for, with every stop token allowed where the grammar may end; and why it is not
    llguidance's own (None when it is).

    llguidance tokenizes the text a grammar forces (``{"name": "``) while it fills a mask. Its own
    reading of tokenizer.json does that in Rust; servekit's byte table (``_Vocab``) calls back into
    Python, which needs the GIL from llguidance's threads. On the 2-core VM, 32 rows' masks took
    2.65 ms that way against 0.30 natively, and 8.5 against 1.3 ms beside a busy Python thread (a
    worker's handler thread streaming answers). The native reading (of tokenizer.json as it is, else
    as ``byte_level_json`` rewrites it) is used when it agrees with the byte table on every token's
    bytes, the special tokens, the stop tokens and ``PROBE_TEXTS``."""
    stops = list(stop_token_ids) or tokenizer.eos_token_id
    table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tokenizer, vocab_size)), n_vocab=vocab_size,
                                   eos_token=stops, slices=MASK_SLICES)
    added = len(tokenizer.tokenizer.get_added_tokens_decoder())
    if added > MAX_NATIVE_ADDED_TOKENS:
        return table, (f"the tokenizer has {added} added tokens; llguidance's reading of it takes time that grows "
                       f"with their square, so more than {MAX_NATIVE_ADDED_TOKENS} are not read")
    raw = tokenizer.tokenizer.to_str()
    reason = "no reading tried"
    for text in dict.fromkeys(filter(None, (raw, byte_level_json(raw)))):
        try:
            native = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=stops, slices=MASK_SLICES)
        except Exception as e:  # a tokenizer.json llguidance cannot read
            reason = f"llguidance cannot read the tokenizer: {_first_line(e)}"
            continue
        reason = tokenizer_mismatch(native, table)
        if reason is None:
            return native, None
    return table, reason


def byte_level_json(raw: str) -> str | None:
    """A tokenizer.json whose decoder has a ByteLevel step, as a plain byte-level BPE: that step
    alone as its decoder, no byte fallback; None for other tokenizers and plain ones. transformers
    5.17 converts SmolLM2's GGUF to a BPE with byte fallback and a SentencePiece-style chain around
    ByteLevel (5.24: ByteLevel alone), which llguidance then reads as SentencePiece: token 111 as
    the UTF-8 of "¡" instead of the byte 0xA1 (H100 machine, 2026-11-26)."""
    d = json.loads(raw)
    decoder = d.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    byte_level = next((step for step in steps if step.get("type") == "ByteLevel"), None)
    model = d.get("model") or {}
    if byte_level is None or (byte_level is decoder and not model.get("byte_fallback")):
        return None
    d["decoder"], d["model"] = byte_level, {**model, "byte_fallback": False}
    return json.dumps(d, ensure_ascii=False)


def tokenizer_mismatch(native: llguidance.LLTokenizer, table: llguidance.LLTokenizer) -> str | None:
    """Where two llguidance tokenizers of one vocabulary differ (None: nowhere that masks depend on)."""
    if native.vocab_size != table.vocab_size:
        return f"vocabulary of {native.vocab_size} tokens, not {table.vocab_size}"
    if native.eos_tokens != table.eos_tokens:
        return f"stop tokens {native.eos_tokens}, not {table.eos_tokens}"
    for i in range(table.vocab_size):
        if native.decode_bytes([i]) != table.decode_bytes([i]) or native.is_special_token(i) != table.is_special_token(i):
            return f"token {i} reads {native.decode_bytes([i])!r}, not {table.decode_bytes([i])!r}"
    for text in PROBE_TEXTS:
        if native.tokenize_str(text) != table.tokenize_str(text):
            return f"{text!r} tokenizes to {native.tokenize_str(text)}, not {table.tokenize_str(text)}"
    return None


class _Vocab:
    """A vocabulary as llguidance's ``TokenizerWrapper`` takes it: each id's bytes from
    ``ChatTokenizer.token_bytes`` (special tokens marked by llguidance's 0xFF prefix: never inside a
    grammar's text; ids past the tokenizer's, empty), and an encoder of text. The reference that
    llguidance's own reading of tokenizer.json is checked against, and the tokenizer used when they
    differ: on a GPU machine that reading of the GGUF-converted SmolLM2 tokenizer once gave masks
    that, after ``{"name":``, allowed only ``:``, where this table gave the right ones."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        special = {t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values() if t.special}
        size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(vocab_size):
            piece = tokenizer.tokenizer.id_to_token(i) if i < size else None
            if piece is None:
                self.tokens.append(b"")
            elif piece in special:
                self.tokens.append(b"\xff" + piece.encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(tokenizer.token_bytes(i))
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self._encode = tokenizer.tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then passes text, not bytes
            raise TypeError("text only")
        return self._encode(text, add_special_tokens=False).ids


class DeferredGrammars:
    """A request's ``DecodeConstraint`` with its ``GrammarSpec`` and no compiled grammar: what the
    worker builds, and the engine process compiles (engine_process.py; ``GrammarCompiler`` adds the
    compiling).
    A schema's first use then costs one compilation, on the engine's helper threads rather than the
    worker's handler thread, and a grammar llguidance refuses (or does not compile in the time
    limit) ends its request with a ``GrammarError`` from the engine: a 400 like any other."""

    def __init__(self, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.vocab_size, self.stop_token_ids = vocab_size, tuple(stop_token_ids)

    def constraint(self, spec: GrammarSpec | None = None, logit_bias: tuple[tuple[int, float], ...] = (),
                   min_tokens: int = 0) -> "DecodeConstraint | None":
        """A request's ``DecodeConstraint`` (None when it asks for nothing), its grammar not compiled."""
        if spec is None and not logit_bias and min_tokens <= 0:
            return None
        return DecodeConstraint(None, logit_bias, min_tokens, self.vocab_size, self.stop_token_ids, spec)


class GrammarCompiler(DeferredGrammars):
    """Compiles ``GrammarSpec``s for one tokenizer: a bounded LRU of compiled grammars and a time
    limit per compilation. Thread-safe (helper threads compile, the engine thread matches).
    ``python_tokenize``: why llguidance's own tokenizer is not used (None when it is)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_size: int = DEFAULT_CACHE_SIZE, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 mask_limit_s: float = DEFAULT_MASK_LIMIT_S) -> None:
        super().__init__(vocab_size, stop_token_ids)
        self.tokenizer, self.python_tokenize = llg_tokenizer(tokenizer, vocab_size, stop_token_ids)
        if self.python_tokenize:
            log.warning("grammar masks tokenize forced text through Python, slower under load: %s",
                        self.python_tokenize)
        self.cache_size, self.timeout_s, self.mask_limit_s = cache_size, timeout_s, mask_limit_s
        self.lengths = LengthCaps(self.tokenizer, vocab_size)  # ~40 ms for SmolLM2's 49,152 tokens
        self._cache: collections.OrderedDict[GrammarSpec, llguidance.LLMatcher] = collections.OrderedDict()
        self._runs: dict[GrammarSpec, ForcedRuns] = {}  # each cached grammar's, evicted with it
        self._lock = threading.Lock()
        # Two helpers: one stuck on a pathological schema leaves the other for everyone else.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="servekit-grammar")

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher of ``spec`` in its start state (rows run copies of it); cached."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        future = self._pool.submit(self._build, spec)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            # The compile goes on in the pool and is cached when it ends: the request is refused
            # now, a retry of the same schema finds it compiled instead of timing out again.
            future.add_done_callback(lambda f: f.exception() is None and self._store(spec, f.result()))
            raise GrammarError(f"the {spec.kind} did not compile within {self.timeout_s:g} s; "
                               "simplify it, or retry: it stays compiling and is cached when done") from None
        self._store(spec, compiled)
        return compiled

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():  # llguidance reports a bad grammar as a matcher in its error state
            why = _first_line(matcher.get_error())
            if spec.kind == REGEX:  # it quotes the regex it parsed: the request's, not ascii_shorthands'
                why = why.replace(json.dumps(ascii_shorthands(spec.text), ensure_ascii=False),
                                  json.dumps(spec.text, ensure_ascii=False))
            raise GrammarError(f"the {spec.kind} cannot be used: {why}")
        self._probe(spec, matcher)
        return matcher

    def _probe(self, spec: GrammarSpec, matcher: llguidance.LLMatcher) -> None:
        """The start state's mask, once, on a copy (a row's first step would compute it anyway).
        Refused here with the request's 400, rather than found by the steps of every batch it joins:
        a grammar that nothing satisfies (a schema that only refers to itself, a regex of an empty
        class: llguidance allows no token but the end and calls it an error), one llguidance gives
        up on at its limits, and one whose mask takes over ``mask_limit_s``."""
        probe = matcher.deep_copy()
        mask = numpy.zeros((self.vocab_size + 31) // 32, dtype=numpy.int32)
        took = mask_cpu_seconds(probe, mask.ctypes.data, mask.nbytes)
        if probe.is_error():
            why = _first_line(probe.get_error())
            if why == "NoExtensionBias":
                raise GrammarError(f"the {spec.kind} admits no output: no text matches it (a schema that only "
                                   "refers to itself, or a character class that is empty, for example)")
            raise GrammarError(f"the {spec.kind} cannot be used: {why}")
        if took > self.mask_limit_s:
            raise GrammarError(too_slow(spec.kind, took, self.mask_limit_s, found_by="probe"))

    def _store(self, spec: GrammarSpec, compiled: llguidance.LLMatcher) -> None:
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            self._runs.setdefault(spec, ForcedRuns())
            while len(self._cache) > self.cache_size:
                self._runs.pop(self._cache.popitem(last=False)[0], None)

    def constraint(self, spec: GrammarSpec | None = None, logit_bias: tuple[tuple[int, float], ...] = (),
                   min_tokens: int = 0) -> "DecodeConstraint | None":
        """A request's ``DecodeConstraint`` (None when it asks for nothing), its grammar compiled."""
        return self.restore(super().constraint(spec, logit_bias, min_tokens))

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def restore(self, c: DecodeConstraint | None) -> DecodeConstraint | None:
        """``c`` with its grammar compiled if it came without (``DeferredGrammars``, ``DecodeConstraint.portable``)."""
        if c is None or c.spec is None or c.grammar is not None:
            return c
        grammar = self.compile(c.spec)
        with self._lock:
            runs = self._runs.get(c.spec)
        return replace(c, grammar=grammar, lengths=self.lengths if c.spec.bounds is not None else None, runs=runs)

    def __len__(self) -> int:
        return len(self._cache)


def _unenforced(schema: Any, path: str = "(root)") -> str | None:
    """Where ``schema`` asks for ``uniqueItems: true``, which no grammar can enforce (xgrammar
    accepted it and answered an array of enum values with one value three times; llguidance
    refuses it as an unimplemented key): refused with where it is, rather than a vaguer message or
    JSON that fails its schema."""
    if isinstance(schema, dict):
        if schema.get("uniqueItems") is True:
            return path
        for key, value in schema.items():
            found = _unenforced(value, key if path == "(root)" else f"{path}/{key}")
            if found is not None:
                return found
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found = _unenforced(value, f"{path}/{i}")
            if found is not None:
                return found
    return None


def _first_line(e: Exception | str) -> str:
    """The gist of llguidance's multi-line message: its first line and the regex parser's
    ``error:`` line when there is one (the lines between draw the error's position)."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    if not lines:
        return type(e).__name__
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} {detail}" if detail else lines[0]


def mask_cpu_seconds(matcher: llguidance.LLMatcher, ptr: int, nbytes: int) -> float:
    """Fill ``matcher``'s packed next-token mask at ``ptr`` (``nbytes``) on this thread and return the
    CPU seconds it took: the measure the mask limit holds a grammar to, in the compiler's probe and
    the engine's audit alike. CPU time, not the wall clock: a loaded host stretches the wall clock of
    a cheap mask, while llguidance computes a lone matcher's mask on the calling thread."""
    t0 = time.thread_time()
    matcher.unsafe_compute_mask_ptr(ptr, nbytes)
    return time.thread_time() - t0


def too_slow(what: str, took_s: float, limit_s: float, found_by: str) -> str:
    """The error of a grammar whose token mask took ``took_s`` of CPU, over ``limit_s``: found by the
    compiler's probe of its first mask (the request is refused: its batch mates *would* wait) or by
    the engine's audit of a step (the row ends: they *waited*)."""
    makes, wait = {"probe": ("makes", "would wait"), "audit": ("made", "waited")}[found_by]
    return (f"the {what} {makes} decoding too slow: one token's mask took {took_s * 1e3:.0f} ms (the limit is "
            f"{limit_s * 1e3:g} ms), and every request decoding beside it {wait} as long for each token; large "
            "counted repetitions such as a{20000} are the usual cause")


class ForcedRuns:
    """The runs of tokens one compiled grammar forced (llguidance's ``compute_ff_tokens``), by the
    token the row took last and the bytes the grammar forces after it, shared by every row of that
    grammar. llguidance tokenizes the last token's bytes and the forced ones together, then chops
    trailing tokens that a longer token allowed next could replace: 66 us at the median where bytes
    are forced (the 2-core development machine), against 12.5 us for the bytes alone
    (``compute_ff_bytes``), on the engine thread with the GIL held while the GPU waits. A schema's
    rows force the same separators and property names (``", "age": ``) again and again, so after a
    few answers the runs come from here.

    The key leaves out the rest of the grammar's state, which the chop reads: two places of one
    grammar that force the same bytes after the same token but allow different text after them
    could chop differently. The run's tokens spell the forced bytes either way, so the answer stays
    what the grammar allows; only where a token boundary falls could differ from llguidance's own.
    The structured benchmark's and the tests' schemas show no such difference (tests)."""

    def __init__(self, limit: int = FORCED_RUNS_PER_GRAMMAR) -> None:
        self.limit = limit
        self._runs: dict[tuple[int | None, bytes], tuple[int, ...]] = {}
        self.hits = self.misses = 0

    def of(self, matcher: llguidance.LLMatcher, last: int | None) -> list[int]:
        """The tokens ``matcher`` forces next; ``last``: the token it took last (None: none yet)."""
        forced = matcher.compute_ff_bytes()
        if not forced:  # nothing forced: no run (what compute_ff_tokens returns too)
            return []
        run = self._runs.get((last, forced))
        if run is None:
            self.misses += 1
            run = tuple(matcher.compute_ff_tokens())
            if len(self._runs) >= self.limit:  # a bound, not an LRU: a grammar's runs are few
                self._runs.clear()
            self._runs[(last, forced)] = run
        else:
            self.hits += 1
        return list(run)


@dataclass(frozen=True)
class DecodeConstraint:
    """A request's constraints on each next token: a compiled grammar, ``logit_bias`` (token id ->
    bias added to the logit) and ``min_tokens`` (stop tokens masked until that many were generated)."""

    grammar: llguidance.LLMatcher | None = None  # the compiled grammar's start state
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    vocab_size: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())
    spec: GrammarSpec | None = None  # what ``grammar`` was compiled from
    lengths: LengthCaps | None = None  # the vocabulary's caps, where the spec's strings have ``bounds``
    runs: ForcedRuns | None = field(default=None, compare=False)  # the compiled grammar's, shared (None: each computed)

    def start(self) -> "RowConstraint":
        return RowConstraint(self)

    def portable(self) -> "DecodeConstraint":
        """This constraint without its compiled grammar, which cannot leave its process: the
        engine process compiles ``spec`` (``GrammarCompiler.restore``), from its own cache."""
        return replace(self, grammar=None, lengths=None, runs=None) if self.grammar is not None else self


class RowConstraint:
    """One running row's constraint state: its matcher and how many tokens it has generated."""

    def __init__(self, c: DecodeConstraint) -> None:
        self.c = c
        self.matcher = c.grammar.deep_copy() if c.grammar is not None else None  # microseconds
        # A budget only where the compiler gave the vocabulary's caps and the spec has bounds.
        bounds = c.spec.bounds if c.spec is not None and c.lengths is not None else None
        self.budget = StringBudget(bounds, c.lengths) if bounds is not None else None
        self.generated = 0
        self.last: int | None = None  # the token the matcher took last
        self.refused: str | None = None  # why the engine ends the row though its grammar goes on (MaskUpload's audit)
        self._stops_masked = False
        self.static: Tensor | None = None  # the logit_bias row (vocab_size,), when there is one
        if c.logit_bias:
            self.static = torch.zeros(c.vocab_size, dtype=torch.float32)
            for tok, bias in c.logit_bias:
                self.static[tok] = bias

    @property
    def per_step(self) -> bool:
        """Whether the bias changes with each token (the host must see a token before the next step)."""
        return self.matcher is not None or self.bias_changes

    @property
    def bias_changes(self) -> bool:
        """Whether the bias row without the grammar's mask changes with this token: stop tokens held
        back until ``min_tokens``, and the one rebuild that lets them in again."""
        return self.generated < self.c.min_tokens or self._stops_masked

    def mask_stops(self, row: Tensor) -> None:
        """Before ``min_tokens`` tokens, the stop tokens of ``row`` (on any device) become ``-inf``,
        unless nothing else is left (a grammar that is complete): then they keep their bias. No
        host sync. Once ``min_tokens`` is reached the row is built once more without the mask."""
        self._stops_masked = self.generated < self.c.min_tokens
        if self._stops_masked and self.c.stop_token_ids:
            stops = upload(self.c.stop_token_ids, torch.int64, row.device)
            kept = row[stops].clone()
            row[stops] = float("-inf")
            row[stops] = torch.where(torch.isfinite(row).any(), torch.full_like(kept, float("-inf")), kept)

    def error(self) -> str | None:
        """Why this row's grammar cannot go on, for its request's error: ``refused``, or llguidance's
        error state (a limit of its lexer reached mid-answer, e.g. ``too many expressions
        constructed``); None otherwise."""
        if self.refused is not None:
            return self.refused
        if self.matcher is not None and self.matcher.is_error():
            return f"the grammar could not be followed further: {_first_line(self.matcher.get_error())}"
        return None

    def refuse_slow(self, took_s: float, limit_s: float) -> None:
        """End this row at its next token: its mask took ``took_s`` of CPU, over ``limit_s``."""
        self.refused = too_slow("grammar", took_s, limit_s, found_by="audit")

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar rejects it (``error()`` says why when
        llguidance gave up on the grammar; otherwise the token was masked: a bug)."""
        self.generated += 1
        if self.budget is not None:
            self.budget.feed(token)
        if self.matcher is None or self.matcher.is_stopped():
            return True
        self.last = token
        return self.matcher.consume_token(token)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (``compute_ff_tokens``), through the grammar's
        ``ForcedRuns`` where it has them. Only for a row with a matcher."""
        assert self.matcher is not None
        if self.c.runs is None:
            return self.matcher.compute_ff_tokens()
        return self.c.runs.of(self.matcher, self.last)

    def cap(self) -> numpy.ndarray | None:
        """The packed row that cuts the grammar's next mask to what the open string's
        ``maxLength`` leaves (``string_bounds``); None where nothing is cut."""
        return self.budget.cap() if self.budget is not None else None


@functools.cache
def _executor() -> llguidance.LLExecutor | None:
    """llguidance's pool for filling several rows' masks at once: half the cores (the engine, the
    handler and TorchServe's own threads keep the rest), None on a host with too few to share."""
    threads = min(8, (os.cpu_count() or 1) // 2)
    return llguidance.LLExecutor(threads) if threads > 1 else None


def fill_masks(matchers: Sequence[tuple[llguidance.LLMatcher, int]], masks: Tensor,
               executor: llguidance.LLExecutor | None | str = "engine") -> None:
    """Each matcher's packed mask of allowed next tokens into its row of ``masks`` (int32, CPU,
    contiguous, 32 tokens per word), several rows at once on llguidance's threads when there are
    cores for them. (llguidance.torch wraps the same calls, but importing it imports torch's
    compiler stack for a decorator, seconds of a worker's start.) ``executor``: those threads
    (None: one row after another), by default the engine's choice."""
    row_bytes = masks.shape[1] * masks.element_size()
    executor = _executor() if executor == "engine" else executor
    if executor is not None and len(matchers) > 1:
        executor.unsafe_compute_mask_ptr(list(matchers), masks.data_ptr(), row_bytes, masks.shape[0])
    else:
        for m, i in matchers:
            m.unsafe_compute_mask_ptr(masks[i].data_ptr(), row_bytes)


Caps = Sequence[tuple[int, numpy.ndarray]]  # (row, RowConstraint.cap()) of the rows whose masks it cuts


def fill_packed(matchers: Sequence[tuple[llguidance.LLMatcher, int]], host: Tensor, caps: Caps = ()) -> None:
    """Each (matcher, row) pair's packed mask of its next token into that row of ``host`` (int32,
    CPU, ``(rows, words)``), cut by the row's cap where ``caps`` has one; -1 (everything allowed)
    in the other rows."""
    if len(matchers) < host.shape[0]:
        # Through numpy, on this thread: torch's fill_ of 32 rows runs on its intra-op threads,
        # whose spinning then slowed llguidance's threads (H100 host, 32 rows: 4.7 ms for the
        # fill_, the masks' fill 1.0 -> 1.8 ms).
        host.numpy()[sorted(set(range(host.shape[0])) - {i for _, i in matchers})] = -1
    fill_masks(matchers, host)
    _cut(host, caps)


def _cut(host: Tensor, caps: Caps) -> None:
    rows = host.numpy()
    for i, cap in caps:
        rows[i] &= cap


def packed_masks(matchers: Sequence[tuple[llguidance.LLMatcher, int]], rows: int, words: int,
                 device: torch.device, caps: Caps = ()) -> Tensor:
    """The packed masks ``(rows, words)`` int32 on ``device`` (``fill_packed``), filled on the host
    into pinned memory (on CUDA) and copied without waiting: PyTorch's pinned-memory cache hands
    the block out again only once its copy has run."""
    host = torch.empty(rows, words, dtype=torch.int32, pin_memory=device.type == "cuda")
    fill_packed(matchers, host, caps)
    return host.to(device, non_blocking=True)


class MaskUpload:
    """The decode steps' packed masks, filled into a pinned host block per shape that is kept, and
    copied from it straight into the sampling step's own buffer. Allocating a pinned block and a
    device tensor per step, then copying that into the buffer, cost the engine thread more than
    the copy itself. A block is refilled only once its last copy has run (an event: by then long
    done, since the step that copy feeds has been read).

    The engine thread fills them itself, several rows at once on llguidance's threads, right before
    the sampling half. A helper thread that filled them beside the engine's other work paid more in
    thread and GIL handoffs than it overlapped once a 32-row fill took ~0.35 ms (H200 host,
    ``benchmarks/results/mask-fill-engine-thread-h200/``).

    A grammar can pass ``GrammarCompiler``'s probe of its start and reach a state whose mask costs
    far more later (the regex ``[a-z]{3}a{30000}``: 0.5 ms, then up to 30-46 ms on the development VM).
    Every row of a step waits for the slowest mask, so a fill that takes over ``limit_s`` makes the
    next one an audit: the rows filled one by one, each timed in CPU time, and the matchers over the
    limit collected in ``too_slow`` (their masks are still filled: the engine ends their requests
    once it reads the step, the others go on at their pace)."""

    def __init__(self, limit_s: float = DEFAULT_MASK_LIMIT_S) -> None:
        self._blocks: dict[tuple[int, ...], tuple[Tensor, torch.cuda.Event | None]] = {}
        self.limit_s = limit_s
        self._audit = False
        self.too_slow: dict[int, float] = {}  # id() of a matcher whose mask took over limit_s -> its seconds

    def __call__(self, matchers: Sequence[tuple[llguidance.LLMatcher, int]], dest: Tensor, caps: Caps = ()) -> None:
        """Fill ``dest`` (int32 ``(rows, words)``, on the device) with ``fill_packed``'s masks; on
        CUDA without waiting for the device. ``too_slow`` then holds this fill's audit, if it was one."""
        self.too_slow.clear()
        host = self._block(dest)
        self._fill(matchers, host, caps)
        self._copy(host, dest)

    def _fill(self, matchers: Sequence[tuple[llguidance.LLMatcher, int]], host: Tensor, caps: Caps = ()) -> None:
        """``fill_packed``, timed; an audit of each row after a fill over the limit."""
        if not self._audit:
            t0 = time.perf_counter()
            fill_packed(matchers, host, caps)
            self._audit = time.perf_counter() - t0 > self.limit_s
            return
        self._audit = False
        host.numpy().fill(-1)  # every row allowed; the grammar rows' own masks next
        row_bytes = host.shape[1] * host.element_size()
        for m, i in matchers:
            took = mask_cpu_seconds(m, host[i].data_ptr(), row_bytes)
            if took > self.limit_s:
                self.too_slow[id(m)] = took
        _cut(host, caps)

    def _block(self, dest: Tensor) -> Tensor:
        """The pinned block for ``dest``'s shape, free to fill: its last copy has run."""
        got = self._blocks.get(tuple(dest.shape))
        if got is None:
            cuda = dest.device.type == "cuda"
            got = (torch.empty(dest.shape, dtype=torch.int32, pin_memory=cuda), torch.cuda.Event() if cuda else None)
            self._blocks[tuple(dest.shape)] = got
        host, copied = got
        if copied is not None:
            copied.synchronize()
        return host

    def _copy(self, host: Tensor, dest: Tensor) -> None:
        dest.copy_(host, non_blocking=True)
        copied = self._blocks[tuple(dest.shape)][1]
        if copied is not None:
            copied.record()


def bias_rows(rows: Sequence[RowConstraint | None], vocab_size: int, device: torch.device,
              grammar: bool = True) -> Tensor:
    """The additive bias rows ``(len(rows), vocab_size)`` float32 on ``device`` for each row's next
    token: its ``logit_bias``, ``-inf`` where its grammar forbids a token (``grammar=False``: not,
    for a decode state whose sampling step applies the packed masks itself), stop tokens masked
    before ``min_tokens``; zeros for a row without constraints (None). No host sync before the
    masks are on their way: the caller fills them while the device still runs the step's forward."""
    n = len(rows)
    grammar_rows = [(r.matcher, i) for i, r in enumerate(rows) if grammar and r is not None and r.matcher is not None]
    if grammar_rows:
        # Every row's packed mask (all ones where there is no grammar), filled before any device
        # work here (the static rows' index tensor would wait for the device), so that one
        # masked_fill applies them all.
        packed = packed_masks(grammar_rows, n, (vocab_size + 31) // 32, device, row_caps(rows))
    bias = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
    static = [i for i, r in enumerate(rows) if r is not None and r.static is not None]
    if static:
        bias.index_copy_(0, upload(static, torch.int64, device),
                         torch.stack([rows[i].static for i in static]).to(device))  # type: ignore[union-attr]
    if grammar_rows:
        bias.masked_fill_(~unpack_masks(packed, vocab_size), float("-inf"))
    for i, r in enumerate(rows):
        if r is not None and r.c.min_tokens:
            r.mask_stops(bias[i])
    return bias


def row_caps(rows: Sequence[RowConstraint | None], slots: Sequence[int] | None = None) -> list[tuple[int, numpy.ndarray]]:
    """(row, cap) of each of ``rows`` whose next mask its open string cuts (``RowConstraint.cap``);
    the rows numbered by ``slots`` where given, else by their place in ``rows``."""
    out = []
    for i, r in enumerate(rows):
        cap = r.cap() if r is not None else None
        if cap is not None:
            out.append((i if slots is None else slots[i], cap))
    return out


def logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (an object of token id strings -> bias in [-100, 100]) as pairs."""
    if not isinstance(value, dict):
        raise GrammarError("'logit_bias' must be an object mapping token ids to biases")
    out = []
    lo, hi = LOGIT_BIAS_RANGE
    for key, bias in value.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise GrammarError(f"'logit_bias' key {key!r} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise GrammarError(f"'logit_bias' token id {tok} is outside the vocabulary (0..{vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not lo <= bias <= hi:
            raise GrammarError(f"'logit_bias[{key}]' must be a number in [{lo:g}, {hi:g}], got {bias!r}")
        out.append((tok, float(bias)))
    return tuple(out)
