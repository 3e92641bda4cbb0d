"""Automatic prefix caching in the continuous engine (servekit.optimizations.llm.prefix_cache), CPU,
tiny models: a request whose prompt starts with blocks another request computed gets exactly the
tokens and logits it gets without the cache, while only its new tokens are prefilled; the index
never names K/V that is not in the cache (checked against a fresh prefill of what it names)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_checkpoints import write_checkpoint
from servekit.optimizations.llm.continuous import ContinuousBatcher, SeqUpdate
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.packed import Chunk
from servekit.optimizations.llm.prefix_cache import BLOCK
from servekit.optimizations.models.llama import Transformer, load_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def runner(tiny_llama: Transformer) -> LlamaRunner:
    return LlamaRunner(tiny_llama, max_seq_len=128, batch_buckets=(1, 2, 4))


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """A batcher whose packed forwards are counted (prompt tokens prefilled per request), with every
    request's tokens, logprobs and first update kept."""

    def __init__(self, runner: LlamaRunner, **kw: object) -> None:
        self.b = ContinuousBatcher(runner, **kw)
        self.prefilled: dict[int, int] = {}  # cache row -> prompt tokens put in by packed forwards
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.first: dict[str, SeqUpdate] = {}
        real = self.b.packed.run

        def run(chunks: list[Chunk]) -> torch.Tensor:
            for c in chunks:
                self.prefilled[c.row] = self.prefilled.get(c.row, 0) + len(c.tokens)
            return real(chunks)

        self.b.packed.run = run

    def add(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.b.add(key, prompt, params)
        self.tokens[key], self.logprobs[key] = [], []

    def step(self) -> None:
        for key, u in self.b.step().items():
            self.first.setdefault(key, u)
            self.tokens[key] += u.tokens
            self.logprobs[key] += u.logprobs

    def run(self, limit: int = 2000) -> None:
        while self.b.has_work and limit:
            self.step()
            limit -= 1
        assert not self.b.has_work

    def solo(self, key: str, prompt: list[int], params: SamplingParams) -> list[int]:
        """Run one request to its end; returns its tokens."""
        self.add(key, prompt, params)
        self.run()
        return self.tokens[key]


def _uncached(runner: LlamaRunner, prompt: list[int], params: SamplingParams) -> Driver:
    d = Driver(runner, prefix_caching=False)
    d.solo("x", prompt, params)
    return d


def check_index(b: ContinuousBatcher) -> int:
    """Every row's blocks name K/V that is really in that row: a fresh prefill of the tokens they name
    (into the spare row) gives the same keys and values. Returns the blocks checked."""
    model = b.r.model
    spare = model.spare_row
    checked = 0
    for row, chain in enumerate(b.prefix._chains):
        if not chain:
            continue
        tokens = [t for blk in chain for t in blk.key[1]]
        n = len(tokens)
        with torch.no_grad():
            model(torch.tensor([tokens]), torch.arange(n)[None], torch.tensor([n - 1]), kv_len=n,
                  rows=torch.tensor([spare]))
        for layer in model.layers:
            cache = layer.attention.kv_cache
            torch.testing.assert_close(cache.k_cache[row, :, :n], cache.k_cache[spare, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(cache.v_cache[row, :, :n], cache.v_cache[spare, :, :n], atol=1e-4, rtol=1e-4)
        checked += len(chain)
    return checked


def test_a_hit_gives_the_tokens_and_logits_of_a_miss_and_prefills_only_the_rest(runner: LlamaRunner) -> None:
    shared = _prompt(37, 1)
    first, second = shared + _prompt(5, 2), shared + _prompt(9, 3)
    params = SamplingParams(max_tokens=12, logprobs=3)
    want = _uncached(runner, second, params)
    d = Driver(runner)
    d.solo("first", first, SamplingParams(max_tokens=4))
    assert d.first["first"].cached_tokens == 0
    d.solo("second", second, params)
    assert d.tokens["second"] == want.tokens["x"]
    for got, ref in zip(d.logprobs["second"], want.logprobs["x"], strict=True):  # the logits, through logprobs
        assert [t for t, _ in got.top] == [t for t, _ in ref.top]
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [v for _, v in got.top] == pytest.approx([v for _, v in ref.top], abs=1e-4)
    cached = 32  # the two full blocks of the shared 37 tokens
    assert d.first["second"].cached_tokens == cached
    # Both ran in row 0, the second taking the first's blocks over: only its new tokens went in.
    assert d.prefilled == {0: len(first) + len(second) - cached}
    stats = d.b.prefix_stats()
    assert (stats.requests, stats.hit_requests, stats.hit_tokens) == (2, 1, cached)
    assert stats.queried_tokens == len(first) + len(second)
    assert stats.hit_rate == pytest.approx(cached / (len(first) + len(second)))
    assert check_index(d.b) > 0


def test_running_requests_share_a_prefix_with_different_suffixes(runner: LlamaRunner) -> None:
    """A system prompt of 48 tokens: the first request's row is the source of copies into the
    rows of two requests that join while it decodes; each gets its uncached output."""
    system = _prompt(48, 10)
    cases = {k: (system + _prompt(n, 11 + i), SamplingParams(max_tokens=20 + 3 * i))
             for i, (k, n) in enumerate((("a", 7), ("b", 12), ("c", 3)))}
    cases["d"] = (system[:20] + _prompt(30, 20), SamplingParams(max_tokens=10))  # shares one block
    want = {k: _uncached(runner, *case).tokens["x"] for k, case in cases.items()}
    d = Driver(runner)
    d.add("a", *cases["a"])
    d.step()
    d.step()
    for k in "bcd":
        d.add(k, *cases[k])
    d.run()
    assert {k: d.tokens[k] for k in cases} == want
    assert [d.first[k].cached_tokens for k in "abcd"] == [0, 48, 48, 16]
    assert d.b.prefix_stats().copies == 3  # "a" still ran: its row is a source, never taken over
    check_index(d.b)


def test_a_follow_up_turn_reuses_the_blocks_of_the_previous_answer(runner: LlamaRunner) -> None:
    """Turn 2's prompt is turn 1's prompt + answer + new text: it hits the blocks holding turn 1's
    generated tokens too (all but the last answer token, whose K/V no step wrote), from the same row."""
    turn1 = _prompt(39, 30)  # + 25 tokens: 64, yet the 4th block lacks the last token's K/V
    first, params = SamplingParams(max_tokens=25), SamplingParams(max_tokens=15)
    answer = _uncached(runner, turn1, first).tokens["x"]
    turn2 = turn1 + answer + _prompt(10, 31)
    answer2 = _uncached(runner, turn2, params).tokens["x"]
    turn3 = turn2 + answer2 + _prompt(4, 32)
    answer3 = _uncached(runner, turn3, params).tokens["x"]
    d = Driver(runner)
    assert d.solo("t1", turn1, first) == answer
    assert d.solo("t2", turn2, params) == answer2
    cached = (39 + 25 - 1) // BLOCK * BLOCK
    assert d.first["t2"].cached_tokens == cached == 48 > len(turn1)
    assert d.b.prefix_stats().copies == 0  # the free row that held turn 1 was taken over
    assert d.prefilled == {0: len(turn1) + len(turn2) - cached}
    assert d.solo("t3", turn3, params) == answer3
    assert d.first["t3"].cached_tokens == (len(turn2) + 15 - 1) // BLOCK * BLOCK
    check_index(d.b)


def test_the_last_prompt_token_is_always_computed(runner: LlamaRunner) -> None:
    d = Driver(runner)
    for n in (32, 16):
        prompt = _prompt(n, 40 + n)
        first = d.solo(f"once{n}", prompt, SamplingParams(max_tokens=6))
        again = d.solo(f"again{n}", prompt, SamplingParams(max_tokens=6))
        assert again == first
        assert d.first[f"again{n}"].cached_tokens == n - 1  # whole blocks held, one token left to compute
    assert d.b.prefix.lookup(_prompt(15, 99))[0] == 0  # less than a block: nothing to match
    check_index(d.b)


def test_eviction_under_pressure_stays_correct(runner: LlamaRunner) -> None:
    """Five distinct 40-token prefixes in two rows, each used three times in an order that keeps
    evicting: every request gets its uncached output, and what the index holds is in the cache."""
    prefixes = [_prompt(40, 50 + i) for i in range(5)]
    order = [0, 1, 2, 0, 3, 4, 1, 0, 2, 3, 4, 4, 1, 2, 3]
    cases = {f"r{j}": (prefixes[p] + _prompt(3 + j % 4, 70 + j), SamplingParams(max_tokens=6 + j % 5))
             for j, p in enumerate(order)}
    want = {k: _uncached(runner, *case).tokens["x"] for k, case in cases.items()}
    d = Driver(runner, max_num_seqs=2)
    keys = list(cases)
    for i in range(0, len(keys), 3):  # three at a time: two run, one waits for a row
        for k in keys[i:i + 3]:
            d.add(k, *cases[k])
        d.run()
        check_index(d.b)
    assert {k: d.tokens[k] for k in cases} == want
    stats = d.b.prefix_stats()
    assert stats.evicted_blocks > 0 and 0 < stats.hit_requests < len(cases)
    assert stats.held_blocks <= 2 * (127 // BLOCK) and 0 < stats.usage <= 1


def test_a_free_row_s_blocks_move_rather_than_vanish_at_low_load(runner: LlamaRunner) -> None:
    """One request at a time always runs in row 0 (the decode batch stays at its smallest bucket):
    the blocks of the conversation that ran there move to a free row, so two alternating
    conversations both hit on their next turns."""
    a1, b1 = _prompt(40, 80), _prompt(40, 81)
    first, then = SamplingParams(max_tokens=10), SamplingParams(max_tokens=8)
    answer_a, answer_b = (_uncached(runner, p, first).tokens["x"] for p in (a1, b1))
    a2, b2 = a1 + answer_a + _prompt(5, 82), b1 + answer_b + _prompt(5, 83)
    want = {"a2": _uncached(runner, a2, then).tokens["x"], "b2": _uncached(runner, b2, then).tokens["x"]}
    d = Driver(runner)
    assert d.solo("a1", a1, first) == answer_a and d.solo("b1", b1, first) == answer_b
    for key, prompt in (("a2", a2), ("b2", b2)):
        assert d.solo(key, prompt, then) == want[key]
        assert d.first[key].cached_tokens == 48
    stats = d.b.prefix_stats()
    assert stats.moved >= 2 and stats.copies == 2
    assert set(d.prefilled) == {0}  # every request ran in row 0
    check_index(d.b)


def test_moved_blocks_survive_in_a_free_row_the_decode_batch_covers(tiny_llama: Transformer) -> None:
    """Blocks moved into a free row whose own position is low (never used: 0) stay intact when the
    batch grows over that row while it is still free: its garbage decode steps write elsewhere."""
    fresh = LlamaRunner(tiny_llama, max_seq_len=128, batch_buckets=(1, 2, 4))  # every row's position at 0
    x = _prompt(40, 85)
    params = SamplingParams(max_tokens=10)
    answer = _uncached(fresh, x, params).tokens["x"]
    follow = x + answer + _prompt(6, 86)
    want = _uncached(fresh, follow, params).tokens["x"]
    d = Driver(fresh)
    d.solo("x", x, params)  # row 0
    for i, key in enumerate("pqr"):  # rows 0, 1, 3: x's blocks move to row 1, then 2, inside the batch of 4
        d.add(key, _prompt(5, 87 + i), SamplingParams(max_tokens=12))
    d.run()
    assert d.b.prefix_stats().moved == 2 and len(d.b.prefix._chains[2]) == 3
    check_index(d.b)
    assert d.solo("follow", follow, params) == want
    assert d.first["follow"].cached_tokens == 48


def test_a_cancelled_request_frees_its_row_at_once_and_registers_only_what_is_in(runner: LlamaRunner) -> None:
    prompt = _prompt(100, 90)
    params = SamplingParams(max_tokens=9)
    want = _uncached(runner, prompt, params).tokens["x"]
    d = Driver(runner, prefill_chunk=16, max_num_batched_tokens=16)
    d.add("gone", prompt, SamplingParams(max_tokens=20))
    d.step()
    d.step()  # 32 prompt tokens in
    d.b.cancel("gone")
    assert d.b.running == 0
    assert d.b.prefix.lookup(prompt)[0] == 32 and d.b.prefix_stats().held_blocks == 2
    assert d.solo("again", prompt, params) == want
    assert d.first["again"].cached_tokens == 32
    # Cancelled while decoding: its prompt and the tokens reported but the last are in the row.
    prompt = _prompt(40, 91)
    d.add("decoding", prompt, SamplingParams(max_tokens=80))
    while len(d.tokens["decoding"]) < 20:
        d.step()
    d.b.cancel("decoding")
    assert d.b.running == 0
    reported = list(d.tokens["decoding"])
    n = d.b.prefix.lookup(prompt + reported + [7])[0]
    assert n == (40 + len(reported) - 1) // BLOCK * BLOCK > 40
    assert check_index(d.b) >= n // BLOCK
    d.run()  # the step in flight is read and dropped
    assert d.tokens["decoding"] == reported


def test_a_failed_decode_step_forgets_every_block(runner: LlamaRunner) -> None:
    d = Driver(runner)
    d.solo("a", _prompt(40, 95), SamplingParams(max_tokens=4))
    assert d.b.prefix_stats().blocks > 0
    d.b.fail_all(RuntimeError("simulated"))
    assert d.b.prefix_stats().blocks == 0 and d.b.prefix_stats().held_blocks == 0


def test_the_plan_key_turns_it_off(runner: LlamaRunner) -> None:
    from servekit.optimizations.llm.plan import LlmPlan, parse_llm_plan
    from servekit.optimizations.plan import PlanError

    assert LlmPlan().prefix_caching is True
    plan = parse_llm_plan({"prefix_caching": False})
    assert plan.prefix_caching is False
    with pytest.raises(PlanError, match="prefix_caching"):
        parse_llm_plan({"prefix_caching": "no"})
    d = Driver(runner, prefix_caching=plan.prefix_caching)
    prompt = _prompt(50, 96)
    assert d.solo("a", prompt, SamplingParams(max_tokens=3)) == d.solo("b", prompt, SamplingParams(max_tokens=3))
    assert d.first["b"].cached_tokens == 0 and d.b.prefix_stats() is None
    assert d.prefilled[0] == 100


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sliding_window_families_hit_too(tmp_path: Path, family: str) -> None:
    """Gemma 2 and 3 (windows of 5 and 6 tokens, shorter than the prefixes): their sliding layers
    keep every position and mask the window, so copied and taken-over prefixes serve them alike."""
    model = load_llama(write_checkpoint(family, tmp_path / family, seed=3), "cpu", torch.float32)
    r = LlamaRunner(model, max_seq_len=128, batch_buckets=(1, 2, 4))
    vocab = model.config.vocab_size
    system = _prompt(35, 100, vocab)
    turn1 = system + _prompt(6, 101, vocab)
    other = system + _prompt(11, 102, vocab)
    params = SamplingParams(max_tokens=12)
    answer = _uncached(r, turn1, params).tokens["x"]
    turn2 = turn1 + answer + _prompt(7, 103, vocab)
    want = {k: _uncached(r, p, params).tokens["x"] for k, p in (("t2", turn2), ("other", other))}
    d = Driver(r)
    assert d.solo("t1", turn1, params) == answer
    d.add("t2", turn2, params)  # takes over the row that held turn 1
    d.add("other", other, params)  # copied from that row while turn 2 runs there
    d.run()
    assert {k: d.tokens[k] for k in want} == want
    assert d.first["t2"].cached_tokens == 48 and d.first["other"].cached_tokens == 32
    check_index(d.b)


def test_cache_row_views_follow_the_caches() -> None:
    """``cache_row``, the views the CUDA path of ``copy_rows`` copies whole rows through: row r of
    every layer's K and V, in layer order, made once, and new ones once the caches are replaced."""
    from servekit.optimizations.models.llama import LlamaConfig, init_random

    model = init_random(LlamaConfig.tiny(max_position_embeddings=64), seed=0)
    model.setup_caches(2, 64)
    views = model.cache_row(1)
    caches = [t for layer in model.layers for t in (layer.attention.kv_cache.k_cache, layer.attention.kv_cache.v_cache)]
    assert len(views) == 2 * len(model.layers) and model.cache_row(1) is views
    torch._foreach_copy_(views, [torch.full_like(v, 3.0) for v in views])
    assert all(bool((t[1] == 3.0).all()) and not bool((t[0] == 3.0).any()) for t in caches)
    model.setup_caches(4, 64)
    fresh = model.cache_row(1)
    assert fresh is not views and fresh[0].data_ptr() == model.layers[0].attention.kv_cache.k_cache[1].data_ptr()
    model.to(torch.float64)  # the caches replaced by converted copies: views of the new ones
    moved = model.cache_row(1)
    assert moved[0].dtype == torch.float64 and moved[0].data_ptr() == model.layers[0].attention.kv_cache.k_cache[1].data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hits_on_cuda_with_captured_steps_give_the_miss_tokens() -> None:
    """The GPU path: packed prefill captured per token bucket (Triton attention), decode steps
    captured with the Triton decode kernels, fp32. A follow-up turn (taken-over row) and a request
    copied from a running one decode the tokens their misses decode."""
    from servekit.optimizations.models.llama import LlamaConfig, init_random

    model = init_random(LlamaConfig.tiny(max_position_embeddings=256), seed=0).cuda()
    r = LlamaRunner(model, max_seq_len=256, batch_buckets=(1, 2, 4), cuda_graphs=True, kernels="triton")
    r.warmup()
    turn1, params = _prompt(70, 110), SamplingParams(max_tokens=30)
    engines = {}
    for on in (False, True):
        d = engines[on] = Driver(r, prefix_caching=on)
        d.b.warmup()
        answer = d.solo("t1", turn1, params)
        turn2 = turn1 + answer + _prompt(9, 111)
        d.add("t2", turn2, params)
        d.step()
        d.add("mate", turn1[:50] + _prompt(20, 112), params)  # copied from the row turn 2 runs in
        d.run()
    hit, miss = engines[True], engines[False]
    assert hit.first["t2"].cached_tokens == (70 + 30 - 1) // BLOCK * BLOCK
    assert hit.first["mate"].cached_tokens == 48 and hit.b.prefix_stats().copies == 1
    for key in ("t1", "t2", "mate"):
        assert hit.tokens[key] == miss.tokens[key], key


def test_blocks_written_by_verify_steps_serve_a_follow_up(runner: LlamaRunner, tiny_trained_heads: Path) -> None:
    """Speculating requests: the K/V of accepted drafts (written by verify steps, rejected drafts'
    slots overwritten later) is what a follow-up turn reuses; outputs equal the uncached ones."""
    from servekit.optimizations.llm.speculative import SpeculativeDecoding, load_speculator

    runner.speculation = SpeculativeDecoding(runner, load_speculator(tiny_trained_heads), max_spec_batch=2)
    try:
        runner.speculation.warmup()
        turn1, params = _prompt(24, 120), SamplingParams(max_tokens=40)  # 64 tokens, the last without K/V
        answer = _uncached(runner, turn1, params).tokens["x"]
        turn2 = turn1 + answer + _prompt(5, 121)
        want = _uncached(runner, turn2, params).tokens["x"]
        d = Driver(runner)
        assert d.solo("t1", turn1, params) == answer
        assert d.b.spec_stats.accepted[0] > 0  # drafts were accepted: verify steps wrote the answer's K/V
        assert d.solo("t2", turn2, params) == want
        assert d.first["t2"].cached_tokens == (24 + 40 - 1) // BLOCK * BLOCK == 48
        check_index(d.b)
    finally:
        runner.speculation = None
