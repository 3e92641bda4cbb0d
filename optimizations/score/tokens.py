"""Model inputs of (query, document) pairs and single texts, assembled from each text's own tokens.

A fast tokenizer encodes a pair in three steps: each text alone (normalizer, pre-tokenizer,
model), then `longest_first` truncation of the two to the limit less the special tokens, then the
post-processor's template around them (BERT: [CLS] A [SEP] B [SEP], token types 0 then 1). The
score runner did all three in the library for every pair, so a rerank request of one query and
100 documents tokenized the query 100 times, and reading each encoding's fields back into Python
cost about as much again. Here each distinct text of a batch is tokenized once, through the
embedding runner's segment cache (optimizations/embed/segment_cache.py), and the template is applied
in Python: a pair that fits is then a few list slices.

An input that does not fit the limit is encoded by the library itself, truncation included: how
`longest_first` splits the room between two texts is the library's to define (assembling it here
once failed the start-up check on a GPU machine's tokenizers build, which sent every pair of every
request to the library), and such inputs are rare in rerank traffic. Whether an
assembled input was cut is known from its texts' token counts.

The result is checked at start against the library's own encodings on probe texts of every length
relation to the limit (both short, one or both over it, equal lengths); a tokenizer whose template
is not "specials, first text, specials, second text, specials", or that differs on any probe, keeps
the library's pair encoding for every input.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from tokenizers import Encoding, Tokenizer

from servekit.optimizations.embed.segment_cache import PROBES, SegmentCache
from servekit.optimizations.models.errors import UnsupportedModel

log = logging.getLogger(__name__)
# Tokens of one batch of inputs: ids; each input's token types as the position where type 1
# starts (its length where none is 1: types are 0s, then 1s to the end); whether truncation cut it.
Tokens = tuple[list[list[int]], list[int], list[bool]]


def _bert_types(single: "Template", pair: "Template") -> bool:
    """Whether a single text is all type 0 and a pair 0 through the specials after its first text,
    then 1: type 1 then starts right after them in every assembled pair."""
    before, between, after = pair.types
    return (set(single.types[0] + single.types[1]) <= {0} and single.text_types == (0,)
            and set(before + between) <= {0} and set(after) <= {1} and pair.text_types == (0, 1))


@dataclass(frozen=True)
class Template:
    """What the post-processor puts around one text (`a`) or a pair (`a`, `b`): the special tokens'
    ids and types before, between and after the texts, and each text's token type."""

    ids: tuple[tuple[int, ...], ...]    # single: (before, after); pair: (before, between, after)
    types: tuple[tuple[int, ...], ...]
    text_types: tuple[int, ...]         # single: (a,); pair: (a, b)

    @property
    def added(self) -> int:
        return sum(map(len, self.ids))


def _template(encoding: Encoding, n_texts: int) -> Template | None:
    """The template of a probe encoding of one or two texts, or None if its layout is not specials
    around contiguous texts in their order, each text of one token type."""
    seq = encoding.sequence_ids
    spans = []
    for k in range(n_texts):
        at = [i for i, s in enumerate(seq) if s == k]
        if not at or at != list(range(at[0], at[-1] + 1)):
            return None
        spans.append((at[0], at[-1] + 1))
    if n_texts == 2 and spans[0][1] > spans[1][0]:
        return None
    ids, types = encoding.ids, encoding.type_ids
    cuts = [0] + [x for span in spans for x in span] + [len(ids)]
    text_types = tuple({types[i] for i in range(a, b)} for a, b in spans)
    if any(len(t) != 1 for t in text_types):
        return None
    gaps = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)]
    if any(s is not None for a, b in gaps for s in seq[a:b]):
        return None
    return Template(tuple(tuple(ids[a:b]) for a, b in gaps), tuple(tuple(types[a:b]) for a, b in gaps),
                    tuple(t.pop() for t in text_types))


def type_split(type_ids: Sequence[int]) -> int:
    """The position where a row's token types turn from 0 to 1 (its length if they never do);
    UnsupportedModel if they are not 0s then 1s, which no BERT template gives."""
    n = len(type_ids)
    at = type_ids.index(1) if 1 in type_ids else n
    if type_ids.count(0) != at or type_ids.count(1) != n - at:
        raise UnsupportedModel(f"the tokenizer gives token types {list(type_ids)[:12]} for an input: served "
                               "models' token types are 0s, then 1s to the end (BERT's pairs)")
    return at


def _probe_inputs(tokenizer: Tokenizer, max_tokens: int, extra: Sequence[str]) -> list[str | tuple[str, str]]:
    """Texts and pairs on every side of the limit: the segment cache's probes and `extra` alone and
    paired, and pairs of word runs whose lengths fall short of, reach and pass the room, equal and
    unequal, the room odd and even."""
    word = "serving"
    per_word = max(1, len(tokenizer.encode(word, add_special_tokens=False).ids))
    texts = [*PROBES, *extra]
    out: list[str | tuple[str, str]] = list(texts)
    out += [(a, b) for a in texts[:12] for b in texts[:12]]
    for n1, n2 in ((0, 0), (1, 0), (0, 1), (3, 5), (max_tokens, 0), (0, max_tokens), (max_tokens, 2),
                   (2, max_tokens), (max_tokens, max_tokens), (max_tokens + 1, max_tokens), (max_tokens // 2, max_tokens),
                   (max_tokens // 2 - 1, max_tokens // 2), (max_tokens // 2 - 2, max_tokens // 2 + 1),
                   (max_tokens // 2 + 1, max_tokens // 2 - 3), (max_tokens - 5, 3), (4, max_tokens - 6)):
        a, b = " ".join([word] * (n1 // per_word)), " ".join([word] * (n2 // per_word))
        out += [(a, b), (a + " x", b), a]
    return out


class PairTokenizer:
    """Texts and (first, second) pairs -> model input ids, token types and which were cut, equal to
    the tokenizer's own encoding with `longest_first` truncation at `max_tokens`.

    `tokenizer` must not truncate (load_tokenizer's); `typed`: pass the template's token types (a
    BERT pair's second text 1), else all 0. `cache_entries` bounds the segment cache (0: off).
    Token types come as one position per input (`Tokens`); a typed tokenizer whose types are not 0s
    then 1s is refused here (UnsupportedModel), not at its first request."""

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, typed: bool, cache_entries: int,
                 probes: Sequence[str] = ()) -> None:
        self.max_tokens, self.typed = max_tokens, typed
        self.library = Tokenizer.from_str(tokenizer.to_str())  # the reference, and the fallback
        self.library.enable_truncation(max_tokens, strategy="longest_first")
        self.segments = SegmentCache(tokenizer, cache_entries, probes=probes)
        self.single = _template(tokenizer.encode("a"), 1)
        self.pair = _template(tokenizer.encode("a", "b"), 2)
        self.off_reason: str | None = None
        probe_inputs = _probe_inputs(tokenizer, max_tokens, probes)
        # The reference the assembly is checked against; typed: UnsupportedModel for types that are
        # not 0s then 1s, whichever way inputs are then encoded.
        library = self.encode_library(probe_inputs)
        if self.single is None or self.pair is None:
            self.off_reason = "the post-processor's template is not specials around the texts in order"
        elif typed and not _bert_types(self.single, self.pair):
            self.off_reason = "the template's token types are not BERT's (0 through the first text's [SEP], then 1)"
        else:
            self.off_reason = self._check(probe_inputs, library)
        if self.off_reason is not None:
            log.info("pairs are encoded by the tokenizer's own pair encoding: %s", self.off_reason)

    @property
    def assembled(self) -> bool:
        """Whether inputs are assembled from each distinct text's tokens (else: the library's pair encoding)."""
        return self.off_reason is None

    def _check(self, inputs: list[str | tuple[str, str]], want: Tokens) -> str | None:
        got = self._assemble(inputs)
        for k, x in enumerate(inputs):
            if (want[0][k], want[1][k]) != (got[0][k], got[1][k]):
                return f"assembled tokens differ from the tokenizer's pair encoding on {str(x)[:60]!r}"
        return None

    def encode(self, inputs: Sequence[str | tuple[str, str]]) -> Tokens:
        return self._assemble(inputs) if self.assembled else self.encode_library(inputs)

    def encode_library(self, inputs: Sequence[str | tuple[str, str]]) -> Tokens:
        """The tokenizer's own encoding of every input, truncated `longest_first`."""
        encodings = self.library.encode_batch_fast(list(inputs))
        ids = [e.ids for e in encodings]
        splits = [type_split(e.type_ids) for e in encodings] if self.typed else [len(x) for x in ids]
        return ids, splits, [bool(e.overflowing) for e in encodings]

    def _assemble(self, inputs: Sequence[str | tuple[str, str]]) -> Tokens:
        texts = dict.fromkeys(t for x in inputs for t in ((x,) if isinstance(x, str) else x))
        own = dict(zip(texts, self.segments.encode(list(texts))))
        s_before, s_after = self.single.ids
        before, between, after = self.pair.ids
        # Where type 1 starts in an assembled pair: right after the specials that follow its first
        # text (BERT's layout, checked at start); untyped inputs and single texts have none.
        type1_after_a = len(before) + len(between) if self.typed else None
        s_room, p_room = self.max_tokens - self.single.added, self.max_tokens - self.pair.added
        ids: list[list[int]] = []
        splits: list[int] = []
        cut: list[bool] = []
        over: list[int] = []  # inputs past the limit: rows the library fills in, truncating them
        for x in inputs:
            if isinstance(x, str):
                a = own[x]
                fits = len(a) <= s_room
                row = [*s_before, *a, *s_after] if fits else []
                splits.append(len(row))
            else:
                a, b = own[x[0]], own[x[1]]
                fits = len(a) + len(b) <= p_room
                row = [*before, *a, *between, *b, *after] if fits else []
                splits.append(len(row) if type1_after_a is None else type1_after_a + len(a))
            ids.append(row)
            cut.append(not fits)
            if not fits:
                over.append(len(ids) - 1)
        if over:
            lib_ids, lib_splits, _ = self.encode_library([inputs[k] for k in over])
            for k, i, t in zip(over, lib_ids, lib_splits):
                ids[k], splits[k] = i, t
        return ids, splits, cut
