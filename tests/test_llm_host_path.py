"""benchmarks/llm_host_path.py on the CPU: every stage of a handler call timed on real frames and
answers, and the first-request probe's prompts of the asked length."""
from ts.protocol import otf_message_handler as otf

from servekit.benchmarks import llm_host_path
from servekit.handlers import worker_io


def test_a_call_is_timed_stage_by_stage_and_torchserve_is_put_back(monkeypatch) -> None:
    monkeypatch.setattr(otf, "_retrieve_buffer", worker_io.stock_retrieve)
    monkeypatch.setattr(otf, "_retrieve_inference_msg", worker_io.stock_inference_msg)
    monkeypatch.setattr(worker_io, "_reader", None)
    row = llm_host_path.one_call(streams=4, tokens=2, reps=2, seed=0)
    assert otf._retrieve_inference_msg is worker_io.stock_inference_msg
    assert (row["streams"], row["tokens_per_chunk"]) == (4, 2)
    for code in ("torchserve", "servekit"):
        parts = [row["decode_us"][code], row["requests_us"][code], row["answers_us"], row["frame_us"][code]]
        assert all(x > 0 for x in parts)
        assert abs(row["total_us"][code] - sum(parts)) < 0.5
    assert row["chunk_bytes_mean"] > 100  # a server-sent event of real text, not an empty chunk


def test_first_request_probe_sends_new_texts_of_the_asked_length() -> None:
    got = llm_host_path.first_request(warm=True, tokens=120, later=2, seed=1)
    assert got["warm_up"] is True and len(got["later_ms"]) == 2 and got["first_ms"] > 0
    assert all(abs(n - 120) <= 8 for n in got["prompt_tokens"]), got["prompt_tokens"]
