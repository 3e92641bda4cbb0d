"""A thinking model's thinking apart from its answer (handlers/llm_openai_reasoning.py): the split
of the text as it streams, cut anywhere. The OpenAI answers the LLM handler shapes from it are
tested in test_handlers_unit.py (``test_the_handler_answers_thinking_as_reasoning_content``)."""
from __future__ import annotations

import pytest

from servekit.handlers.llm_openai_reasoning import ThinkingSplit, prompt_opens_thinking, template_thinks

ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


def _split(text: str, inside: bool, cuts: list[int]) -> tuple[str, str]:
    split, thinking, answer = ThinkingSplit(inside), "", ""
    bounds = [0, *cuts, len(text)]
    for k in range(len(bounds) - 1):
        t, a = split.feed(text[bounds[k]:bounds[k + 1]], final=k == len(bounds) - 2)
        thinking, answer = thinking + t, answer + a
    return thinking, answer


def test_the_split_is_the_same_wherever_the_text_is_cut() -> None:
    want = ("\nThe user greets me.\n", "Hello! How can I help?")
    for i in range(len(ANSWER) + 1):
        for j in range(i, len(ANSWER) + 1, 7):
            assert _split(ANSWER, False, [i, j]) == want, (i, j)
    tagless = "The user greets me.</think>\n\nHi"  # a prompt that opened the block itself
    for i in range(len(tagless) + 1):
        assert _split(tagless, True, [i]) == ("The user greets me.", "Hi"), i


@pytest.mark.parametrize("text,inside,want", [
    ("Hello <think>x</think>", False, ("", "Hello <think>x</think>")),  # a block only at the start
    (" \n<think>a</think>b", False, ("a", "b")),  # after blank space
    ("still thinking </thi", True, ("still thinking </thi", "")),  # cut by max_tokens: all thinking
    ("<think>never closed", False, ("never closed", "")),
    ("\n\n", False, ("", "\n\n")),
    ("<thin", False, ("", "<thin")),  # ended on what could have been the tag
    ("<think></think>", False, ("", "")),
])
def test_the_split_of_odd_answers(text, inside, want) -> None:
    for i in range(len(text) + 1):
        assert _split(text, inside, [i]) == want, i


def test_templates_and_prompts() -> None:
    assert template_thinks("{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    assert not template_thinks("{{ messages }}")
    assert prompt_opens_thinking("<|user|>hi<|assistant|><think>\n")
    assert not prompt_opens_thinking("<|user|>hi<|assistant|><think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|user|>hi<|assistant|>")
