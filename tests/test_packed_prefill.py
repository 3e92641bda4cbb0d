"""Packed prefill (servekit.optimizations.llm.packed) and the engine's token-budget scheduling
(continuous.plan_prefill, ContinuousBatcher), on CPU: a packed forward over several requests'
chunks computes what each request's own prefill computes, for every decoder family; the
scheduler keeps its budget, starves nobody, and lets no long prompt hold a short one or a
decoding row back by more than one step."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from decoder_checkpoints import FAMILIES, write_checkpoint
from engine_steps import Counted
from servekit.optimizations.llm.continuous import ContinuousBatcher, plan_prefill
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.llm.packed import Chunk, PackedPrefill, token_buckets
from servekit.optimizations.models.llama import Transformer, load_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the budget split -------------------------------------------------------------------------------

def test_plan_prefill_keeps_the_budget_advances_the_oldest_and_shares_chunks_first() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        remaining = [rng.randint(1, 3000) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(1, 4096)
        chunk = rng.randint(1, budget)
        take = plan_prefill(remaining, budget, chunk)
        assert sum(take) == min(budget, sum(remaining))  # within the budget, and none of it idle
        assert all(0 <= t <= r for t, r in zip(take, remaining))
        assert take[0] >= min(remaining[0], chunk)  # the oldest always advances: no starvation
        if any(t > chunk for t in take):  # nobody gets more than a chunk before everyone got theirs
            assert all(t >= min(r, chunk) for t, r in zip(take, remaining))


def test_token_buckets_cover_the_budget() -> None:
    assert token_buckets(2048) == (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    assert token_buckets(600) == (16, 32, 64, 128, 192, 256, 384, 512, 600)
    assert token_buckets(700) == (16, 32, 64, 128, 192, 256, 384, 512, 700)  # 768 would exceed the budget
    assert token_buckets(10) == (10,)


# --- packed forward == per-request prefill, every family ----------------------------------------

@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Transformer]:
    root = tmp_path_factory.mktemp("packed-families")
    return {f: load_llama(write_checkpoint(f, root / f, seed=i), "cpu", torch.float32) for i, f in enumerate(FAMILIES)}


def _caches(model: Transformer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.attention.kv_cache.k_cache.clone(), layer.attention.kv_cache.v_cache.clone())
            for layer in model.layers]


def _zero_caches(model: Transformer) -> None:
    for layer in model.layers:
        layer.attention.kv_cache.k_cache.zero_()
        layer.attention.kv_cache.v_cache.zero_()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_prefill_equals_per_request_prefill(family_models: dict[str, Transformer], family: str) -> None:
    """Requests of 5, 23 and 41 tokens, and a 50-token one in two chunks (the second packed beside
    a fresh prompt): logits of every prompt's last token and every cache row match the request's
    own prefill (the runner's batch-of-one path) within fp32 tolerance."""
    model = family_models[family]
    model.setup_caches(4, 96)
    vocab = model.config.vocab_size
    prompts = {0: _prompt(5, 1, vocab), 1: _prompt(23, 2, vocab), 2: _prompt(50, 3, vocab), 3: _prompt(41, 4, vocab)}
    with torch.no_grad():
        _zero_caches(model)
        want = {}
        for row, p in prompts.items():
            n = len(p)
            want[row] = model(torch.tensor([p]), torch.arange(n)[None], torch.tensor([n - 1]), kv_len=n,
                              rows=torch.tensor([row]))[0]
        want_cache = _caches(model)
        _zero_caches(model)
        packed = PackedPrefill(model, max_tokens=96, max_seqs=4)
        first = packed.run([Chunk(prompts[0], 0, 0, True), Chunk(prompts[2][:30], 0, 2, False),
                            Chunk(prompts[1], 0, 1, True)])
        second = packed.run([Chunk(prompts[3], 0, 3, True), Chunk(prompts[2][30:], 30, 2, True)])
    got = {0: first[0], 1: first[1], 3: second[0], 2: second[1]}
    assert first.shape[0] == 2 and second.shape[0] == 2
    for row in prompts:
        torch.testing.assert_close(got[row], want[row], atol=2e-4, rtol=1e-4, msg=f"{family} row {row}")
    for (k, v), (wk, wv) in zip(_caches(model), want_cache):
        for row, p in prompts.items():
            torch.testing.assert_close(k[row, :, :len(p)], wk[row, :, :len(p)], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[row, :, :len(p)], wv[row, :, :len(p)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoding_rows_riding_in_a_packed_forward_get_their_decode_step(family_models: dict[str, Transformer],
                                                                        family: str) -> None:
    """Two rows decoding (their next tokens only in the decode state, as on the device between two
    steps) ride in one packed forward beside a fresh prompt: each row's logits and the key / value
    its token stores equal its own decode step's, and the prompt's equal its own prefill's."""
    model = family_models[family]
    model.setup_caches(4, 96)
    vocab = model.config.vocab_size
    prompts = {0: _prompt(9, 11, vocab), 1: _prompt(33, 12, vocab)}
    fresh = _prompt(20, 13, vocab)
    nxt = {0: 7, 1: 42}
    with torch.no_grad():
        _zero_caches(model)
        for row, p in prompts.items():
            n = len(p)
            model(torch.tensor([p]), torch.arange(n)[None], torch.tensor([n - 1]), kv_len=n, rows=torch.tensor([row]))
        before = _caches(model)
        want = {row: model(torch.tensor([[nxt[row]]]), torch.tensor([[len(p)]]), torch.tensor([0]), kv_len=len(p) + 1,
                           rows=torch.tensor([row]))[0] for row, p in prompts.items()}
        want[2] = model(torch.tensor([fresh]), torch.arange(20)[None], torch.tensor([19]), kv_len=20,
                        rows=torch.tensor([2]))[0]
        want_cache = _caches(model)
        for layer, (k, v) in zip(model.layers, before):
            layer.attention.kv_cache.k_cache.copy_(k)
            layer.attention.kv_cache.v_cache.copy_(v)
        state = torch.zeros(4, 1, dtype=torch.int64)
        state[0, 0], state[1, 0] = nxt[0], nxt[1]
        packed = PackedPrefill(model, max_tokens=96, max_seqs=4, state_tokens=state)
        got = packed.run([Chunk(fresh, 0, 2, True)] + [Chunk([0], len(p), row, True, from_state=True)
                                                       for row, p in prompts.items()])
    assert got.shape[0] == 3
    for i, row in enumerate((2, 0, 1)):
        torch.testing.assert_close(got[i], want[row], atol=2e-4, rtol=1e-4, msg=f"{family} row {row}")
    for (k, v), (wk, wv) in zip(_caches(model), want_cache):
        for row, span in ((0, len(prompts[0]) + 1), (1, len(prompts[1]) + 1), (2, 20)):
            torch.testing.assert_close(k[row, :, :span], wk[row, :, :span], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[row, :, :span], wv[row, :, :span], atol=1e-5, rtol=1e-5)


def test_packed_tables_give_every_token_its_position_row_and_block(tiny_llama: Transformer) -> None:
    """The tables the packed forward reads (what the Triton kernel is driven by on CUDA), against a
    token-by-token construction: random mixes of later chunks (start > 0) and whole prompts, with
    and without a last chunk, block boundaries included; past the tokens, the blank tables' padding,
    whatever mix came before."""
    from servekit.optimizations.llm.packed import BLOCK_M

    tiny_llama.setup_caches(8, 512)
    packed = PackedPrefill(tiny_llama, max_tokens=8 * 91, max_seqs=8)
    rng = random.Random(0)
    for _ in range(40):
        lengths = [rng.choice([1, 2, BLOCK_M - 1, BLOCK_M, BLOCK_M + 1, rng.randint(1, 90)]) for _ in range(rng.randint(1, 8))]
        chunks = [Chunk([rng.randrange(1, 100) for _ in range(n)], rng.choice([0, rng.randint(1, 100)]), row, rng.random() < 0.7)
                  for row, n in enumerate(lengths)]
        total, segments = packed._load(chunks)
        want_pos, want_rows, want_last, want_blocks, at = [], [], [], [], 0
        for i, c in enumerate(chunks):
            want_pos += list(range(c.start, c.start + len(c.tokens)))
            want_rows += [c.row] * len(c.tokens)
            want_last += [at + len(c.tokens) - 1] if c.last else []
            want_blocks += [(i, off) for off in range(0, len(c.tokens), BLOCK_M)]
            at += len(c.tokens)
        assert total == at and segments == [(sum(lengths[:i]), n, c.start, c.row) for i, (n, c) in enumerate(zip(lengths, chunks))]
        assert packed.tokens[:total].tolist() == [t for c in chunks for t in c.tokens]
        assert packed.positions[:total].tolist() == want_pos and packed.rows[:total].tolist() == want_rows
        assert packed.last_idx[:len(want_last)].tolist() == want_last
        assert packed.seq[:len(chunks)].tolist() == [list(x) for x in segments]
        n_blocks = len(want_blocks)
        assert list(zip(packed.block_seq[:n_blocks].tolist(), packed.block_off[:n_blocks].tolist())) == want_blocks
        assert (packed.block_seq[n_blocks:] == -1).all()  # the kernel's programs past the last block exit
        # Past the tokens, what the blank holds, whatever longer mix came before.
        assert (packed.tokens[total:] == packed.pad_id).all() and not packed.positions[total:].any()
        assert not packed.from_state.any() and (packed.rows[total:] == tiny_llama.spare_row).all()


def test_packed_prefill_refuses_what_it_cannot_run(tiny_llama: Transformer) -> None:
    tiny_llama.setup_caches(4, 128)
    packed = PackedPrefill(tiny_llama, max_tokens=32, max_seqs=2)
    with pytest.raises(ValueError, match="budget"):
        packed.run([Chunk([5] * 20, 0, 0, True), Chunk([5] * 20, 0, 1, True)])
    with pytest.raises(ValueError, match="chunks"):
        packed.run([Chunk([5], 0, i, True) for i in range(3)])
    with pytest.raises(ValueError, match="from_state"):  # no decode state given
        packed.run([Chunk([5], 3, 0, True, from_state=True)])
    riding = PackedPrefill(tiny_llama, max_tokens=32, max_seqs=2, state_tokens=torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="from_state"):  # a decoding row brings one token
        riding.run([Chunk([5, 6], 3, 0, True, from_state=True)])
    with pytest.raises(ValueError, match="CUDA"):
        PackedPrefill(tiny_llama, max_tokens=32, max_seqs=2, graphs=True)
    with pytest.raises(ValueError, match="Triton"):
        PackedPrefill(tiny_llama, max_tokens=32, max_seqs=2, attention="triton")
    with pytest.raises(ValueError, match="compiled packed layers"):
        PackedPrefill(tiny_llama, max_tokens=32, max_seqs=2, blocks=list(tiny_llama.layers))
    built = packed.warmup()
    assert built["attention"] == "torch" and built["compiled"] is False


# --- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tiny_llama: Transformer) -> LlamaRunner:
    return LlamaRunner(tiny_llama, max_seq_len=160, batch_buckets=(1, 2, 4), prefill_buckets=(8, 16, 32, 64, 128))


def test_engine_output_equals_solo_with_mixed_prompt_lengths(runner: LlamaRunner) -> None:
    """Prompts of 3 to 120 tokens arriving over time, greedy and sampled, packed 48 tokens at a
    time in chunks of 16: each request's tokens are exactly its solo generation's."""
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=48)
    counted = Counted(batcher)
    cases = {"a": (_prompt(90, 1), SamplingParams(max_tokens=20)),
             "b": (_prompt(3, 2), SamplingParams(max_tokens=15, temperature=0.9, top_k=30, seed=7)),
             "c": (_prompt(120, 3), SamplingParams(max_tokens=12)),
             "d": (_prompt(40, 4), SamplingParams(max_tokens=10, presence_penalty=1.0, logprobs=2)),
             "e": (_prompt(17, 5), SamplingParams(max_tokens=25, temperature=1.1, top_p=0.8, seed=8)),
             "f": (_prompt(64, 6), SamplingParams(max_tokens=8))}
    tokens = {k: [] for k in cases}
    arrivals = {0: "abc", 2: "d", 3: "e", 6: "f"}
    step = 0
    while step in arrivals or batcher.has_work or any(s > step for s in arrivals):
        for key in arrivals.get(step, ""):
            batcher.add(key, *cases[key])
        for key, u in counted.step().items():
            tokens[key] += u.tokens
        step += 1
    assert max(n + riders for _, n, _, riders in counted.calls) == 48
    assert len({s for s, _, _, _ in counted.calls}) == len(counted.calls)
    assert any(len(sizes) >= 3 for _, _, sizes, _ in counted.calls)  # several requests' chunks in one forward
    # Decoding rows rode in the packed forwards: those steps launched no decode step of their own.
    mixed = {s for s, _, _, riders in counted.calls if riders}
    assert mixed and not mixed & set(counted.launches)
    for key, (prompt, params) in cases.items():
        assert tokens[key] == generate(runner, [prompt], [params])[0].tokens, key


def test_each_step_keeps_the_budget_and_decoding_rows_never_wait_more_than_one_step(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=32)
    counted = Counted(batcher)
    batcher.add("run", _prompt(6, 1), SamplingParams(max_tokens=40))
    counted.step()
    for i, n in enumerate((120, 100, 70)):
        batcher.add(f"long{i}", _prompt(n, 10 + i), SamplingParams(max_tokens=3))
    while any(f"long{i}" in batcher.by_key for i in range(3)):
        updates = counted.step()
        assert len(updates["run"].tokens) == 1  # a token every step while the long prompts go in
    steps = [s for s, _, _, _ in counted.calls]
    assert len(steps) == len(set(steps))  # at most one packed forward per step
    assert all(n + riders <= 32 for _, n, _, riders in counted.calls)  # decode tokens count in the budget
    assert sum(n for _, n, _, _ in counted.calls) == 6 + 120 + 100 + 70  # every prompt token went in exactly once
    # "run" decoded inside the forwards that had long prompts' chunks: one forward a step, not two.
    assert sum(riders for _, _, _, riders in counted.calls) >= len(steps) - 1
    assert not {s for s, _, _, riders in counted.calls if riders} & set(counted.launches)


def test_a_row_at_the_end_of_its_context_rides_until_its_last_read(runner: LlamaRunner) -> None:
    """A request filling the whole context (prompt + max_tokens = max_seq_len) while short prompts
    keep arriving: it rides in packed forwards up to the step that feeds the context's last
    position (launched before its final token is read); every request gets its solo tokens."""
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=48)
    counted = Counted(batcher)
    full = _prompt(120, 21)
    cases = {"full": (full, SamplingParams(max_tokens=runner.max_seq_len - 120))}
    tokens: dict[str, list[int]] = {"full": []}
    batcher.add("full", *cases["full"])
    while batcher.has_work:
        if "full" in batcher.by_key and batcher.by_key["full"].launched:  # a new prompt every step
            key = f"s{len(cases)}"
            cases[key] = (_prompt(5, 30 + len(cases)), SamplingParams(max_tokens=2))
            tokens[key] = []
            batcher.add(key, *cases[key])
        for key, u in counted.step().items():
            tokens[key] += u.tokens
    assert any(riders for *_, riders in counted.calls)
    assert max(c.start for c in counted.riders) == runner.max_seq_len - 1
    for key, (prompt, params) in cases.items():
        assert tokens[key] == generate(runner, [prompt], [params])[0].tokens, key


def test_the_prefill_benchmark_staggers_answers_so_prompts_arrive_beside_decoding_rows(runner: LlamaRunner) -> None:
    """llm_prefill_bench's closed loop with --answer-spread: answers of different lengths, so later
    prompts arrive while other rows decode and ride with them in one forward; every request ends."""
    from servekit.benchmarks.llm_prefill_bench import streams

    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=48)
    counted = Counted(batcher)
    res = streams(batcher, random.Random(0), 256, 4, 3, (5, 12), 24, "s", spread=0.75)
    assert res["requests"] == 12 and res["answer_spread"] == 0.75 and not batcher.has_work
    assert any(riders and n for _, n, _, riders in counted.calls)  # a prompt beside decoding rows


def test_a_short_prompt_behind_long_ones_starts_at_once_and_the_long_ones_are_not_starved(runner: LlamaRunner) -> None:
    batcher = ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=48)
    first: dict[str, int] = {}
    step = 0

    def advance() -> None:
        nonlocal step
        step += 1
        for key, u in batcher.step().items():
            if u.tokens and key not in first:
                first[key] = step

    batcher.add("long0", _prompt(120, 1), SamplingParams(max_tokens=4))
    batcher.add("long1", _prompt(110, 2), SamplingParams(max_tokens=4))
    advance()
    batcher.add("short", _prompt(10, 3), SamplingParams(max_tokens=4))
    advance()
    assert first["short"] == 2  # prefilled whole in the very next forward, beside both long prompts
    # Short prompts keep arriving into the free slots: the oldest long prompt still gets its chunk
    # every step, so it finishes within ceil(120 / 16) steps of its arrival.
    n = 0
    while "long0" not in first:
        if batcher.running < batcher.max_num_seqs:
            batcher.add(f"s{n}", _prompt(12, 100 + n), SamplingParams(max_tokens=2))
            n += 1
        advance()
    assert first["long0"] <= 8 and n > 0
    while batcher.has_work:
        advance()
    assert "long1" in first


@pytest.mark.parametrize("where", ["forward", "new rows"])
def test_a_failed_packed_forward_ends_only_the_request_that_fails_alone(runner: LlamaRunner, where: str) -> None:
    """An out-of-memory prefill (a real one needs a GPU: simulated by a packed forward, or the start
    of its prompts' decode rows (their first tokens sampled on their own, or their rows loaded for
    the riders' sampling half), that raises whenever a marker prompt is in it): its requests are
    prefilled alone next, so the marker's request fails with the error and the one packed beside
    it, and the running one riding in that forward, go on."""
    batcher = ContinuousBatcher(runner)
    marker = _prompt(12, 9)
    real, first_tokens, start_rows = batcher.packed.run, batcher._first_tokens, batcher._start_rows
    failed = []

    def failing(chunks: list[Chunk]) -> torch.Tensor:
        if any(c.tokens[:len(marker)] == marker for c in chunks):
            raise torch.OutOfMemoryError("simulated")
        return real(chunks)

    def fail_on_marker(seqs: list) -> None:
        if any(s.prompt[:len(marker)] == marker for s in seqs):
            failed.append(len(seqs))
            raise torch.OutOfMemoryError("simulated")

    if where == "forward":
        batcher.packed.run = failing
    else:
        batcher._first_tokens = lambda logits, seqs: (fail_on_marker(seqs), first_tokens(logits, seqs))[1]
        batcher._start_rows = lambda seqs: (fail_on_marker(seqs), start_rows(seqs))[1]
    got: dict[str, list[int]] = {"run": [], "oom": [], "mate": []}
    batcher.add("run", _prompt(7, 1), SamplingParams(max_tokens=20))
    for _ in range(3):
        for key, u in batcher.step().items():
            got[key] += u.tokens
    batcher.add("mate", _prompt(5, 2), SamplingParams(max_tokens=6))
    batcher.add("oom", marker, SamplingParams(max_tokens=5))
    updates = batcher.step()  # the packed forward of both fails: each is prefilled alone next
    assert "oom" not in updates and "mate" not in updates and len(updates["run"].tokens) == 1
    got["run"] += updates["run"].tokens
    errors = {}
    while batcher.has_work:
        for key, u in batcher.step().items():
            got[key] += u.tokens
            if u.error is not None:
                errors[key] = u.error
    assert set(errors) == {"oom"} and isinstance(errors["oom"], torch.OutOfMemoryError) and got["oom"] == []
    assert where == "forward" or failed == [2, 1]  # together with the mate, then alone
    assert got["run"] == generate(runner, [_prompt(7, 1)], [SamplingParams(max_tokens=20)])[0].tokens
    assert got["mate"] == generate(runner, [_prompt(5, 2)], [SamplingParams(max_tokens=6)])[0].tokens


def test_the_engine_refuses_a_budget_below_its_chunk(runner: LlamaRunner) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is below prefill_chunk=16"):
        ContinuousBatcher(runner, prefill_chunk=16, max_num_batched_tokens=8)


def test_the_plan_takes_a_token_budget_and_refuses_one_below_the_chunk() -> None:
    from servekit.optimizations.llm.plan import LlmPlan, parse_llm_plan
    from servekit.optimizations.plan import PlanError

    assert LlmPlan().max_num_batched_tokens == 2048
    assert parse_llm_plan({"max_num_batched_tokens": 1024}).max_num_batched_tokens == 1024
    with pytest.raises(PlanError, match="max_num_batched_tokens: 256 is below prefill_chunk 512"):
        parse_llm_plan({"max_num_batched_tokens": 256})
    with pytest.raises(PlanError, match="max_num_batched_tokens"):
        parse_llm_plan({"max_num_batched_tokens": 0})


# --- the Triton kernel and the captured buckets (GPU machine) ----------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_triton_packed_prefill_equals_the_torch_reference_on_cuda(tmp_path: Path, family: str) -> None:
    """fp32 on the GPU (the kernel's dots in TF32): the Triton attention, eager, replayed from each
    bucket's CUDA graph, and with the layers compiled around it (then captured), gives the torch reference's logits and cache rows, for packs of fresh
    prompts, a later chunk, and decoding rows riding beside a later turn (their tokens from the
    decode state) (gemma3: sliding-window layers, a window shorter than the prompts)."""
    overrides = {"head_dim": 32} if family == "llama3" else {}  # the kernel takes power-of-two head sizes
    model = load_llama(write_checkpoint(family, tmp_path / family, **overrides), "cuda", torch.float32)
    model.setup_caches(4, 256)
    vocab = model.config.vocab_size
    prompts = [_prompt(n, i, vocab) for i, n in enumerate((7, 130, 64, 200))]
    more = _prompt(10, 9, vocab)  # a later turn of request 2, beside rows 0 and 1 decoding
    packs = [[Chunk(prompts[0], 0, 0, True), Chunk(prompts[3][:150], 0, 3, False), Chunk(prompts[1], 0, 1, True)],
             [Chunk(prompts[3][150:], 150, 3, True), Chunk(prompts[2], 0, 2, True)],
             [Chunk(more, 64, 2, True), Chunk([0], 7, 0, True, from_state=True), Chunk([0], 130, 1, True, from_state=True)]]
    spans = [8, 131, 74, 200]
    state = torch.tensor([[5], [9], [0], [0]], device="cuda")  # rows 0 and 1's next tokens
    results = {}
    compiled = [torch.compile(layer, dynamic=True) for layer in model.layers]  # as a compiling plan's engine has
    for name, kw in {"torch": dict(attention="torch"), "triton": dict(attention="triton"),
                     "graphs": dict(attention="triton", graphs=True),
                     "compiled": dict(attention="triton", graphs=True, blocks=compiled)}.items():
        packed = PackedPrefill(model, max_tokens=512, max_seqs=4, state_tokens=state, **kw)
        packed.warmup()
        _zero_caches(model)
        logits = [packed.run(p).clone() for p in packs]
        results[name] = (logits, _caches(model))
    want_logits, want_cache = results["torch"]
    for name in ("triton", "graphs", "compiled"):
        logits, cache = results[name]
        for got, want in zip(logits, want_logits):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{family} {name}: {m}")
            assert torch.equal(got.argmax(-1), want.argmax(-1))
        # Layers after the first write k/v computed from TF32 attention: about 1e-2 apart at worst.
        for (k, v), (wk, wv) in zip(cache, want_cache):
            for row, span in enumerate(spans):
                torch.testing.assert_close(k[row, :, :span], wk[row, :, :span], atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(v[row, :, :span], wv[row, :, :span], atol=2e-2, rtol=2e-2)
