"""Reasoning models' thinking, apart from their answer: ``reasoning_content`` beside ``content``.

Models whose chat template writes ``</think>`` (Qwen3, SmolLM3, DeepSeek-R1's distills) think
first, between ``<think>`` and ``</think>``, then answer. vLLM's reasoning parsers and DeepSeek's API
return the thinking as ``reasoning_content`` and only the answer as ``content``, and clients built
for those servers read them so. Some templates open the block in the prompt themselves (Qwen3's
Thinking-2507 models), so the answer then starts inside it, without a ``<think>``.

The split works on the answer's text as it streams: a chunk that may be the start of a tag is held
until the next one tells. Under a structured output the grammar itself lets the model think first
(``GrammarSpec.think``) and holds from ``</think>`` on, as vLLM applies a grammar after the
reasoning parser's end.
"""
from __future__ import annotations

from servekit.optimizations.llm.grammar import MAY_THINK, THINKING

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(template_source: str) -> bool:
    """Whether a chat template's model thinks in ``<think>`` blocks (its template closes one)."""
    return CLOSE in template_source


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block its template opened."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def grammar_thinking(prompt: str) -> str:
    """A grammar's thinking block for a thinking model's rendered prompt (``GrammarSpec.think``):
    the block the prompt opened, one the model may open, or none where the prompt closed one
    (Qwen3's ``enable_thinking: false``)."""
    if prompt.rstrip().endswith(CLOSE):
        return ""
    return THINKING if prompt_opens_thinking(prompt) else MAY_THINK


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingSplit:
    """One answer's text split into thinking and answer as it streams: ``feed`` each new piece,
    then ``feed(..., final=True)`` once it ends. An answer that opens no block (after leading
    whitespace) is all answer; one that never closes its block, all thinking. The newlines between
    ``</think>`` and the answer are dropped."""

    def __init__(self, inside: bool) -> None:
        self.state = "thinking" if inside else "start"
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(thinking, answer) text to send now."""
        buf, thinking, answer = self.held + text, "", ""
        self.held = ""
        while buf:
            if self.state == "start":
                head = buf.lstrip()
                if head.startswith(OPEN):
                    buf, self.state = head[len(OPEN):], "thinking"
                elif not final and OPEN.startswith(head):  # blank so far, or part of the tag
                    self.held = buf
                    break
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = buf.find(CLOSE)
                if end >= 0:
                    thinking, buf, self.state = thinking + buf[:end], buf[end + len(CLOSE):], "after"
                    continue
                keep = 0 if final else _held(buf, CLOSE)
                thinking += buf[:len(buf) - keep]
                self.held = buf[len(buf) - keep:]
                break
            elif self.state == "after":
                buf = buf.lstrip("\n")
                if buf:
                    self.state = "answer"
            else:
                answer, buf = answer + buf, ""
        return thinking, answer  # (with ``final`` nothing is held)
