"""Streamed (LLM) figures of the auto-benchmark: reading server-sent events, TTFT / ITL / tokens/s
arithmetic and the SLA judge, on known inputs (no server)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from servekit.benchmarks.bench.measure import FAIL, PASS, judge
from servekit.benchmarks.bench.schema import SLA
from servekit.benchmarks.bench.sse import StreamTally
from servekit.benchmarks.bench.stats import (INCOMPLETE_STREAM, LLM_FIELDS, goodput, inter_token_ms, llm_summary,
                                             summarize)

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "smollm2"}


def event(delta: dict | None = None, finish: str | None = None, usage: int | None = None) -> bytes:
    """One `data:` line as servekit's LLM handler writes it."""
    if usage is not None:
        body = {**HEAD, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": usage,
                                                 "total_tokens": 9 + usage}}
    else:
        body = {**HEAD, "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body).encode() + b"\n"


def feed(tally: StreamTally, timed_lines: list[tuple[float, bytes]]) -> StreamTally:
    for t, line in timed_lines:
        tally.line(line, t)
        tally.line(b"\n", t)  # the blank line that ends each event
    return tally


# A chat stream of 5 tokens: the role chunk and the first text arrive together; a speculative step
# delivers two tokens in one chunk; the stop token sends no text, only the finish reason.
STREAM = [
    (0.50, event({"role": "assistant", "content": ""})),
    (0.50, event({"content": "Hello"})),
    (0.60, event({"content": " wide world"})),
    (0.70, event({"content": "!"})),
    (0.80, event(finish="stop")),
    (0.80, event(usage=5)),
    (0.80, b"data: [DONE]\n"),
]


def test_tally_of_a_chat_stream() -> None:
    t = feed(StreamTally(), STREAM)
    assert t.done and t.complete
    assert (t.first, t.last) == (0.50, 0.80)  # the empty role chunk is no token; the finish event is the last
    assert t.tokens == 5 and t.text_events == 3  # the usage chunk's count wins over counting
    assert t.fields() == (0.50, 0.80, 5.0)
    # (last - first) / (tokens - 1): 0.3 s over 4 gaps
    assert inter_token_ms(np.array([t.first]), np.array([t.last]), np.array([t.tokens]))[0] == pytest.approx(75.0)


def test_tally_without_usage_counts_text_events() -> None:
    t = feed(StreamTally(), [x for x in STREAM if b'"usage"' not in x[1]])
    assert t.complete and t.usage_tokens is None and t.tokens == 3


def test_tally_of_text_completions_and_truncated_streams() -> None:
    t = feed(StreamTally(), [(1.0, b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n'),
                             (1.5, b'data: {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}\n'),
                             (1.5, b"data: [DONE]\n")])
    assert (t.first, t.last, t.tokens, t.complete) == (1.0, 1.5, 2, True)
    cut = feed(StreamTally(), STREAM[:3])  # the connection ended before [DONE]
    assert not cut.complete and cut.first == 0.50 and cut.last == 0.60
    empty = feed(StreamTally(), [(0.1, b"data: [DONE]\n")])  # [DONE] without a single token
    assert empty.done and not empty.complete and math.isnan(empty.first)
    with pytest.raises(ValueError):
        StreamTally().line(b"data: {not json\n", 0.0)


def test_inter_token_latency() -> None:
    itl = inter_token_ms(np.array([0.0, 1.0, 2.0]), np.array([0.4, 1.0, 2.9]), np.array([5.0, 1.0, 4.0]))
    assert itl[0] == pytest.approx(100.0) and math.isnan(itl[1]) and itl[2] == pytest.approx(300.0)


def llm_records() -> np.ndarray:
    """(intended, start, end, status, payload, first, last, tokens) of four requests."""
    return np.array([
        [0.0, 0.0, 1.0, 200, 0, 0.2, 0.9, 8],     # TTFT 200 ms, ITL 0.7 s / 7 = 100 ms
        [1.0, 1.0, 2.5, 200, 1, 1.5, 2.3, 11],    # TTFT 500 ms, ITL 0.8 s / 10 = 80 ms
        [2.0, 2.1, 2.6, 200, 2, 2.4, 2.4, 1],     # TTFT 400 ms from the intended time; one token: no ITL
        [3.0, 3.0, 3.4, 503, 3, np.nan, np.nan, 0],  # failed
    ])


def test_goodput_counts_requests_within_both_bounds() -> None:
    r = llm_records()  # TTFT 200 / 500 / 400 ms, ITL 100 / 80 / none, one failure
    assert goodput(r, 4.0, None, None) == pytest.approx(3 / 4)
    assert goodput(r, 4.0, 450.0, None) == pytest.approx(2 / 4)   # the 500 ms TTFT misses
    assert goodput(r, 4.0, 450.0, 90.0) == pytest.approx(1 / 4)   # and the 100 ms ITL; one token has no ITL
    assert goodput(r, 2.0, 1000.0, 1000.0) == pytest.approx(3 / 2)


def test_llm_summary_arithmetic() -> None:
    m = llm_summary(llm_records(), 4.0)
    # TTFT over all requests, the failure infinite: sorted [200, 400, 500, inf], nearest rank
    assert m.ttft_ms["p50"] == pytest.approx(400.0)
    assert math.isinf(m.ttft_ms["p90"]) and math.isinf(m.ttft_ms["p99"])
    # ITL over requests with 2+ tokens, the failure infinite: [80, 100, inf]
    assert m.itl_ms["p50"] == pytest.approx(100.0) and math.isinf(m.itl_ms["p99"])
    assert m.itl_requests == 2
    assert m.completion_tokens == 20 and m.completion_tokens_mean == pytest.approx(20 / 3)
    assert m.tokens_per_s == pytest.approx(20 / 4.0)  # successful requests' tokens over the span
    assert m.tokens_per_s_per_seq == pytest.approx(1000 / 80.0)  # median ITL of successes: 80 ms (nearest rank)


def test_summary_carries_llm_figures_only_for_streamed_records() -> None:
    r = llm_records()
    r[3, 3] = INCOMPLETE_STREAM
    s = summarize(r, 0.0, 4.0)
    assert s.llm is not None and s.status_counts == {"incomplete_stream": 1, "200": 3}
    d = s.to_dict()
    assert d["llm"]["ttft_ms"] == {"p50": 400.0, "p90": "inf", "p99": "inf"}
    assert d["llm"]["tokens_per_s"] == 5.0
    plain = summarize(r[:, :5], 0.0, 4.0)
    assert plain.llm is None and "llm" not in plain.to_dict()
    assert summarize(r, 0.0, 2.0).llm.completion_tokens == 19  # requests intended in [0, 2) only
    assert summarize(np.zeros((0, len(LLM_FIELDS))), 0.0, 1.0).llm.completion_tokens == 0


def test_judge_uses_token_slas() -> None:
    ok = llm_records()[:3]
    s = summarize(ok, 0.0, 3.0)
    assert judge(s, True, SLA(p99_ms=5000)) == (PASS, [])
    assert judge(s, True, SLA(p99_ms=5000, ttft_p99_ms=600, itl_p99_ms=100)) == (PASS, [])
    status, reasons = judge(s, True, SLA(p99_ms=5000, ttft_p99_ms=300, itl_p99_ms=90))
    assert status == FAIL and reasons == ["TTFT p99 500.0 ms > 300 ms", "ITL p99 100.0 ms > 90 ms"]
