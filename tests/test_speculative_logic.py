"""Speculative decoding on a tiny random-init Llama, inside the continuous engine (CPU, eager: the same
static-buffer verify step that CUDA graphs replay on GPU): exactness against plain greedy decoding,
acceptance accounting, the batch-size and per-request switches, sampled requests, heads on disk, and
the training recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from servekit.optimizations.llm.continuous import FINISH_ERROR, ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import Completion, generate
from servekit.optimizations.models.llama import LlamaConfig, Transformer, init_random
from servekit.optimizations.llm.sampling import SamplingTensors
from servekit.optimizations.llm.speculative import (SPEC_CONFIG, SPEC_WEIGHTS, SpecStats, Speculator, SpeculatorConfig,
                                                    SpeculativeDecoding, forward_hidden, load_speculator,
                                                    save_speculator, verify_step)
from servekit.optimizations.training import train_speculator

MAX_SEQ = 96
K = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def model() -> Transformer:
    return init_random(LlamaConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def base(model: Transformer) -> LlamaRunner:
    return LlamaRunner(model, max_seq_len=MAX_SEQ, batch_buckets=(1, 2, 4), prefill_buckets=(8, 16, 32, 64),
                       kv_buckets=(16, 32, 48, 64))  # small kv buckets: every step picks one


@pytest.fixture(scope="module")
def random_heads(model: Transformer) -> Speculator:
    return Speculator(SpeculatorConfig.for_model(model, K)).reset_parameters(seed=1, random_out=True)


@pytest.fixture(scope="module")
def spec(base: LlamaRunner, random_heads: Speculator) -> SpeculativeDecoding:
    runner = SpeculativeDecoding(base, random_heads, max_spec_batch=4)
    runner.warmup()
    return runner


@pytest.fixture(scope="module")
def trained_dir(tiny_trained_heads: Path) -> Path:
    return tiny_trained_heads


class OracleSpeculator(Speculator):
    """Drafts from known greedy continuations (eager only): in each step, row i's first
    ``plan(i, step)`` drafts are right and the next one is wrong, so the runner must accept
    exactly that many. ``refs`` must run k+1 tokens past what the rows generate. The rows start
    together, and their first verify step has stale drafts that are all wrong (one token each)."""

    def __init__(self, n_heads: int, vocab_size: int, refs: list[list[int]], plan) -> None:
        super().__init__(SpeculatorConfig(n_heads=n_heads, dim=8, hidden_dim=8, vocab_size=vocab_size))
        self.refs, self.plan, self.vocab_size = refs, plan, vocab_size
        self.reset()

    def reset(self) -> None:
        self.idx: list[int] | None = None  # index in refs[i] of the token the next step feeds
        self.step, self.planned = 0, [0] * len(self.refs)

    def check_base(self, model: Transformer) -> None:
        pass

    def draft(self, model: Transformer, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        k = self.n_heads
        out = torch.zeros(token.shape[0], k, dtype=torch.int64)
        if self.idx is None:
            self.idx = [1] * len(self.refs)  # after the first verify step: the prefill's token, then one more
        else:
            self.idx = [i + m + 1 for i, m in zip(self.idx, self.planned)]
            self.step += 1
        for r, ref in enumerate(self.refs[:token.shape[0]]):  # the rows of the step's batch bucket
            i = self.idx[r]
            if i >= len(ref) - k - 1:
                continue  # finished row: any drafts do
            assert int(token[r]) == ref[i], "the runner fed a token the greedy reference does not have"
            m = self.planned[r] = self.plan(r, self.step)
            row = ref[i + 1:i + 1 + k]
            if m < k:
                row[m] = (row[m] + 1) % self.vocab_size
            out[r] = torch.tensor(row)
        return out.to(token.device)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


LENGTHS = [5, 20, 11, 1, 33, 7, 60, 14, 2, 9, 25, 40]


def _speculative(base: LlamaRunner, spec: SpeculativeDecoding, prompts: list[list[int]],
                 params: list[SamplingParams], speculate: list[bool] | None = None
                 ) -> tuple[list[list[list[int]]], list[Completion], SpecStats]:
    """The prompts through the engine with ``spec`` as the runner's speculation: each row's tokens
    per engine step that gave it some, its completion, and the engine's draft counters."""
    base.speculation = spec
    try:
        batcher = ContinuousBatcher(base)
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            batcher.add(i, prompt, sp, True if speculate is None else speculate[i])
        steps: list[list[list[int]]] = [[] for _ in prompts]
        out = [Completion([], "") for _ in prompts]
        while batcher.has_work:
            for i, u in batcher.step().items():
                assert u.finish_reason != FINISH_ERROR, u.error
                if u.tokens:
                    steps[i].append(u.tokens)
                out[i].tokens += u.tokens
                out[i].logprobs += u.logprobs
                out[i].finish_reason = u.finish_reason or out[i].finish_reason
    finally:
        base.speculation = None
    return steps, out, batcher.spec_stats


def _check_exact(base: LlamaRunner, spec: SpeculativeDecoding, prompts: list[list[int]],
                 params: list[SamplingParams], speculate: list[bool] | None = None) -> SpecStats:
    want = generate(base, prompts, params)
    _, got, stats = _speculative(base, spec, prompts, params, speculate)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.tokens == w.tokens, f"row {i}: speculative output differs from plain decoding"
        assert g.finish_reason == w.finish_reason
    return stats


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_random_heads_are_exact(base: LlamaRunner, spec: SpeculativeDecoding, batch: int) -> None:
    prompts = _prompts(LENGTHS, seed=batch)
    for s in range(0, len(prompts), batch):
        group = prompts[s:s + batch]
        params = [SamplingParams(max_tokens=m) for m in (30, 17, 36, 1)[:len(group)]]
        stats = _check_exact(base, spec, group, params)
        assert stats.proposed[0] > 0  # it did speculate


def test_trained_heads_are_exact_and_accept(base: LlamaRunner, trained_dir: Path) -> None:
    heads = load_speculator(trained_dir)
    runner = SpeculativeDecoding(base, heads, max_spec_batch=4)
    total = SpecStats.empty(K)
    prompts = _prompts(LENGTHS, seed=7)
    for s in range(0, len(prompts), 4):
        stats = _check_exact(base, runner, prompts[s:s + 4], [SamplingParams(max_tokens=30)] * 4)
        total.proposed = [a + b for a, b in zip(total.proposed, stats.proposed)]
        total.accepted = [a + b for a, b in zip(total.accepted, stats.accepted)]
    # Random-init tiny models fall into repetitive greedy loops, which trained heads learn.
    assert total.mean_accepted_length > 1.5
    assert total.acceptance_rate == sorted(total.acceptance_rate, reverse=True)


def test_stop_tokens_and_context_end_are_exact(base: LlamaRunner, spec: SpeculativeDecoding) -> None:
    prompts = _prompts([6, 30, 12, 3], seed=3)
    free = generate(base, prompts, [SamplingParams(max_tokens=40)] * 4)
    # Stop at a token each row produces mid-way; one row runs up to the very end of the cache.
    params = [SamplingParams(max_tokens=40, stop_token_ids=(c.tokens[9],)) for c in free[:3]]
    params.append(SamplingParams(max_tokens=MAX_SEQ - len(prompts[3])))
    stats = _check_exact(base, spec, prompts, params)
    assert stats.proposed[0] > 0


def test_verify_step_accepts_longest_matching_prefix(model: Transformer, random_heads: Speculator) -> None:
    model.setup_caches(4, MAX_SEQ)
    prompt = _prompts([9], seed=11)[0]
    with torch.no_grad():
        ref = []
        seq = list(prompt)
        for _ in range(K + 2):
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
            seq.append(int(logits.argmax()))
            ref.append(seq[-1])
    greedy = SamplingTensors.build([0.0], [0], [1.0], [0])
    def prefill() -> torch.Tensor:  # the prompt into the cache's row 0; its greedy token
        return model(torch.tensor([prompt]), torch.arange(len(prompt))[None])[:, -1].argmax(-1)

    for m in range(K + 1):  # drafts right up to position m, wrong from there on
        draft = torch.tensor([ref[1:K + 1]])
        if m < K:
            draft[0, m] = (draft[0, m] + 1) % 256
        with torch.no_grad():
            first = prefill()
            assert int(first) == ref[0]
            base, accepted, nxt, new_draft = verify_step(
                model, random_heads, first, draft, torch.tensor([len(prompt)]), torch.tensor([1]), greedy, "greedy")
        assert int(accepted) == m
        assert base[0, :m + 1].tolist() == ref[1:m + 2]
        assert int(nxt) == ref[m + 1] and new_draft.shape == (1, K)
        # a row that must not speculate accepts nothing, whatever its drafts
        with torch.no_grad():
            prefill()
            _, accepted, nxt, _ = verify_step(model, random_heads, first, draft, torch.tensor([len(prompt)]),
                                              torch.tensor([0]), greedy, "greedy")
        assert int(accepted) == 0 and int(nxt) == ref[1]


def test_acceptance_accounting(base: LlamaRunner, spec: SpeculativeDecoding) -> None:
    prompts = _prompts([5, 20, 11], seed=5)
    params = [SamplingParams(max_tokens=m) for m in (30, 12, 21)]
    steps, out, stats = _speculative(base, spec, prompts, params)
    assert all(len(row[0]) == 1 for row in steps)  # the prefill's token
    # Every verify step of a live row proposes K drafts; a row emits 1 + accepted tokens per step,
    # except that its last step may be cut short by max_tokens.
    row_steps = sum(len(row) - 1 for row in steps)
    assert stats.proposed == [row_steps] * K
    assert stats.accepted == sorted(stats.accepted, reverse=True) and stats.accepted[0] <= row_steps
    emitted = sum(len(c.tokens) for c in out)
    assert emitted == sum(p.max_tokens for p in params)
    # The counters count what each verify step gave, before a row's last one is cut by max_tokens.
    assert stats.tokens - K * len(prompts) <= emitted - len(prompts) <= stats.tokens
    assert len(prompts) + row_steps <= emitted <= len(prompts) + row_steps + sum(stats.accepted)
    assert stats.mean_accepted_length == pytest.approx(1 + sum(stats.accepted) / row_steps)
    d = stats.to_dict()
    assert len(d["acceptance_rate"]) == K and d["mean_accepted_length"] >= 1.0


def test_batch_size_switch(base: LlamaRunner, random_heads: Speculator) -> None:
    runner = SpeculativeDecoding(base, random_heads, max_spec_batch=2)
    assert runner.spec_buckets == (1, 2)
    prompts = _prompts([5, 8, 13], seed=9)
    params = [SamplingParams(max_tokens=10)] * 3
    stats = _check_exact(base, runner, prompts, params)  # 3 busy rows > 2: plain decoding
    assert stats.proposed == [0] * K
    stats = _check_exact(base, runner, prompts[:2], params[:2])
    assert stats.proposed[0] > 0
    off = SpeculativeDecoding(base, random_heads, max_spec_batch=0)
    assert off.spec_buckets == ()
    assert _check_exact(base, off, prompts[:1], params[:1]).proposed == [0] * K


def test_per_request_switch_and_sampled_requests(base: LlamaRunner, spec: SpeculativeDecoding) -> None:
    prompts = _prompts([5, 20, 11, 8], seed=13)
    greedy = SamplingParams(max_tokens=20)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=1234)
    # Opting out row 0: it accepts no drafts (one token per step), and every row is still exact.
    stats = _check_exact(base, spec, prompts[:2], [greedy] * 2, speculate=[False, True])
    assert stats.proposed[0] > 0
    steps, _, _ = _speculative(base, spec, prompts[:2], [greedy] * 2, speculate=[False, True])
    assert all(len(toks) == 1 for toks in steps[0]) and any(len(toks) > 1 for toks in steps[1])
    # Mixed batch: the sampled rows get exactly the plain runner's tokens for their seed.
    params = [greedy, sampled, greedy, SamplingParams(max_tokens=20, temperature=1.2, seed=99)]
    _check_exact(base, spec, prompts, params)
    # All sampled: no drafts accepted.
    assert _check_exact(base, spec, prompts[:2], [sampled, sampled]).proposed == [0] * K
    # Logprobs or penalties among the running rows: plain (FULL) steps, logprobs reported.
    with_logprobs = SamplingParams(max_tokens=20, logprobs=2)
    _, got, stats = _speculative(base, spec, prompts[:2], [greedy, with_logprobs])
    assert stats.proposed == [0] * K and len(got[1].logprobs) == 20
    assert [c.tokens for c in got] == [c.tokens for c in generate(base, prompts[:2], [greedy] * 2)]


def test_bad_requests_raise_before_any_work(base: LlamaRunner, spec: SpeculativeDecoding) -> None:
    assert base.check([], SamplingParams()) == "the prompt is empty" and spec.max_spec_batch == 4
    base.speculation = spec
    try:
        with pytest.raises(ValueError, match="request 1: the prompt is empty"):
            generate(base, [[5, 6], []], [SamplingParams(max_tokens=4)] * 2)
        with pytest.raises(ValueError, match="exceeds the context"):
            generate(base, [[5] * 10], [SamplingParams(max_tokens=MAX_SEQ)])
        with pytest.raises(ValueError, match="speculate flag"):
            generate(base, [[5]], [SamplingParams(max_tokens=4)], speculate=[True, False])
    finally:
        base.speculation = None


def test_fewer_heads_than_trained(base: LlamaRunner, random_heads: Speculator) -> None:
    runner = SpeculativeDecoding(base, random_heads, max_spec_batch=4, n_heads=2)
    assert runner.n_heads == 2 and random_heads.n_heads == K
    stats = _check_exact(base, runner, _prompts([7, 19], seed=17), [SamplingParams(max_tokens=25)] * 2)
    assert len(stats.proposed) == 2
    with pytest.raises(ValueError, match="1..4 heads"):
        SpeculativeDecoding(base, random_heads, n_heads=5)


def test_forward_hidden_matches_model_forward(model: Transformer) -> None:
    model.setup_caches(4, MAX_SEQ)
    tokens = torch.tensor(_prompts([12, 12], seed=19))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        want = model(tokens, pos)
        logits, hidden = forward_hidden(model, tokens, pos)
    assert torch.equal(logits, want)
    assert hidden.shape == (2, 12, model.config.dim)


def test_heads_round_trip_and_base_mismatch(tmp_path: Path, model: Transformer, random_heads: Speculator) -> None:
    save_speculator(random_heads, tmp_path, {"note": "test"})
    loaded = load_speculator(tmp_path / SPEC_WEIGHTS)
    for (n, a), (m, b) in zip(random_heads.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a.float(), b)
    assert json.loads((tmp_path / SPEC_CONFIG).read_text())["training"] == {"note": "test"}
    other = init_random(LlamaConfig.tiny(dim=32, head_dim=8), seed=0)
    with pytest.raises(ValueError, match="made for dim=64"):
        loaded.check_base(other)


def test_training_recipe_smoke(trained_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((trained_dir / SPEC_CONFIG).read_text())
    assert cfg["n_heads"] == K and cfg["dim"] == 64 and cfg["vocab_size"] == 256
    report = cfg["training"]
    assert report["prompts"]["train"] == 27 and report["prompts"]["held_out"] == 3
    # 27 file and 12 topic prompts, each greedy + 1 sampled completion; held-out prompts greedy only
    assert report["prompts"]["topic_prompts"] == 12 and report["completions"]["sequences"] == 27 * 2 + 12 * 2 + 3
    assert report["draft_vocab"]["tokens"] == 192 and 0.5 < report["draft_vocab"]["target_coverage"] <= 1.0
    assert load_speculator(trained_dir).draft_vocab.numel() == 192
    assert report["train"]["steps"] == 40 and report["examples"]["train"] > 500
    assert len(report["held_out"]["accuracy"]) == K and report["held_out"]["mean_accepted_length"] >= 1.0
    assert 0 < report["train"]["final_loss"] < 5.0  # ln(256) = 5.5 is chance
    with pytest.raises(SystemExit):
        train_speculator.main(["--help"])
    assert "self-distillation" in capsys.readouterr().out


def test_prompt_file_and_split() -> None:
    prompts = train_speculator.load_prompts()
    assert len(prompts) >= 300 and len(set(prompts)) == len(prompts)
    train, held = train_speculator.split_prompts(prompts)
    assert len(held) == len(prompts) // 10 and not set(train) & set(held)


def test_oracle_drafts_are_accepted_exactly_as_planned(base: LlamaRunner, model: Transformer) -> None:
    prompts = _prompts([5, 20, 11], seed=21)
    max_tokens = [30, 12, 25]
    refs = [c.tokens for c in generate(base, prompts, [SamplingParams(max_tokens=m + K + 2) for m in max_tokens])]
    plan = lambda row, step: (row + step) % (K + 1)  # noqa: E731  every acceptance length 0..K
    oracle = OracleSpeculator(K, 256, refs, plan)
    runner = SpeculativeDecoding(base, oracle, max_spec_batch=4)
    stale = next(t for t in range(256) if all(t not in ref for ref in refs))
    runner.draft.fill_(stale)  # the first verify step's drafts: wrong for every row
    steps, out, stats = _speculative(base, runner, prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    for r, row in enumerate(steps):
        # The prefill's token, the stale drafts' step (one token), then 1 + planned tokens per step.
        want = [1, 1] + [plan(r, t) + 1 for t in range(len(row) - 2)]
        assert [len(toks) for toks in row[:-1]] == want[:-1], r
        assert len(row[-1]) <= want[-1] and out[r].finish_reason == "length"
    assert [c.tokens for c in out] == [ref[:m] for ref, m in zip(refs, max_tokens)]
    reads = [len(row) - 1 for row in steps]  # verify steps read per row
    assert stats.proposed == [sum(reads)] * K
    assert stats.accepted == [sum(plan(r, t) > j for r in range(3) for t in range(reads[r] - 1)) for j in range(K)]


# --- draft vocabulary, compiled drafting, topic prompts ----------------------------------------------

def _restricted_heads(model: Transformer, ids: torch.Tensor) -> Speculator:
    heads = Speculator(SpeculatorConfig.for_model(model, K)).reset_parameters(seed=2, random_out=True)
    heads.set_draft_vocab(ids)
    return heads


def test_draft_vocabulary_limits_guesses_and_round_trips(model: Transformer, tmp_path: Path) -> None:
    ids = torch.arange(5, model.config.vocab_size, 7)
    heads = _restricted_heads(model, ids)
    hidden = torch.randn(6, model.config.dim)
    token = torch.randint(0, model.config.vocab_size, (6,))
    drafts = heads.draft(model, hidden, token)
    assert set(drafts.flatten().tolist()) <= set(ids.tolist())
    # the same guesses as picking within the vocabulary from the full lm_head logits
    state, want = hidden, []
    for stage in heads.stages:
        state, feat = stage(state, model.tok_embeddings(token))
        token = heads.pick(model.output(feat))
        want.append(token)
    assert torch.equal(drafts, torch.stack(want, 1))
    unrestricted = Speculator(heads.config)
    unrestricted.load_state_dict({k: v for k, v in heads.state_dict().items() if k != "draft_vocab"}, strict=False)
    assert not set(unrestricted.draft(model, hidden, token).flatten().tolist()) <= set(ids.tolist())

    save_speculator(heads, tmp_path / "h")
    loaded = load_speculator(tmp_path / "h")
    assert loaded.draft_vocab.dtype == torch.int64 and torch.equal(loaded.draft_vocab, ids)
    save_speculator(unrestricted, tmp_path / "old")  # a file without a vocabulary (older heads)
    assert load_speculator(tmp_path / "old").draft_vocab.numel() == 0
    with pytest.raises(ValueError, match="draft vocabulary ids"):
        heads.set_draft_vocab(torch.tensor([model.config.vocab_size]))


def test_compiled_draft_is_exact(model: Transformer, base: LlamaRunner) -> None:
    """compile_verify compiles the drafting loop too: same drafts as eager, output still exact."""
    heads = _restricted_heads(model, torch.arange(0, model.config.vocab_size, 3))
    hidden = torch.randn(2, model.config.dim, generator=torch.Generator().manual_seed(0))
    token = torch.tensor([3, 9])
    eager = heads.draft(model, hidden, token)  # not prepared yet: eager, lm_head rows gathered per call
    runner = SpeculativeDecoding(base, heads, max_spec_batch=2, compile_verify=True)
    assert heads._draft_fn is not None and heads._draft_head is not None
    assert torch.equal(runner.speculator.draft(model, hidden, token), eager)
    assert eager.shape == (2, K)
    prompts = _prompts([7, 19], seed=21)
    _check_exact(base, runner, prompts, [SamplingParams(max_tokens=24)] * 2)


def test_draft_vocabulary_from_targets() -> None:
    targets = torch.tensor([[5, 5, 5, -1], [7, 7, 9, -1], [5, 1, -1, -1]])
    ids, coverage = train_speculator.draft_vocabulary(targets, vocab_size=16, size=2)
    assert ids.tolist() == [5, 7] and coverage == pytest.approx(6 / 8)
    assert train_speculator.draft_vocabulary(targets, 16, 0)[0].numel() == 0
    assert train_speculator.draft_vocabulary(targets, 16, 16)[0].numel() == 0


def test_topic_prompts_are_distinct_and_repeatable(tmp_path: Path) -> None:
    a = train_speculator.topic_prompts(500)
    assert len(set(a)) == 500 and a == train_speculator.topic_prompts(500)
    assert a != train_speculator.topic_prompts(500, seed=1)
    shipped = set(train_speculator.load_prompts())
    assert not shipped & set(a)  # the held-out evaluation prompts stay unseen
    assert all(not any(c in p for c in "{}") for p in a)
    topics = tmp_path / "topics.txt"
    topics.write_text("# comment\nowls\nkites\n")
    assert len(train_speculator.topic_prompts(10, topics)) == 10
    with pytest.raises(ValueError, match="too many"):
        train_speculator.topic_prompts(1000, topics)
    topics.write_text("owls\n")
    with pytest.raises(ValueError, match="at least 2 topics"):
        train_speculator.topic_prompts(3, topics)
