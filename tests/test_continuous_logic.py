"""Continuous batching (servekit.optimizations.llm.continuous) on a tiny random Llama, CPU: requests
join and leave a running batch, and every request still gets exactly its solo output (the request
run alone with plain decode steps)."""
from __future__ import annotations

import pytest
import torch

from servekit.optimizations.llm.continuous import ContinuousBatcher, SeqUpdate
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import Completion, generate
from servekit.optimizations.models.llama import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def runner(tiny_llama: Transformer) -> LlamaRunner:
    return LlamaRunner(tiny_llama, max_seq_len=128, batch_buckets=(1, 2, 4), prefill_buckets=(8, 16, 32, 64))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _solo(runner: LlamaRunner, prompt: list[int], params: SamplingParams) -> Completion:
    """The request alone, with plain decode steps (the runner's speculation set aside)."""
    spec, runner.speculation = runner.speculation, None
    try:
        return generate(runner, [prompt], [params])[0]
    finally:
        runner.speculation = spec


class Recorder:
    """Drives a batcher and keeps every request's tokens, finish reason, logprobs and the step at
    which each token arrived."""

    def __init__(self, batcher: ContinuousBatcher) -> None:
        self.b, self.steps = batcher, 0
        self.tokens: dict[str, list[int]] = {}
        self.first_step: dict[str, int] = {}
        self.finish: dict[str, str] = {}
        self.logprobs: dict[str, list] = {}

    def add(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.b.add(key, prompt, params)
        self.tokens[key], self.logprobs[key] = [], []

    def step(self) -> dict[str, SeqUpdate]:
        updates = self.b.step()
        self.steps += 1
        for key, u in updates.items():
            if u.tokens and key not in self.first_step:
                self.first_step[key] = self.steps
            self.tokens[key] += u.tokens
            self.logprobs[key] += u.logprobs
            if u.finish_reason is not None:
                self.finish[key] = u.finish_reason
        return updates

    def run(self, limit: int = 500) -> None:
        while self.b.has_work and limit:
            self.step()
            limit -= 1
        assert not self.b.has_work


def test_requests_joining_mid_generation_get_their_solo_output(runner: LlamaRunner) -> None:
    rec = Recorder(ContinuousBatcher(runner))
    cases = {"a": (_prompt(20, 1), SamplingParams(max_tokens=40)),
             "b": (_prompt(5, 2), SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=7)),
             "c": (_prompt(33, 3), SamplingParams(max_tokens=25, temperature=1.1, top_p=0.8, seed=8)),
             "d": (_prompt(9, 4), SamplingParams(max_tokens=30, presence_penalty=1.0, logprobs=2))}
    rec.add("a", *cases["a"])
    for _ in range(5):
        rec.step()
    rec.add("b", *cases["b"])
    rec.add("c", *cases["c"])
    for _ in range(3):
        rec.step()
    rec.add("d", *cases["d"])  # joins a batch of 3: the bucket grows to 4
    rec.run()
    for key, (prompt, params) in cases.items():
        want = _solo(runner, prompt, params)
        assert rec.tokens[key] == want.tokens, key
        assert rec.finish[key] == want.finish_reason
    want_d = _solo(runner, *cases["d"])
    assert len(rec.logprobs["d"]) == len(want_d.logprobs) == 30
    for got, want in zip(rec.logprobs["d"], want_d.logprobs):
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)


def test_a_short_request_behind_a_long_one_starts_within_steps(runner: LlamaRunner) -> None:
    rec = Recorder(ContinuousBatcher(runner))
    rec.add("long", _prompt(30, 5), SamplingParams(max_tokens=80))
    for _ in range(10):
        rec.step()
    rec.add("short", _prompt(6, 6), SamplingParams(max_tokens=4))
    added_at = rec.steps
    while "short" not in rec.finish:
        rec.step()
    # Its prefill runs in the very next step, the long one's token riding in it; their step's
    # sampling half samples its first token too, read (as the long one's) once the next step is launched.
    assert rec.first_step["short"] == added_at + 2
    assert rec.steps - added_at <= 6  # and it ends while the long one still runs
    assert "long" not in rec.finish
    rec.run()
    assert len(rec.tokens["long"]) == 80


def test_admission_is_fifo_up_to_max_num_seqs_and_a_cancel_frees_the_slot_at_once(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, max_num_seqs=2)
    rec = Recorder(batcher)
    for key, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
        rec.add(key, _prompt(8, seed), SamplingParams(max_tokens=60))
    for _ in range(3):
        rec.step()
    assert batcher.running == 2 and set(rec.first_step) == {"a", "b"}  # c and d wait, in order
    batcher.cancel("a")
    assert batcher.running == 1
    rec.step()  # c's prompt goes in with b's token riding; their sampling half samples c's first token
    rec.step()  # read once the next step is launched
    assert "c" in rec.first_step and "d" not in rec.first_step
    n = len(rec.tokens["a"])
    rec.run()
    assert len(rec.tokens["a"]) == n  # nothing more for a cancelled request
    assert rec.tokens["c"] == _solo(runner, _prompt(8, 3), SamplingParams(max_tokens=60)).tokens


def test_bad_requests_are_refused_at_add_and_the_rest_runs(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner)
    rec = Recorder(batcher)
    rec.add("ok", _prompt(8, 1), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="exceeds the context"):
        batcher.add("long", _prompt(64, 2), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="the prompt is empty"):
        batcher.add("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="already running"):
        batcher.add("ok", _prompt(8, 1), SamplingParams())
    rec.run()
    assert rec.finish["ok"] == "length" and len(rec.tokens["ok"]) == 5
    with pytest.raises(ValueError, match="max_num_seqs"):
        ContinuousBatcher(runner, max_num_seqs=8)


def test_long_prompts_go_in_chunks_while_the_others_keep_decoding(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=16)
    rec = Recorder(batcher)
    cases = {"run": (_prompt(6, 1), SamplingParams(max_tokens=30)),
             "long": (_prompt(60, 2), SamplingParams(max_tokens=8, temperature=0.7, seed=5)),
             "full": (_prompt(50, 3), SamplingParams(max_tokens=6, logprobs=1, frequency_penalty=0.5))}
    rec.add("run", *cases["run"])
    rec.step()
    rec.add("long", *cases["long"])
    rec.add("full", *cases["full"])
    before = len(rec.tokens["run"])
    for _ in range(4):  # 60 tokens, 16 per step: the long prompt is in after its 4th chunk
        updates = rec.step()
        assert len(updates["run"].tokens) == 1  # the running request got its token every step
    assert "long" not in rec.first_step
    rec.step()  # its first token, sampled with the run's in the 4th forward, read once the next is launched
    assert len(rec.tokens["run"]) == before + 5 and rec.first_step["long"] == rec.steps
    rec.run()
    for key, (prompt, params) in cases.items():
        assert rec.tokens[key] == _solo(runner, prompt, params).tokens, key
    with pytest.raises(ValueError, match="prefill_chunk"):
        ContinuousBatcher(runner, prefill_chunk=0)


def test_a_request_cancelled_while_its_prompt_goes_in_frees_its_slot(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, max_num_seqs=1, prefill_chunk=8, max_num_batched_tokens=8)
    rec = Recorder(batcher)
    rec.add("long", _prompt(40, 4), SamplingParams(max_tokens=5))
    rec.add("next", _prompt(5, 5), SamplingParams(max_tokens=5))
    rec.step()
    batcher.cancel("long")
    rec.run()
    assert rec.tokens["long"] == [] and rec.tokens["next"] == _solo(runner, _prompt(5, 5), SamplingParams(max_tokens=5)).tokens


def test_warmup_builds_the_packed_prefill_and_leaves_nothing_running(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=32)
    built = batcher.warmup()
    assert built["attention"] == "torch" and built["graphs"] is False  # CPU: eager, nothing to capture
    assert built["seconds"] >= 0 and not batcher.has_work and batcher.running == 0
    hosts = dict(batcher._hosts)  # every output shape's host copies exist before the first request
    rec = Recorder(batcher)
    rec.add("a", _prompt(40, 1), SamplingParams(max_tokens=6))
    rec.add("b", _prompt(9, 2), SamplingParams(max_tokens=5, logprobs=1))
    rec.add("c", _prompt(3, 3), SamplingParams(max_tokens=7, temperature=0.8, seed=1))
    rec.run()
    assert rec.tokens["a"] == _solo(runner, _prompt(40, 1), SamplingParams(max_tokens=6)).tokens
    assert batcher._hosts == hosts


def _collect(engine, keys: list, timeout: float = 60.0) -> dict:
    import time

    got = {k: SeqUpdate() for k in keys}
    deadline = time.monotonic() + timeout
    while any(got[k].finish_reason is None for k in keys) and time.monotonic() < deadline:
        for k, u in engine.take(keys, 1.0).items():
            got[k].merge(u)
    return got


def test_the_engine_thread_serves_requests_and_survives_a_failed_step(runner: LlamaRunner) -> None:
    from servekit.optimizations.llm.continuous import EngineThread

    batcher = ContinuousBatcher(runner)
    engine = EngineThread(batcher)
    engine.submit("a", _prompt(9, 1), SamplingParams(max_tokens=12))
    engine.submit("b", _prompt(4, 2), SamplingParams(max_tokens=7, temperature=0.9, seed=3))
    engine.submit("bad", [], SamplingParams())  # refused by the runner: that request's own error
    got = _collect(engine, ["a", "b", "bad"])
    assert got["a"].tokens == _solo(runner, _prompt(9, 1), SamplingParams(max_tokens=12)).tokens
    assert got["b"].tokens == _solo(runner, _prompt(4, 2), SamplingParams(max_tokens=7, temperature=0.9, seed=3)).tokens
    assert got["bad"].finish_reason == "error" and "empty" in str(got["bad"].error)

    real, calls = batcher.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real()

    batcher.step = failing_once
    engine.submit("c", _prompt(8, 3), SamplingParams(max_tokens=20))
    got = _collect(engine, ["c"])
    assert got["c"].finish_reason == "error" and "device lost" in str(got["c"].error)
    engine.submit("d", _prompt(8, 4), SamplingParams(max_tokens=5))  # the thread lives on
    assert _collect(engine, ["d"])["d"].tokens == _solo(runner, _prompt(8, 4), SamplingParams(max_tokens=5)).tokens


# --- speculation inside the continuous batch ---------------------------------------------------------

K = 4


@pytest.fixture
def spec_runner(runner: LlamaRunner, tiny_trained_heads) -> LlamaRunner:
    """The module's runner with trained speculator heads verifying in its slots, up to batch 2:
    three or four busy slots decode with plain steps, so the batch moves between the two."""
    from servekit.optimizations.llm.speculative import SpeculativeDecoding, load_speculator

    runner.speculation = SpeculativeDecoding(runner, load_speculator(tiny_trained_heads), max_spec_batch=2)
    runner.speculation.warmup()
    yield runner
    runner.speculation = None


def test_speculating_requests_joining_and_leaving_get_their_solo_output(spec_runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(spec_runner)
    rec = Recorder(batcher)
    cases = {"a": (_prompt(20, 11), SamplingParams(max_tokens=60)),
             "b": (_prompt(5, 12), SamplingParams(max_tokens=14, temperature=0.9, top_k=30, seed=7)),
             "c": (_prompt(33, 13), SamplingParams(max_tokens=45)),
             "d": (_prompt(9, 14), SamplingParams(max_tokens=30, presence_penalty=1.0, logprobs=2)),
             "e": (_prompt(12, 15), SamplingParams(max_tokens=40))}
    rec.add("a", *cases["a"])
    kinds = []

    def step(n: int) -> None:
        for _ in range(n):
            kinds.append(batcher._inflight[0].drafts if batcher._inflight else None)
            rec.step()

    step(4)
    rec.add("b", *cases["b"])  # sampled: rides along without drafts
    step(3)
    rec.add("c", *cases["c"])  # three busy slots: plain steps
    step(3)
    rec.add("d", *cases["d"])  # penalties and logprobs: plain (FULL) steps while it runs
    rec.add("e", *cases["e"])  # waits for a free slot
    rec.run()
    for key, (prompt, params) in cases.items():
        want = _solo(spec_runner, prompt, params)
        assert rec.tokens[key] == want.tokens, key
        assert rec.finish[key] == want.finish_reason, key
    assert K in kinds and 0 in kinds  # both kinds of step ran
    stats = batcher.spec_stats
    assert stats.proposed[0] > 0 and stats.mean_accepted_length > 1.2  # trained heads: drafts accepted


def test_speculation_stops_at_stop_tokens_and_max_tokens_inside_an_accepted_run(spec_runner: LlamaRunner) -> None:
    prompts = [_prompt(n, 20 + n) for n in (6, 15)]
    free = [_solo(spec_runner, p, SamplingParams(max_tokens=40)) for p in prompts]
    cases = {"stop": (prompts[0], SamplingParams(max_tokens=40, stop_token_ids=(free[0].tokens[12],))),
             "length": (prompts[1], SamplingParams(max_tokens=17))}
    batcher = ContinuousBatcher(spec_runner)
    rec = Recorder(batcher)
    for key, (prompt, params) in cases.items():
        rec.add(key, prompt, params)
    rec.run()
    for key, (prompt, params) in cases.items():
        want = _solo(spec_runner, prompt, params)
        assert rec.tokens[key] == want.tokens and rec.finish[key] == want.finish_reason, key
    assert batcher.spec_stats.proposed[0] > 0


def test_speculate_false_and_sampled_requests_accept_no_drafts(spec_runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(spec_runner)
    rec = Recorder(batcher)
    batcher.add("off", _prompt(10, 31), SamplingParams(max_tokens=30), speculate=False)
    rec.tokens["off"], rec.logprobs["off"] = [], []
    rec.add("sampled", _prompt(7, 32), SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    rec.run()
    assert batcher.spec_stats.proposed[0] == 0  # no row accepted drafts: plain steps throughout
    assert rec.tokens["off"] == _solo(spec_runner, _prompt(10, 31), SamplingParams(max_tokens=30)).tokens
    assert rec.tokens["sampled"] == _solo(spec_runner, _prompt(7, 32),
                                          SamplingParams(max_tokens=30, temperature=0.8, seed=3)).tokens


def test_kv_usage_counts_the_running_requests_positions(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=16)
    assert batcher.kv_usage == 0.0
    batcher.add("a", _prompt(10, 41), SamplingParams(max_tokens=20))
    batcher.add("long", _prompt(40, 42), SamplingParams(max_tokens=5))  # 16 prompt tokens per step in all
    got = {"a": 0, "long": 0}
    for _ in range(2):
        for key, u in batcher.step().items():
            got[key] += len(u.tokens)
    capacity = batcher.max_num_seqs * runner.max_seq_len
    # "a": its prompt and the tokens read so far; "long": what went in (6 beside "a", then 16).
    assert got["long"] == 0
    assert batcher.kv_usage == pytest.approx((10 + got["a"] + 22) / capacity)
    while batcher.has_work:
        batcher.step()
    assert batcher.kv_usage == 0.0


def test_engine_counters_drop_to_zero_once_settled_after_a_cancel(runner: LlamaRunner) -> None:
    """The handler emits its gauges after the last request ends or is cancelled; ``settle`` makes
    the engine's counters include the cancellation first (the gauges are otherwise left stale
    until a next request)."""
    from servekit.optimizations.llm.continuous import EngineThread

    import time

    batcher = ContinuousBatcher(runner)
    real = batcher.step

    def slow_step():  # 100 tokens take seconds: the request is still running when cancelled
        time.sleep(0.05)
        return real()

    batcher.step = slow_step
    engine = EngineThread(batcher)
    engine.submit("long", _prompt(12, 5), SamplingParams(max_tokens=100))
    deadline = time.monotonic() + 30
    while not engine.take(["long"], 1.0) and time.monotonic() < deadline:  # running: tokens arrive
        pass
    assert engine.settle(5.0) and engine.running == 1 and engine.kv_usage > 0
    engine.cancel("long")
    assert engine.settle(5.0)
    assert (engine.running, engine.waiting, engine.kv_usage) == (0, 0, 0.0)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_request_left_alone_in_a_high_row_moves_down_and_keeps_its_output(runner: LlamaRunner,
                                                                             prefix_caching: bool) -> None:
    """Three short requests end one after another; the long one in row 3 (bucket 4) moves to row 1
    when two are left (bucket 2, the other one moving to row 0), then to row 0 (bucket 1), penalty
    counts and sampling state with it, and every request gets its solo tokens. With
    the prefix cache the move is a swap: the blocks row 0 kept from a finished request move up and
    still serve a later prompt that starts with them."""
    b = ContinuousBatcher(runner, prefix_caching=prefix_caching)
    rec = Recorder(b)
    cases = {"a": (_prompt(40, 11), SamplingParams(max_tokens=4)),
             "b": (_prompt(7, 12), SamplingParams(max_tokens=5)),
             "c": (_prompt(9, 13), SamplingParams(max_tokens=6)),
             "d": (_prompt(12, 14), SamplingParams(max_tokens=40, temperature=0.9, seed=3, frequency_penalty=0.7))}
    for key, case in cases.items():
        rec.add(key, *case)
    rows = []
    while b.has_work:
        rec.step()
        if "d" in b.by_key:
            rows.append(b.by_key["d"].slot)
    assert sorted(set(rows), reverse=True) == [3, 1, 0] and rows[-1] == 0 and b.moves == 3
    for key, (prompt, params) in cases.items():
        assert rec.tokens[key] == _solo(runner, prompt, params).tokens, key
    later = cases["a"][0] + _prompt(5, 15)
    rec.add("e", later, SamplingParams(max_tokens=8))
    cached = []
    while b.has_work:
        cached += [u.cached_tokens for k, u in rec.step().items() if k == "e" and u.tokens]
    assert rec.tokens["e"] == _solo(runner, later, SamplingParams(max_tokens=8)).tokens
    assert cached[0] == (32 if prefix_caching else 0)
