"""Reading an OpenAI-style server-sent-events stream as it arrives: when each token came, how many.

servekit's LLM handler (and any OpenAI-compatible server) answers `"stream": true` with events
`data: {json}` separated by blank lines, ending with `data: [DONE]`. A chat chunk carries text in
`choices[0].delta.content` (a completion chunk in `choices[0].text`), the last one a
`finish_reason`, and with `"stream_options": {"include_usage": true}` one more event holds
`usage.completion_tokens`. Free of gevent and locust, so the arithmetic is testable on its own.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol


class LineReader(Protocol):
    def readline(self, sep: bytes) -> bytes: ...


@dataclass
class StreamTally:
    """What one streamed answer delivered, fed line by line with the time each line was read.

    A token event is one with text or a finish reason: the finish event marks the step of the last
    token, which sends no text when it is the stop token. `first` and `last` are the times of the
    first and last token events; `tokens` is the usage chunk's count, else the text events counted
    (a lower bound: a stop token, or several tokens in one event, are not seen)."""

    first: float = math.nan
    last: float = math.nan
    text_events: int = 0
    usage_tokens: int | None = None
    done: bool = False

    def line(self, raw: bytes, t: float) -> None:
        if not raw.startswith(b"data:"):
            return  # blank separators, comments, `event:`/`id:` fields
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        event = json.loads(payload)
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        text, finished = _token_event(event)
        if text:
            self.text_events += 1
        if text or finished:
            if math.isnan(self.first):
                self.first = t
            self.last = t

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.text_events

    @property
    def complete(self) -> bool:
        """The stream reached `[DONE]` after at least one token."""
        return self.done and not math.isnan(self.first)

    def fields(self) -> tuple[float, float, float]:
        """(first, last, tokens) as stored after the five common fields of a record."""
        return self.first, self.last, float(self.tokens)


def _token_event(event: Any) -> tuple[str, bool]:
    """(text, has a finish reason) of one chunk's first choice."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return "", False
    choice = choices[0]
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return (text if isinstance(text, str) else ""), choice.get("finish_reason") is not None


def read_events(stream: LineReader, tally: StreamTally, clock: Callable[[], float]) -> None:
    """Read `stream` line by line into `tally` until `data: [DONE]` or the end of the response.
    Stops at `[DONE]` without waiting for the rest of the HTTP response: TorchServe keeps a
    streamed answer open until every request of its batch has finished."""
    while not tally.done:
        line = stream.readline(b"\n")
        if not line:
            return
        tally.line(line, clock())
