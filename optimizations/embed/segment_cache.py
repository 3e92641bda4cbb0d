"""Tokenizing text segment by segment, with each whitespace-delimited segment's token ids cached.

For a tokenizer whose normalizer works character by character and whose pre-tokenizer splits at
whitespace (BERT's WordPiece family: all-MiniLM, e5, bge, ...), a text's tokens are the concatenation
of the tokens of its whitespace-delimited segments ("word", "(e.g.", "end."). Natural text repeats
its segments heavily, so once warm most of a text is dictionary lookups. The library's whole
pipeline (normalizer with alignment tracking, pre-tokenizer, model) runs only for segments not seen
before and for the texts this cannot vouch for. On an H100 host's core, 512 payload texts (each met
twice) took 12.3 ms instead of 95.4 ms; text met for the first time costs about what the library
costs (benchmarks/results/worker-overhead-h100).

Which texts go whole to the library, unchanged:
- texts holding a control character that Python's `str.split()` and the tokenizer disagree about
  (vertical tab, form feed, U+001C-U+001F, U+0085: whitespace to one, removed or kept by the other);
- texts holding an added token's text ("[CLS]", "<mask>"): the library matches those across
  segments before normalizing.
Every other tokenizer family (byte-level BPE and SentencePiece attach the space to the next token)
keeps the library for every text. A tokenizer that qualifies by its configuration is also checked
by behaviour at start: segment-wise ids must equal the library's on probe texts, else this stays off.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
from typing import Iterable, Sequence

from tokenizers import Tokenizer

log = logging.getLogger(__name__)

# Character-local normalizers: a segment normalizes the same alone as inside its text.
SAFE_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFD", "NFKD", "NFC", "NFKC", "StripAccents"}
# Pre-tokenizers that split at every whitespace character and never join across it.
SAFE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
# Models that tokenize each pre-token on its own.
SAFE_MODELS = {"WordPiece", "WordLevel", "BPE", "Unigram"}
# str.split() splits at these; the tokenizers (char::is_whitespace, BertNormalizer's clean_text) do not
# agree with it on all of them.
SPLIT_DISAGREES = re.compile("[\x0b\x0c\x1c-\x1f\x85]")
PROBES = (
    "Hello, world! The quick brown fox (e.g. a vulpine) jumps over 13 lazy dogs...",
    "naïve café résumé — “quotes” ‘and’ Ünïcödé; 東京は晴れ 123,456.78%",
    "tab\tseparated\nlines\r\nand  double  spaces\u00a0nbsp\u2003em-space",
    "zero\u200bwidth soft\u00adhyphen control\x01char hyphen-ated don't #tag @user http://x.io/a?b=c",
    "a" * 150 + " " + "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "",
    "   ",
)


def _types(node: dict | None, children: str) -> list[str]:
    """The component types of a tokenizer.json section, a Sequence flattened."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [t for child in node.get(children, []) for t in _types(child, children)]
    return [str(node.get("type"))]


def segment_wise(tokenizer: Tokenizer) -> str | None:
    """None if the tokenizer's configuration tokenizes whitespace-delimited segments independently,
    else the reason it does not."""
    cfg = json.loads(tokenizer.to_str())
    unsafe = [t for t in _types(cfg.get("normalizer"), "normalizers") if t not in SAFE_NORMALIZERS]
    if unsafe:
        return f"normalizer {', '.join(unsafe)} is not character-local"
    pre = _types(cfg.get("pre_tokenizer"), "pretokenizers")
    if not pre or any(t not in SAFE_PRE_TOKENIZERS for t in pre):
        return f"pre-tokenizer {', '.join(pre) or 'none'} does not split at whitespace alone"
    model = (cfg.get("model") or {}).get("type")
    if model not in SAFE_MODELS:
        return f"model {model} is not per word"
    return None


class SegmentCache:
    """`encode(texts)` -> each text's token ids without special tokens, as
    `tokenizer.encode_batch_fast(texts, add_special_tokens=False)` gives them."""

    def __init__(self, tokenizer: Tokenizer, max_entries: int, probes: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._ids: dict[str, tuple[int, ...]] = {}
        self.lookups = self.misses = self.whole = 0
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content]
        # What sends a text whole to the library, in one pass over it: a character split() and the
        # tokenizer disagree about, or an added token's text (two searches per text were 5% of a rerank
        # worker's busy time: 101 texts per request, H100 host, py-spy).
        self._whole = re.compile("|".join([SPLIT_DISAGREES.pattern,
                                           *map(re.escape, sorted(added, key=len, reverse=True))]), re.IGNORECASE)
        self._marker: tuple[str, int] | None = None
        self.off_reason = segment_wise(tokenizer) if max_entries > 0 else "tokenizer_cache is 0"
        if self.off_reason is None:
            self._marker = self._find_marker()
            self.off_reason = self._check(list(PROBES) + list(probes))
            self._ids.clear()
            self.lookups = self.misses = self.whole = 0
        if self.off_reason is not None and max_entries > 0:
            log.info("segment cache off, every text goes through the tokenizer: %s", self.off_reason)

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    def _library(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    def _find_marker(self) -> tuple[str, int] | None:
        """A special token that stands alone between two segments and that no text produces by itself
        (not the unknown token): new segments are tokenized joined by it, in one encoding per group."""
        plain = self._library(["a", "b"])
        unk = getattr(self.tokenizer.model, "unk_token", None)
        for token_id, token in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            if token.special and token.content and token.content != unk:
                if self._library([f"a {token.content} b"])[0] == plain[0] + [token_id] + plain[1]:
                    return token.content, token_id
        return None

    def _resolve(self, segments: list[str]) -> list[tuple[int, ...]]:
        """Token ids of segments not cached yet. Joined by the marker, 512 to a string, they cost one
        encoding per string: the library's fixed cost per encoding was most of a short segment's
        (2-core VM, MiniLM, segments of a 5,000-paragraph corpus: 12 µs per segment one encoding
        each, 7.5 µs joined)."""
        if self._marker is None:
            return [tuple(ids) for ids in self._library(segments)]
        content, marker = self._marker
        groups = [segments[k:k + 512] for k in range(0, len(segments), 512)]
        out: list[tuple[int, ...]] = []
        for group, ids in zip(groups, self._library([f" {content} ".join(g) for g in groups])):
            cuts = [i for i, t in enumerate(ids) if t == marker]
            if len(cuts) != len(group) - 1:  # not expected (the start-up check saw it split): one by one
                out.extend(tuple(x) for x in self._library(group))
                continue
            out.extend(tuple(ids[a:b]) for a, b in zip([0] + [c + 1 for c in cuts], cuts + [len(ids)]))
        return out

    def _check(self, texts: list[str]) -> str | None:
        for text, want, got in zip(texts, self._library(texts), self._segmented(texts)):
            if want != got:
                return f"segment-wise ids differ from the tokenizer's on {text[:60]!r}"
        return None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        if not self.enabled:
            return self._library(texts)
        return self._segmented(texts)

    def _segmented(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int] | None] = [None] * len(texts)
        whole: list[int] = []
        pending: list[tuple[int, list[str]]] = []  # texts with a segment not cached yet
        whole_text = self._whole.search
        cache = self._ids
        lookup = cache.__getitem__
        chain = itertools.chain.from_iterable
        # One pass over the texts looks their segments up; only texts with a new segment take a
        # second (once warm most texts take none: the pass that first collected every uncached
        # segment of a batch cost as much as the lookups themselves).
        for i, text in enumerate(texts):
            if whole_text(text):
                whole.append(i)
                continue
            segs = text.split()
            self.lookups += len(segs)
            try:
                out[i] = list(chain(map(lookup, segs)))
            except KeyError:
                pending.append((i, segs))
        if pending:
            new = {s for _, segs in pending for s in segs if s not in cache}
            if len(cache) + len(new) > self.max_entries:
                cache.clear()  # bounded memory: start again rather than track recency per lookup
                new = {s for _, segs in pending for s in segs}  # texts looked up already keep their ids
            new_list = list(new)
            cache.update(zip(new_list, self._resolve(new_list)))
            self.misses += len(new_list)
            for i, segs in pending:
                out[i] = list(chain(map(lookup, segs)))
        if whole:
            self.whole += len(whole)
            for i, ids in zip(whole, self._library([texts[i] for i in whole])):
                out[i] = ids
        return out  # type: ignore[return-value]
