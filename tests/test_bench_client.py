"""The LLM benchmarks' HTTP client (benchmarks/llm_serve_bench.py: post_events, stream_chat,
Session) against a real HTTP/1.1 server on a local socket: events decoded after the stream with the
times they came, a client's requests on one kept-alive connection (opened ahead by a ping, or a
new one on request), a connection the server closed replaced without losing the request, errors
as statuses. tests/test_llm_server.py runs the same
client against a live TorchServe."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from servekit.benchmarks.llm_serve_bench import Session, post_events, stream_chat

GAP_S = 0.03  # between the fake server's streamed chunks


def _events(words: list[str]) -> list[bytes]:
    out = [b"data: " + json.dumps({"choices": [{"delta": {"content": w}}]}).encode() + b"\n\n" for w in words]
    usage = {"completion_tokens": len(words), "prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 3}}
    return out + [b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n", b"data: [DONE]\n\n"]


class _Server:
    """Streams the request's words back as chunked SSE events, 5 ms apart; counts connections.
    ``close_after``: drop the connection after each answer without saying so (a stale keep-alive)."""

    def __init__(self, close_after: bool = False) -> None:
        self.connections, self.bodies, self.pings = 0, [], 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                server.connections += 1

            def do_GET(self) -> None:  # TorchServe's health route: {"status": "Healthy"}
                server.pings += self.path == "/ping"
                msg = b'{"status": "Healthy"}'
                self.send_response(200 if self.path == "/ping" else 404)
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                if body.get("max_tokens") == 0:
                    msg = b'{"error": "max_tokens must be positive"}'
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for event in _events(body["messages"][-1]["content"].split()):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(GAP_S)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                if close_after:
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/chat/completions"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.httpd.shutdown()


def test_stream_chat_times_each_chunk_and_decodes_the_events_after(server: _Server) -> None:
    t = stream_chat(server.url, "one two three four", 16)
    assert (t.status, t.text, t.tokens, t.prompt_tokens, t.chunks, t.cached_tokens) == (200, "onetwothreefour", 4, 7, 4, 3)
    # The chunks came GAP_S apart: the first token's time is the first event's arrival, not the end
    # (a loaded test machine may read the first chunk late, by less than a gap).
    assert 0 < t.ttft_s < t.last_s and t.last_s - t.ttft_s >= 2 * GAP_S
    assert server.bodies[0] == {"messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 16,
                                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def test_post_events_gives_raw_lines_in_order_and_an_error_status_with_its_text(server: _Server) -> None:
    status, lines, error = post_events(server.url, {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2})
    assert status == 200 and error == ""
    assert [json.loads(line)["choices"][0]["delta"]["content"] for _, line in lines[:2]] == ["a", "b"]
    assert [t for t, _ in lines] == sorted(t for t, _ in lines)  # [DONE] is left out, usage kept
    assert len(lines) == 3
    status, lines, error = post_events(server.url, {"messages": [], "max_tokens": 0})
    assert (status, lines) == (400, []) and "max_tokens must be positive" in error


def test_a_session_sends_a_threads_requests_on_one_connection(server: _Server) -> None:
    session = Session(server.url)
    got = [session.chat(f"request {i}", 8) for i in range(3)]
    assert [t.text for t in got] == ["request0", "request1", "request2"]
    assert server.connections == 1
    other = threading.Thread(target=session.chat, args=("from another thread", 8))
    other.start()
    other.join()
    assert server.connections == 2  # each client thread has its own connection


def test_a_session_sends_greedy_requests_or_sampled_ones_with_a_seed(server: _Server) -> None:
    Session(server.url).chat("greedy", 4)
    Session(server.url, temperature=0.8).chat("sampled", 4)
    Session(server.url, temperature=0.8).fresh("sampled again", 4)
    greedy, sampled, again = server.bodies
    assert greedy["temperature"] == 0 and "seed" not in greedy
    assert sampled["temperature"] == again["temperature"] == 0.8 and sampled["seed"] == again["seed"] == 0


def test_open_puts_the_first_request_on_a_connection_already_up_and_fresh_opens_another(server: _Server) -> None:
    session = Session(server.url)
    session.open()
    assert (server.connections, server.pings) == (1, 1)
    first = session.chat("first request", 8)
    assert first.text == "firstrequest" and server.connections == 1  # the ping's connection, kept alive
    again = session.fresh("on a new one", 8)
    assert again.status == 200 and again.text == "onanewone" and server.connections == 2
    session.chat("after it", 8)
    assert server.connections == 2  # the new connection is the thread's from then on


def test_open_on_a_server_that_is_down_leaves_the_next_request_to_connect() -> None:
    session = Session("http://127.0.0.1:9/v1/chat/completions")  # discard port: nothing listens
    session.open()  # no exception: the probe's first request reports the failure as usual
    assert session.chat("hello", 4).status == -1


def test_a_session_replaces_a_connection_the_server_closed() -> None:
    server = _Server(close_after=True)
    try:
        session = Session(server.url)
        got = [session.chat(f"turn {i}", 8) for i in range(3)]
        assert [t.status for t in got] == [200, 200, 200] and [t.text for t in got] == ["turn0", "turn1", "turn2"]
        assert server.connections == 3
    finally:
        server.httpd.shutdown()


def test_a_refused_connection_is_a_failed_timing_not_an_exception() -> None:
    t = stream_chat("http://127.0.0.1:9/v1/chat/completions", "hello", 4, timeout=5.0)  # discard port: nothing listens
    assert t.status == -1 and "ConnectionRefusedError" in t.error


def test_the_ttft_probe_opens_its_connection_first_and_times_a_new_connection_apart(server: _Server) -> None:
    from servekit.benchmarks.llm_prompts import PromptGenerator
    from servekit.benchmarks.llm_workload_bench import HttpChat, ttft_by_length

    [row] = ttft_by_length(HttpChat(server.url), PromptGenerator(seed=0), [30], later=2)
    assert server.pings == 1 and len(server.bodies) == 4  # the ping, then first + 2 later + 1 on a new connection
    assert server.connections == 2
    assert row["later"] == 2 and row["later_failed"] == 0 and row["first_error"] is None
    assert row["first_ttft_ms"] > 0 and row["new_connection_ttft_ms"] > 0


def test_the_ttft_probe_sends_requests_after_an_idle_pause_and_reports_them_apart(server: _Server) -> None:
    from servekit.benchmarks.llm_prompts import PromptGenerator
    from servekit.benchmarks.llm_workload_bench import HttpChat, ttft_by_length

    t0 = time.monotonic()
    [row] = ttft_by_length(HttpChat(server.url), PromptGenerator(seed=0), [30], later=2, idle=0.3)
    assert time.monotonic() - t0 >= 0.6  # a pause before each of the 2 requests after idle
    assert len(server.bodies) == 6  # first + 2 later + 2 after a pause + 1 on a new connection
    assert row["idle_s"] == 0.3 and row["after_idle_ttft_ms_p50"] > 0
    [plain] = ttft_by_length(HttpChat(server.url), PromptGenerator(seed=1), [30], later=1)
    assert plain["idle_s"] is None and plain["after_idle_ttft_ms_p50"] is None


def test_a_sequence_times_each_request_and_groups_them_by_index(server: _Server) -> None:
    from servekit.benchmarks.llm_prompts import PromptGenerator
    from servekit.benchmarks.llm_workload_bench import HttpChat, sequence

    got = sequence(HttpChat(server.url), PromptGenerator(seed=0), 12, 20)
    assert got["requests"] == 12 and got["failed"] == 0 and len(server.bodies) == 12
    assert server.pings == 1 and server.connections == 1  # opened before the first, kept for all
    texts = [b["messages"][-1]["content"] for b in server.bodies]
    assert len(set(texts)) == 12 and all(b["max_tokens"] == 2 and b["stream"] for b in server.bodies)
    assert [(w["from"], w["to"], w["answered"]) for w in got["windows"]] == [(1, 1, 1), (2, 10, 9), (11, 12, 2)]
    assert all(w["ttft_ms_p50"] > 0 and w["handler_ttft_ms_p50"] is None for w in got["windows"])  # no handler metrics here


def test_request_windows_double_after_100_and_leave_out_what_a_request_lacks() -> None:
    from servekit.benchmarks.llm_workload_bench import request_windows

    rows = [{"ttft_ms": 10.0 + i, "handler_ttft_ms": 4.0} for i in range(250)]
    rows[0] = {"ttft_ms": None, "handler_ttft_ms": None}  # failed
    windows = request_windows(rows)
    assert [(w["from"], w["to"]) for w in windows] == [(1, 1), (2, 10), (11, 50), (51, 100), (101, 200), (201, 250)]
    assert windows[0] == {"from": 1, "to": 1, "answered": 0, "ttft_ms_p50": None, "handler_ttft_ms_p50": None,
                          "outside_ms_p50": None}
    assert windows[1]["ttft_ms_p50"] == 15.0 and windows[1]["outside_ms_p50"] == 11.0  # requests 2-10: 11..19 ms


def test_full_load_counts_the_tokens_while_every_stream_is_busy() -> None:
    """Two streams of two requests: the window runs from the later stream's first token to the
    earlier stream's last answer, and each request's tokens are spread evenly over its own span."""
    from servekit.benchmarks.llm_serve_bench import Timing
    from servekit.benchmarks.llm_workload_bench import full_load

    def timing(ttft: float, last: float, tokens: int, status: int = 200) -> Timing:
        return Timing(status, ttft, last, tokens, 10, tokens, "")

    # Stream 0: sent at 0 (tokens at 1..5, one a second), then at 5 (tokens 6..10). Stream 1: sent
    # at 0 (first token at 2, tokens 2..12 every 2 s), then at 12 (tokens 13, 14).
    timings = [timing(1, 5, 5), timing(1, 5, 5), timing(2, 12, 6), timing(1, 2, 2)]
    sends = [0.0, 5.0, 0.0, 12.0]
    got = full_load(timings, sends, per_stream=2)
    # Window [2, 10]: stream 0 tokens at 2,3,4,5 and 6..10 (9), stream 1 at 2,4,6,8,10 (5).
    assert got == {"tok_per_s_full_load": round(14 / 8, 1), "full_load_s": 8.0}
    assert full_load([timing(1, 5, 5, 500)] + timings[1:], sends, 2)["tok_per_s_full_load"] is None
    # A stream that ends before another starts producing: no window.
    assert full_load([timing(1, 2, 2), timing(1, 2, 2), timing(9, 10, 2), timing(1, 2, 2)],
                     [0.0, 2.0, 0.0, 10.0], 2)["full_load_s"] is None


def test_a_set_named_again_runs_again_under_its_own_key() -> None:
    """--sets short passages short: the second short run is reported beside the first, not over it."""
    from servekit.benchmarks.llm_workload_bench import set_runs

    assert set_runs(["short", "passages", "short", "short"]) == [
        ("short", "short"), ("passages", "passages"), ("short #2", "short"), ("short #3", "short")]
    assert set_runs(["mixed"]) == [("mixed", "mixed")]


def test_the_decode_measure_sends_ignore_eos_one_by_one_then_together(server: _Server) -> None:
    """``decode_steps``: the batch-1 requests one after another, then the rest at once, every body
    with ignore_eos; the TPOT of each and their ratio."""
    from servekit.benchmarks.llm_prompts import Prompt
    from servekit.benchmarks.llm_workload_bench import HttpChat, Split, decode_steps

    prompts = [Prompt("short", ({"role": "user", "content": f"w{i} x y z"},), 4, 5) for i in range(5)]
    t0 = time.monotonic()
    got = decode_steps(HttpChat(server.url), prompts, 2, 3, Split())
    wall = time.monotonic() - t0
    assert [b["messages"][-1]["content"].split()[0] for b in server.bodies[:2]] == ["w0", "w1"]
    assert sorted(b["messages"][-1]["content"].split()[0] for b in server.bodies[2:]) == ["w2", "w3", "w4"]
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 5 for b in server.bodies)
    # 4 chunks GAP_S apart each: the two alone in turn, the three together at once
    assert 3 * 4 * GAP_S <= wall < 4 * 4 * GAP_S + 1.0
    assert got["batch1"]["requests"] == 2 and got["batch3"]["requests"] == 3
    assert got["batch1"]["itl_ms_p50"] > 0 and got["batch3"]["itl_ms_p50"] > 0
    assert got["tpot_ratio"] == round(got["batch3"]["itl_ms_p50"] / got["batch1"]["itl_ms_p50"], 3)
    last = got["batch3"]["tpot_ms_last_started"]
    assert last > 0 and got["tpot_ratio_full_batch"] == round(last / got["batch1"]["itl_ms_p50"], 3)
