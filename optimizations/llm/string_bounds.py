"""Length-bounded JSON strings (``maxLength``) without llguidance's slowest masks.

Inside a string with a ``maxLength``, each count of characters left is a lexer state of llguidance's
own, and a few characters short of the bound a mask walks most of the vocabulary to refuse its
tokens as too long: one mask in a hundred took ~0.9 ms on an H200 host, where most take
microseconds, and every row of a decode step waits for its slowest mask (docs/structured-output.md).

So a JSON schema's grammar is built without the ``maxLength`` of strings whose place the answer
itself names (``relax``: an object's property, an array's item, through local ``$ref``s), and the
bound is kept by counting instead. Each row's ``StringBudget`` follows its answer's JSON as the
tokens arrive; inside such a string its mask is cut to the tokens whose characters before the
string's closing quote fit what is left (``LengthCaps``: a packed row per count, per vocabulary).
The cut mask is the mask of the grammar with the bound, token for token (tests/test_string_bounds.py
compares them along sampled answers). Strings under ``anyOf``, ``oneOf``, ``allOf`` and the like
keep their ``maxLength`` in the grammar (which branch an answer is in is the grammar's to know),
except a union of one string and other types (``_string_or_other``), where a quote names the string.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy

# Where a string's next byte falls: plain content, right after a backslash, or in a \uXXXX escape
# with 4, 3, 2 or 1 hex digits to go.
CONTENT, ESCAPED, HEX4, HEX3, HEX2, HEX1 = range(6)
OUTSIDE = 6  # not in a string
_QUOTE, _BACKSLASH = 0x22, 0x5C
# Keywords under which a subschema's place in the answer is not named by the answer alone (or
# which add conditions on a string that counting would not keep): their subtrees keep maxLength.
_BRANCHING = frozenset({"anyOf", "oneOf", "allOf", "not", "if", "then", "else", "dependentSchemas",
                        "patternProperties", "contains", "unevaluatedProperties", "unevaluatedItems",
                        "propertyNames", "$dynamicRef", "$recursiveRef"})
_SHAPED = frozenset({"pattern", "format", "enum", "const", "contentEncoding", "contentMediaType"})
# What may sit beside a $ref that is inlined: words for readers, and the root's definitions.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "$schema", "$defs", "definitions"})
# How many $refs deep a relaxed string may sit: a recursive schema keeps maxLength below that.
MAX_REF_DEPTH = 8


@dataclass(eq=False)  # compared (and hashed) by identity: a walk state's signature holds them
class Bounds:
    """Where an answer's relaxed strings lie at and below one of its values."""

    max_chars: int | None = None  # this value, when a string, has at most this many characters
    properties: dict[str, "Bounds"] = field(default_factory=dict)
    additional: "Bounds | None" = None  # any other property's value
    items: "Bounds | None" = None  # every array item after the ``prefix`` ones
    prefix: tuple["Bounds | None", ...] = ()
    least: int = 0  # at the root: the smallest max_chars of the tree (StringBudget.cap)

    def child(self, key: str) -> "Bounds | None":
        return self.properties.get(key, self.additional)

    def item(self, index: int) -> "Bounds | None":
        return self.prefix[index] if index < len(self.prefix) else self.items


def relax(schema: Any) -> tuple[Any, Bounds | None]:
    """``schema`` without the ``maxLength`` of the strings whose place the answer names, and where
    those are (None, with ``schema`` itself, when there are none)."""
    relaxed, bounds = _relax(schema, schema, 0)
    if bounds is not None:
        bounds.least = min(_all_max_chars(bounds))
    return relaxed, bounds


def _all_max_chars(b: Bounds | None) -> list[int]:
    if b is None:
        return []
    out = [] if b.max_chars is None else [b.max_chars]
    for sub in (*b.properties.values(), b.additional, b.items, *b.prefix):
        out += _all_max_chars(sub)
    return out


def _relax(node: Any, root: Any, depth: int) -> tuple[Any, Bounds | None]:
    if isinstance(node, dict) and (union := _string_or_other(node)) is not None:
        key, branches, i = union
        relaxed, bounds = _relax(branches[i], root, depth)
        if bounds is None:
            return node, None
        return {**node, key: [relaxed if j == i else b for j, b in enumerate(branches)]}, bounds
    if not isinstance(node, dict) or _BRANCHING & node.keys():
        return node, None
    if "$ref" in node:
        target = _local_def(root, node["$ref"])
        beside = {k: v for k, v in node.items() if k != "$ref"}
        if target is None or not _ANNOTATIONS.issuperset(beside) or depth >= MAX_REF_DEPTH:
            return node, None
        relaxed, bounds = _relax(target, root, depth + 1)
        # The root's $defs stay where the inlined schema's own references look for them.
        return ({**relaxed, **beside}, bounds) if bounds is not None else (node, None)
    out, bounds = dict(node), Bounds()
    limit, least = node.get("maxLength"), node.get("minLength", 0)
    types = node.get("type")
    if ((types == "string" or isinstance(types, list) and "string" in types) and _count(limit) and _count(least)
            and least <= limit and not _SHAPED & node.keys()):
        del out["maxLength"]
        bounds.max_chars = limit
    props = node.get("properties")
    if isinstance(props, dict):
        relaxed = {}
        for key, sub in props.items():
            relaxed[key], found = _relax(sub, root, depth)
            if found is not None:
                bounds.properties[key] = found
        if bounds.properties:
            out["properties"] = relaxed
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"], bounds.additional = _relax(node["additionalProperties"], root, depth)
    if isinstance(node.get("items"), dict):
        out["items"], bounds.items = _relax(node["items"], root, depth)
    if isinstance(node.get("prefixItems"), list):
        pairs = [_relax(sub, root, depth) for sub in node["prefixItems"]]
        if any(found is not None for _, found in pairs):
            out["prefixItems"] = [sub for sub, _ in pairs]
            bounds.prefix = tuple(found for _, found in pairs)
    if (bounds.max_chars is None and not bounds.properties and bounds.additional is None and bounds.items is None
            and not bounds.prefix):
        return node, None
    return out, bounds


def _string_or_other(node: dict) -> tuple[str, list, int] | None:
    """For ``anyOf``/``oneOf`` (beside annotations only) of one plain string and branches of other
    types (pydantic's ``Optional[constr(max_length=n)]``: a string or null): the keyword, its
    branches and the string's index. A value that opens a quote there can only be that string."""
    keys = [k for k in ("anyOf", "oneOf") if k in node]
    if len(keys) != 1 or not _ANNOTATIONS.issuperset(set(node) - {keys[0]}) or not isinstance(node[keys[0]], list):
        return None
    branches = node[keys[0]]
    strings = [i for i, b in enumerate(branches) if isinstance(b, dict) and b.get("type") == "string"]
    others = [b for i, b in enumerate(branches) if i not in strings]
    if len(strings) != 1 or not all(isinstance(b, dict) and _not_string(b) for b in others):
        return None
    return keys[0], branches, strings[0]


def _not_string(branch: dict) -> bool:
    """Whether no value of ``branch`` is a string: its own type says so and nothing else could add one."""
    types = branch.get("type")
    types = [types] if isinstance(types, str) else types
    return (isinstance(types, list) and bool(types) and "string" not in types
            and not ({"enum", "const", "$ref"} | _BRANCHING) & branch.keys())


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _local_def(root: Any, ref: Any) -> Any:
    """The subschema a ``#/$defs/Name`` (or ``#/definitions/Name``) reference names; None for any
    other reference."""
    if not isinstance(ref, str) or not isinstance(root, dict):
        return None
    for where in ("$defs", "definitions"):
        prefix = f"#/{where}/"
        name = ref[len(prefix):] if ref.startswith(prefix) else None
        if name and "/" not in name and "~" not in name and isinstance(root.get(where), dict):
            return root[where].get(name)
    return None


def _step(state: int, byte: int) -> tuple[int, int, bool]:
    """Inside a JSON string, a byte read in ``state``: the next state, the characters it starts (an
    escape counts once, at its backslash; a UTF-8 character at its lead byte) and whether it is the
    closing quote."""
    if state == CONTENT:
        if byte == _QUOTE:
            return CONTENT, 0, True
        if byte == _BACKSLASH:
            return ESCAPED, 1, False
        return CONTENT, int(byte & 0xC0 != 0x80), False
    if state == ESCAPED:
        return (HEX4 if byte == ord("u") else CONTENT), 0, False
    return (CONTENT if state == HEX1 else state + 1), 0, False


def _opened_chars(token: bytes, mode: int) -> int:
    """The most characters ``token``, read from ``mode``, puts into any string it opens itself."""
    inside, state, count, most = mode != OUTSIDE, (mode if mode != OUTSIDE else CONTENT), 0, 0
    opened = False  # the string it is in was opened by this token
    for byte in token:
        if not inside:
            if byte == _QUOTE:
                inside, state, count, opened = True, CONTENT, 0, True
            continue
        state, chars, closes = _step(state, byte)
        if closes:
            inside = False
        elif opened:
            count += chars
            most = max(most, count)
    return most


class LengthCaps:
    """For one vocabulary: each token's bytes, and for each string state the characters each token
    puts into the string before its closing quote (all of them where it does not close it). A cap
    is the packed row (32 tokens a word, as llguidance's masks) of the tokens that fit a count."""

    MAX_VERDICTS = 65536  # walk states whose verdicts are kept (a few hundred bytes each)

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        n = min(vocab_size, tokenizer.vocab_size)
        self.token_bytes = [b"" if tokenizer.is_special_token(i) else tokenizer.decode_bytes([i]) for i in range(n)]
        self.token_bytes += [b""] * (vocab_size - n)
        words = (vocab_size + 31) // 32
        lengths = numpy.array([len(b) for b in self.token_bytes], dtype=numpy.int64)
        ends = numpy.cumsum(lengths)
        starts = ends - lengths
        flat = numpy.frombuffer(b"".join(self.token_bytes), dtype=numpy.uint8)
        # Per token, vectorized: the characters it starts (UTF-8 lead bytes) and whether it holds a
        # quote or a backslash (those few are walked byte by byte below).
        lead = numpy.concatenate([[0], numpy.cumsum((flat & 0xC0) != 0x80)])
        marks = numpy.concatenate([[0], numpy.cumsum((flat == _QUOTE) | (flat == _BACKSLASH))])
        chars = lead[ends] - lead[starts]
        self.before_close = numpy.zeros((6, words * 32), dtype=numpy.int32)
        self.before_close[CONTENT, :vocab_size] = chars
        firsts = numpy.array([b[0] if b else 0 for b in self.token_bytes], dtype=numpy.int64)
        # In an escape the first bytes belong to it (counted at its backslash): \u takes 5, others 1.
        for state, skip in ((ESCAPED, numpy.where(firsts == ord("u"), 5, 1)), (HEX4, 4), (HEX3, 3), (HEX2, 2), (HEX1, 1)):
            taken = numpy.minimum(skip, lengths)
            self.before_close[state, :vocab_size] = chars - (lead[starts + taken] - lead[starts])
        # A token with content only, in a string's content: its characters (-1: it holds a quote or a backslash).
        self.plain = numpy.where(marks[ends] - marks[starts] > 0, -1, chars).astype(numpy.int64).tolist()
        for i in numpy.flatnonzero(marks[ends] - marks[starts]):
            for state in range(6):
                self.before_close[state, i] = self._walk(self.token_bytes[i], state)
        self._longest = self.before_close.max(axis=1).tolist()
        self.words = words
        self._caps: dict[tuple[int, int], numpy.ndarray] = {}
        # Per token with a quote and each place it may start (a string state, or OUTSIDE one): the
        # most characters it puts into a string it opens itself (cap() checks the string it starts in).
        self.quoted = [i for i, b in enumerate(self.token_bytes) if _QUOTE in b]
        self._opened = [[_opened_chars(self.token_bytes[t], mode) for t in self.quoted] for mode in range(7)]
        self._risky: dict[tuple[int, int], list[int]] = {}
        self.verdicts: dict[tuple, tuple[int, ...]] = {}  # StringBudget._signature -> the tokens it refused

    def risky(self, mode: int, least: int) -> list[int]:
        """The tokens that, starting in ``mode`` (a string state or OUTSIDE), put more than ``least``
        characters into a string they open: those a walk tries before it allows them."""
        got = self._risky.get((mode, least))
        if got is None:
            got = [t for t, n in zip(self.quoted, self._opened[mode]) if n > least]
            self._risky[(mode, least)] = got
        return got

    @staticmethod
    def _walk(token: bytes, state: int) -> int:
        counted = 0
        for byte in token:
            state, chars, closes = _step(state, byte)
            if closes:
                break
            counted += chars
        return counted

    def cap(self, state: int, left: int) -> numpy.ndarray | None:
        """The packed row of tokens that put at most ``left`` characters into a string in ``state``
        before closing it; None where every token fits."""
        if left >= self._longest[state]:
            return None
        key = (state, left)
        got = self._caps.get(key)
        if got is None:  # a race between threads builds the same row twice: harmless
            got = numpy.packbits(self.before_close[state] <= left, bitorder="little").view(numpy.int32)
            self._caps[key] = got
        return got


class StringBudget:
    """One row's walk through its JSON answer, token by token: which value it is in, and in a relaxed
    string, how many characters are left. Only the JSON's structure is followed (brackets, keys,
    commas, quotes and escapes): the grammar, which every token already passed, keeps it valid.

    ``cap()`` cuts the tokens without a quote by ``LengthCaps`` alone: they stay in the string they
    start in. A token with a quote can also open a string (`` "abc``, ``": "x``); where it would
    put more characters into one than the schema's smallest bound, it is tried on a copy of the
    walk, once per walk state (with SmolLM2's vocabulary: none with bounds of 3 or more, 5 tokens
    with a bound of 2, 112 with a bound of 0)."""

    def __init__(self, bounds: Bounds, caps: LengthCaps) -> None:
        self._caps = caps
        self._least = bounds.least
        self._frames: list[list[Any]] = []  # [bounds of the container, is an object, expects a key / item index]
        self._next: Bounds | None = bounds  # the bounds of the value that starts next
        self._in_string = self._in_scalar = False
        self._state = CONTENT
        self._left = -1  # characters left in the open string; -1 where it has no bound
        self._key: bytearray | None = None  # the raw text of the object key being read
        self._over = False  # a relaxed string got more characters than its bound (a tried token's verdict)

    def feed(self, token: int) -> None:
        """Advance past ``token`` (already accepted by the grammar)."""
        caps = self._caps
        if self._in_string and self._state == CONTENT:
            chars = caps.plain[token]
            if chars >= 0:  # content only: the common case, without a walk of its bytes
                if self._left >= 0:
                    self._left -= chars
                elif self._key is not None:
                    self._key += caps.token_bytes[token]
                return
        for byte in caps.token_bytes[token]:
            self._byte(byte)

    def cap(self) -> numpy.ndarray | None:
        """The packed row of the tokens that keep every relaxed string within its bound from here;
        None where all of them do."""
        caps = self._caps
        bounded = self._in_string and self._left >= 0
        base = caps.cap(self._state, self._left) if bounded else None
        risky = caps.risky(self._state if self._in_string else OUTSIDE, self._least)
        refused: tuple[int, ...] = ()
        if risky:  # tried once per place in a schema: the verdicts are kept by the walk's state
            key = self._signature()
            refused = caps.verdicts.get(key)  # type: ignore[assignment]
            if refused is None:
                refused = tuple(t for t in risky if not self._fits(caps.token_bytes[t]))
                if len(caps.verdicts) >= caps.MAX_VERDICTS:
                    caps.verdicts.clear()
                caps.verdicts[key] = refused
        if not refused:
            return base
        row = base.copy() if base is not None else numpy.full(caps.words, -1, dtype=numpy.int32)
        bits = row.view(numpy.uint32)
        for t in refused:
            bits[t >> 5] &= numpy.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
        return row

    def _signature(self) -> tuple:
        """What decides which tokens with a quote fit from here: the string or value the walk is in
        and the containers around it (an array item's index only among its ``prefix`` items). The
        bounds in it are the schema's own objects (``GrammarSpec.bounds`` is one per schema text)."""
        frames = tuple((f[0], f[1], f[2] if f[1] or f[0] is None else min(f[2], len(f[0].prefix)))
                       for f in self._frames)
        return (self._in_string, self._in_scalar, self._state, self._left,
                bytes(self._key) if self._key is not None else None, self._next, frames)

    def _fits(self, token: bytes) -> bool:
        """Whether ``token`` keeps every relaxed string within its bound, tried on a copy of this walk."""
        trial = copy.copy(self)
        trial._frames = [f[:] for f in self._frames]
        trial._key = bytearray(self._key) if self._key is not None else None
        for byte in token:
            trial._byte(byte)
            if trial._over:
                return False
        return True

    def _byte(self, byte: int) -> None:
        if self._in_string:
            self._state, chars, closes = _step(self._state, byte)
            if closes:
                self._in_string = False
            elif self._left >= 0:
                self._left -= chars
                self._over = self._over or self._left < 0
            elif self._key is not None:
                self._key.append(byte)
            return
        if self._in_scalar:
            if byte not in b",]} \t\r\n":
                return
            self._in_scalar = False
        top = self._frames[-1] if self._frames else None
        if byte in b" \t\r\n":
            return
        if byte == ord("{"):
            self._frames.append([self._next, True, True])
        elif byte == ord("["):
            self._frames.append([self._next, False, 0])
            self._next = self._next.item(0) if self._next is not None else None
        elif byte == _QUOTE:
            self._in_string, self._state, self._left = True, CONTENT, -1
            if top is not None and top[1] and top[2]:  # an object's key
                self._key = bytearray()
                top[2] = False
            else:
                self._key = None
                if self._next is not None and self._next.max_chars is not None:
                    self._left = self._next.max_chars
        elif byte == ord(":") and top is not None and top[1]:
            try:
                key = json.loads(b'"' + bytes(self._key or b"") + b'"')
            except ValueError:  # only a tried token can get here with a broken key: the grammar refuses it
                key = ""
            self._key = None
            self._next = top[0].child(key) if top[0] is not None else None
        elif byte == ord(",") and top is not None:
            if top[1]:
                top[2] = True
            else:
                top[2] += 1
                self._next = top[0].item(top[2]) if top[0] is not None else None
        elif byte in b"}]":
            if self._frames:
                self._frames.pop()
        else:  # a number, true, false or null
            self._in_scalar = True
