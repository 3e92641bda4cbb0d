"""The LLM benchmarks' prompt sets (benchmarks/llm_prompts.py): lengths in SmolLM2's tokens, every
prompt a different text, the same prompts from the same seed."""
from __future__ import annotations

import json

import pytest
import torch

from servekit.benchmarks import llm_prompts
from servekit.benchmarks.llm_prompts import MIXED_TOKENS, PASSAGE_TOKENS, PromptGenerator, tokenizer_counter


@pytest.fixture(scope="module")
def count():
    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    return tokenizer_counter(smollm2_archive_files(torch.bfloat16)[0].parent)


@pytest.fixture(scope="module")
def sets(count) -> dict[str, list[llm_prompts.Prompt]]:
    gen = PromptGenerator(seed=3, count_tokens=count)
    return {"short": gen.short(40), "passages": gen.passages(40), "mixed": gen.mixed(60),
            "conversation": gen.conversation(3)}


def test_lengths_in_tokens(sets, count) -> None:
    def tokens(p: llm_prompts.Prompt) -> int:
        return sum(count(m["content"]) for m in p.messages)

    assert all(len(p.text.split()) <= 60 for p in sets["short"])
    assert all(PASSAGE_TOKENS[0] <= tokens(p) <= PASSAGE_TOKENS[1] for p in sets["passages"])
    mixed = [tokens(p) for p in sets["mixed"]]
    assert MIXED_TOKENS[0] <= min(mixed) and max(mixed) <= MIXED_TOKENS[1]
    assert min(mixed) < 100 and max(mixed) > 700, "log-uniform lengths span the range"
    for p in sets["mixed"]:  # prompt + answer fit the default 2,048-token context with the template
        assert p.tokens == tokens(p) and p.tokens + p.max_tokens + 40 <= 2048
    for conv in sets["conversation"]:
        roles = [m["role"] for m in conv.messages]
        assert roles[0] == "system" and roles[-1] == "user" and "assistant" in roles
        assert 1450 <= tokens(conv) <= 1550 and conv.followup


def test_every_prompt_is_a_different_text(sets) -> None:
    texts = [p.text for ps in sets.values() for p in ps]
    assert len(set(texts)) == len(texts)
    # no two single-turn prompts share their first 400 characters (a long common prefix)
    heads = [p.text[:400] for name in ("short", "passages", "mixed") for p in sets[name]]
    assert len(set(heads)) == len(heads)


def test_same_seed_same_prompts(count) -> None:
    a, b, c = (PromptGenerator(seed, count).mixed(5) for seed in (7, 7, 8))
    assert [p.messages for p in a] == [p.messages for p in b]
    assert not {p.text for p in a} & {p.text for p in c}


def test_bodies_are_streamed_greedy_chat(sets) -> None:
    body = json.loads(llm_prompts.chat_bodies(sets["passages"][:1])[0])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["messages"][0]["role"] == "user"
    assert body["max_tokens"] == sets["passages"][0].max_tokens
