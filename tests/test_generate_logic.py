"""servekit.optimizations.llm.generate's runner, driven by the continuous engine (offline.generate), on a
tiny random-init Llama (CPU, eager: the same static-buffer decode path that CUDA graphs replay on GPU)."""

from __future__ import annotations


import pytest
import torch

from servekit.optimizations.buckets import pick_bucket
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams, default_kv_buckets, default_prefill_buckets
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.models.llama import LlamaConfig, Transformer, init_random


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

MAX_SEQ = 96


@pytest.fixture(scope="module")
def model() -> Transformer:
    return init_random(LlamaConfig.tiny(), seed=0)


@pytest.fixture(scope="module")
def runner(model: Transformer) -> LlamaRunner:
    return LlamaRunner(model, max_seq_len=MAX_SEQ, batch_buckets=(1, 2, 4), prefill_buckets=(8, 16, 32, 64))


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


def _greedy_reference(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by recomputing the full sequence each step (no incremental cache use)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_buckets_and_padding() -> None:
    assert pick_bucket(1, (1, 2, 4)) == 1 and pick_bucket(3, (1, 2, 4)) == 4
    with pytest.raises(ValueError, match="largest bucket 4"):
        pick_bucket(5, (1, 2, 4))
    assert default_prefill_buckets(100) == (16, 32, 64, 100)
    assert default_prefill_buckets(64) == (16, 32, 64)


def test_batched_greedy_equals_recomputed_greedy_per_prompt(runner: LlamaRunner, model: Transformer) -> None:
    prompts = _prompts([5, 20, 11])  # 3 rows -> batch bucket 4 with a row nobody reads
    out = generate(runner, prompts, [SamplingParams(max_tokens=12)] * 3)
    for p, c in zip(prompts, out):
        assert c.tokens == _greedy_reference(model, p, 12)
        assert c.finish_reason == "length"


def test_result_does_not_depend_on_batch_composition(runner: LlamaRunner) -> None:
    prompts = _prompts([9, 30, 3, 17], seed=1)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=7),
              SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.3, top_p=0.8, seed=8),
              SamplingParams(max_tokens=10, temperature=1.0, seed=9)]
    together = generate(runner, prompts, params)
    alone = [generate(runner, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    again = generate(runner, prompts, params)
    assert [c.tokens for c in again] == [c.tokens for c in together]  # seeded: reproducible
    other_seed = generate(runner, prompts[:1], [SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=70)])
    assert other_seed[0].tokens != together[0].tokens


def test_unseeded_sampling_differs_between_calls(runner: LlamaRunner) -> None:
    prompt = _prompts([6], seed=2)
    sp = SamplingParams(max_tokens=16, temperature=1.5)
    assert generate(runner, prompt, [sp])[0].tokens != generate(runner, prompt, [sp])[0].tokens


def test_stop_tokens_and_max_tokens_per_row(runner: LlamaRunner) -> None:
    prompts = _prompts([7, 12], seed=3)
    free = generate(runner, prompts, [SamplingParams(max_tokens=20)] * 2)
    stop_tok = free[0].tokens[5]
    first = free[0].tokens.index(stop_tok)
    out = generate(runner, prompts, [SamplingParams(max_tokens=20, stop_token_ids=(stop_tok,)),
                                     SamplingParams(max_tokens=3)])
    assert out[0].tokens == free[0].tokens[:first + 1] and out[0].finish_reason == "stop"
    assert out[1].tokens == free[1].tokens[:3] and out[1].finish_reason == "length"


def test_each_row_is_reported_until_it_finishes(runner: LlamaRunner) -> None:
    """Engine steps report every running row's new token; a row stops being reported once it ends."""
    batcher = ContinuousBatcher(runner)
    prompts = _prompts([4, 4], seed=4)
    batcher.add("short", prompts[0], SamplingParams(max_tokens=2))
    batcher.add("long", prompts[1], SamplingParams(max_tokens=5))
    got: dict[str, list[int]] = {"short": [], "long": []}
    finish: dict[str, list] = {"short": [], "long": []}
    while batcher.has_work:
        for key, u in batcher.step().items():
            got[key] += u.tokens
            finish[key].append(u.finish_reason)
    assert [len(got["short"]), len(got["long"])] == [2, 5]
    assert finish["short"] == [None, "length"] and finish["long"] == [None] * 4 + ["length"]


def test_generation_up_to_the_end_of_the_cache(runner: LlamaRunner, model: Transformer) -> None:
    prompt = _prompts([60], seed=5)
    out = generate(runner, prompt, [SamplingParams(max_tokens=MAX_SEQ - 60)])
    assert out[0].tokens == _greedy_reference(model, prompt[0], MAX_SEQ - 60)


def test_bad_requests_are_rejected_before_any_work(runner: LlamaRunner) -> None:
    assert runner.check([], SamplingParams()) == "the prompt is empty"
    assert "exceeds the context of 96" in runner.check([1] * 50, SamplingParams(max_tokens=47))
    assert runner.check([1] * 50, SamplingParams(max_tokens=46)) is None
    assert "more than the 64" in runner.check([1] * 65, SamplingParams(max_tokens=1))
    assert "max_tokens" in runner.check([1], SamplingParams(max_tokens=0))
    assert "top_p" in runner.check([1], SamplingParams(top_p=0.0))
    assert "temperature" in runner.check([1], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="request 1: the prompt is empty"):
        generate(runner, [[1], []], [SamplingParams(max_tokens=4)] * 2)
    # More prompts than the largest batch bucket: the engine runs them as rows free up.
    prompts = _prompts([3, 5, 4, 6, 2], seed=12)
    out = generate(runner, prompts, [SamplingParams(max_tokens=3)] * 5)
    assert [c.tokens for c in out] == [_greedy_reference(runner.model, p, 3) for p in prompts]


def test_warmup_runs_every_bucket_on_cpu() -> None:
    model = init_random(LlamaConfig.tiny(), seed=0)
    r = LlamaRunner(model, max_seq_len=32, batch_buckets=(1, 2), prefill_buckets=(8, 32))
    timings = r.warmup()
    assert set(timings) == {"decode_s"}
    prompts = _prompts([3, 8], seed=6)
    out = generate(r, prompts, [SamplingParams(max_tokens=4)] * 2)
    assert [c.tokens for c in out] == [_greedy_reference(model, p, 4) for p in prompts]


def test_cuda_graphs_need_a_cuda_model() -> None:
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA model"):
        LlamaRunner(init_random(LlamaConfig.tiny()), max_seq_len=32, cuda_graphs=True)


def test_a_second_runner_on_the_same_model_is_detected() -> None:
    model = init_random(LlamaConfig.tiny())
    first = LlamaRunner(model, max_seq_len=32, batch_buckets=(1,), prefill_buckets=(32,))
    LlamaRunner(model, max_seq_len=64, batch_buckets=(1,), prefill_buckets=(64,))
    with pytest.raises(RuntimeError, match="one runner per model"):
        generate(first, [[1, 2]], [SamplingParams(max_tokens=2)])


def test_decode_crossing_kv_buckets_matches_reference() -> None:
    model = init_random(LlamaConfig.tiny(), seed=0)
    r = LlamaRunner(model, max_seq_len=96, batch_buckets=(2,), prefill_buckets=(64,), kv_buckets=(16, 32, 64))
    assert r.kv_buckets == (16, 32, 64, 96)
    # Row 0 is long but stops early; row 1 is short and runs on: once row 0 is done, steps attend
    # over small kv buckets that row 0's (now unused) positions no longer fit in.
    prompts = _prompts([60, 5], seed=7)
    out = generate(r, prompts, [SamplingParams(max_tokens=3), SamplingParams(max_tokens=40)])
    assert out[0].tokens == _greedy_reference(model, prompts[0], 3)
    assert out[1].tokens == _greedy_reference(model, prompts[1], 40)
    assert default_kv_buckets(2048) == (256, 512, 1024, 2048) and default_kv_buckets(100) == (100,)


def test_cancelled_rows_stop_reporting_and_free_their_slot(runner: LlamaRunner) -> None:
    prompts = _prompts([6, 9], seed=8)
    free = generate(runner, prompts, [SamplingParams(max_tokens=10)] * 2)
    batcher = ContinuousBatcher(runner)
    got: dict[int, list[int]] = {0: [], 1: []}
    for i, p in enumerate(prompts):
        batcher.add(i, p, SamplingParams(max_tokens=10))
    while len(got[1]) < 2:
        for key, u in batcher.step().items():
            got[key] += u.tokens
    batcher.cancel(1)
    assert batcher.running == 1
    while batcher.has_work:
        for key, u in batcher.step().items():
            got[key] += u.tokens
    assert got[0] == free[0].tokens
    assert got[1] == free[1].tokens[:len(got[1])] and len(got[1]) < 10  # nothing after the cancel
    batcher.add(2, prompts[0], SamplingParams(max_tokens=10))
    batcher.step()
    batcher.cancel(2)
    assert batcher.running == 0 and not batcher.step()  # the step in flight is dropped too


def _tiny_checkpoint(tmp_path) -> str:
    """A tiny random Llama saved the way convert_gguf_to_safetensors saves SmolLM2."""
    import json

    from safetensors.torch import save_file

    from servekit.optimizations.models.llama import ours_to_hf

    model = init_random(LlamaConfig.tiny(), seed=0)
    save_file({ours_to_hf(k): v.contiguous() for k, v in model.state_dict().items() if k != "output.weight"},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf()))
    return str(tmp_path)


def test_llm_plan_errors_name_the_key() -> None:
    from servekit.optimizations.llm.plan import parse_llm_plan
    from servekit.optimizations.plan import PlanError

    plan = parse_llm_plan({"precision": "bf16", "buckets": {"batch_sizes": [1, 4]}, "limits": {"max_tokens": 100}})
    assert plan.batch_sizes == (1, 4) and plan.limits.default_max_tokens == 100 and plan.label() == "bf16"
    for raw, msg in [({"bucket": {}}, "servekit.bucket: unknown key"),
                     ({"buckets": {"kv_lens": [4096]}}, "servekit.buckets.kv_lens: 4096 exceeds max_seq_len"),
                     ({"buckets": {"batch_sizes": [4, 2]}}, "strictly increasing"),
                     ({"compile": "max-autotune"}, "servekit.compile"),
                     ({"cuda_graphs": "yes"}, "servekit.cuda_graphs"),
                     ({"limits": {"max_tokens": 4096}}, "servekit.limits.max_tokens"),
                     ({"limits": {"default_max_tokens": 2000}}, "servekit.limits.default_max_tokens"),
                     ({"speculation": {"head": "x"}}, "servekit.speculation.head: unknown key"),
                     ({"speculation": {"n_heads": 0}}, "servekit.speculation.n_heads"),
                     ({"speculation": {"max_batch": -1}}, "servekit.speculation.max_batch"),
                     ({"speculation": {"heads": "../outside"}}, "servekit.speculation.heads"),
                     ({"speculation": "on"}, "servekit.speculation: expected a mapping"),
                     ({"prefill_chunk": 0}, "servekit.prefill_chunk")]:
        with pytest.raises(PlanError, match=msg):
            parse_llm_plan(raw)
    spec = parse_llm_plan({"precision": "bf16", "speculation": {"n_heads": 3, "max_batch": 4}})
    assert spec.speculation is not None and (spec.speculation.heads, spec.speculation.n_heads) == ("speculator", 3)
    assert spec.label() == "bf16+spec3" and parse_llm_plan({"speculation": None}).speculation is None


def test_plan_with_speculation_gives_the_runner_the_archived_heads_as_its_strategy(tmp_path) -> None:
    from servekit.optimizations.llm.plan import load_llm_runner, parse_llm_plan
    from servekit.optimizations.plan import PlanError
    from servekit.optimizations.llm.speculative import Speculator, SpeculatorConfig, SpeculativeDecoding, save_speculator

    ckpt = _tiny_checkpoint(tmp_path)
    raw = {"device": "cpu", "max_seq_len": 64, "limits": {"max_tokens": 32},
           "buckets": {"batch_sizes": [1, 2], "prompt_lens": [16, 64], "kv_lens": [32]},
           "speculation": {"heads": "heads", "n_heads": 2, "max_batch": 1}}
    with pytest.raises(PlanError, match="no speculator.json in the archive folder 'heads'"):
        load_llm_runner(ckpt, parse_llm_plan(raw))
    model = init_random(LlamaConfig.tiny(), seed=0)
    save_speculator(Speculator(SpeculatorConfig.for_model(model, 3)).reset_parameters(seed=1, random_out=True),
                    tmp_path / "heads")
    runner, plan, _ = load_llm_runner(ckpt, parse_llm_plan(raw))
    spec = runner.speculation
    assert isinstance(spec, SpeculativeDecoding) and spec.n_heads == 2 and spec.max_spec_batch == 1
    assert spec.base is runner and runner.plan["speculative"]["n_heads"] == 2
    assert plan.label() == "fp32+spec2"
    prompts = _prompts([5])
    # The engine takes verify steps for a greedy row alone, plain steps for two rows (max_batch 1).
    batcher = ContinuousBatcher(runner)
    out = generate(runner, prompts, [SamplingParams(max_tokens=6)], batcher=batcher)
    assert batcher.spec_stats.proposed[0] > 0
    assert out[0].tokens == _greedy_reference(runner.model, prompts[0], 6)
    batcher = ContinuousBatcher(runner)
    two = generate(runner, _prompts([5, 6]), [SamplingParams(max_tokens=4)] * 2, batcher=batcher)
    assert batcher.spec_stats.proposed[0] == 0 and all(len(c.tokens) == 4 for c in two)
    batcher = ContinuousBatcher(runner)
    generate(runner, prompts, [SamplingParams(max_tokens=4)], speculate=[False], batcher=batcher)
    assert batcher.spec_stats.proposed[0] == 0
    with pytest.raises(PlanError, match="servekit.speculation: can use 1..3 heads, asked for 5"):
        load_llm_runner(ckpt, parse_llm_plan({**raw, "speculation": {"heads": "heads", "n_heads": 5}}))
    with pytest.raises(PlanError, match="servekit.prefill_graphs: unknown key"):  # static prefill is gone
        parse_llm_plan({**raw, "prefill_graphs": 16})


def test_load_llm_runner_fails_loudly_or_falls_back_as_the_plan_says(tmp_path) -> None:
    from servekit.optimizations.llm.plan import load_llm_runner, parse_llm_plan
    from servekit.optimizations.plan import PlanError

    ckpt = _tiny_checkpoint(tmp_path)
    base = {"device": "cpu", "cuda_graphs": True, "max_seq_len": 64, "limits": {"max_tokens": 32},
            "buckets": {"batch_sizes": [1, 2], "prompt_lens": [16, 64], "kv_lens": [32]}}
    with pytest.raises(PlanError, match="cuda_graphs needs a CUDA device.*fallback: eager"):
        load_llm_runner(ckpt, parse_llm_plan(base))
    threads = torch.get_num_threads()
    try:
        runner, plan, downgrades = load_llm_runner(ckpt, parse_llm_plan({**base, "fallback": "eager",
                                                                         "cpu_threads": 1}))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert downgrades == ["cuda_graphs needs a CUDA device"] and plan.cuda_graphs is False
    assert runner.kv_buckets == (32, 64) and runner.max_batch == 2
    out = generate(runner, _prompts([5]), [SamplingParams(max_tokens=4)])
    assert out[0].tokens == _greedy_reference(runner.model, _prompts([5])[0], 4)


def test_compiled_blocks_match_eager_with_four_graphs(model: Transformer, runner: LlamaRunner) -> None:
    """Regional compilation: the transformer block is compiled once (dynamic shapes) and reused by
    every layer and every bucket: at most 4 graphs (decode and the packed prefill x batch 1/>1)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = LlamaRunner(model, max_seq_len=MAX_SEQ, batch_buckets=(1, 2, 4), prefill_buckets=(8, 16, 32, 64),
                           compile_prefill=True, compile_decode=True)
    compiled.warmup()
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3),
              SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=4)]
    for lengths in ([5], [12, 3, 7], [40, 2]):
        prompts = _prompts(lengths, seed=len(lengths) + 10)
        ps = params[:len(prompts)]
        assert [c.tokens for c in generate(compiled, prompts, ps)] == [c.tokens for c in generate(runner, prompts, ps)]
    assert 1 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def _penalized_reference(model: Transformer, prompt: list[int], n: int, presence: float, frequency: float
                         ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy with OpenAI's penalties over the generated tokens, by recomputing the full sequence;
    also each step's raw log-softmax (what logprobs report)."""
    seq, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
            logprobs.append(logits.log_softmax(-1))
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.shape[-1]).float()
            tok = int((logits - counts * frequency - (counts > 0).float() * presence).argmax())
            seq.append(tok)
            out.append(tok)
    return out, logprobs


def test_penalties_match_a_recomputed_reference_and_change_greedy_output(runner: LlamaRunner,
                                                                         model: Transformer) -> None:
    prompts = _prompts([7, 19], seed=5)
    params = [SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(max_tokens=16, frequency_penalty=2.0)]
    out = generate(runner, prompts, params)
    for p, sp, c in zip(prompts, params, out):
        expected, _ = _penalized_reference(model, p, 16, sp.presence_penalty, sp.frequency_penalty)
        assert c.tokens == expected
    plain = _greedy_reference(model, prompts[1], 16)
    assert out[1].tokens != plain  # the penalty did something on this prompt
    assert len(set(out[1].tokens)) > len(set(plain))  # fewer repeats


def test_logprobs_report_the_raw_distribution_and_leave_tokens_unchanged(runner: LlamaRunner,
                                                                         model: Transformer) -> None:
    prompts = _prompts([6, 13, 4], seed=6)
    params = [SamplingParams(max_tokens=9, logprobs=3), SamplingParams(max_tokens=9),
              SamplingParams(max_tokens=9, logprobs=0, temperature=0.8, seed=3)]
    out = generate(runner, prompts, params)
    plain = generate(runner, prompts, [SamplingParams(max_tokens=9), SamplingParams(max_tokens=9),
                                       SamplingParams(max_tokens=9, temperature=0.8, seed=3)])
    assert [c.tokens for c in out] == [c.tokens for c in plain]  # the FULL mode samples the same tokens
    assert out[1].logprobs == []  # a batch-mate that did not ask gets none
    for i in (0, 2):
        assert len(out[i].logprobs) == len(out[i].tokens) == 9
        seq = prompts[i]
        with torch.no_grad():
            for tok, lp in zip(out[i].tokens, out[i].logprobs):
                ref = model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1].log_softmax(-1)
                assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
                top = ref.topk(params[i].logprobs)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
                seq = seq + [tok]
    assert all(lp.logprob == pytest.approx(lp.top[0][1]) for lp in out[0].logprobs)  # greedy: the top token


def test_penalty_and_logprob_ranges_are_checked() -> None:
    assert "presence_penalty" in SamplingParams(presence_penalty=2.5).error()
    assert "frequency_penalty" in SamplingParams(frequency_penalty=-3).error()
    assert "logprobs" in SamplingParams(logprobs=21).error()
    assert SamplingParams(logprobs=20, presence_penalty=-2, frequency_penalty=2).error() is None


@pytest.mark.parametrize("mode", ["greedy", "sample", "filter", "full"])
def test_a_split_step_equals_the_whole_step(runner: LlamaRunner, mode: str) -> None:
    """ForwardStep then SampleStep (the step of batches with grammar rows, the mask loaded between
    the two) give the whole DecodeStep's output and leave the same state behind."""
    from servekit.optimizations.llm.sampling import SamplingTensors

    st, b, kv = runner.states[4], 4, runner.kv_buckets[-1]
    st.load(torch.tensor([5, 17, 99, 3]), torch.tensor([3, 9, 20, 1]),
            SamplingTensors.build([0.0, 0.7, 1.0, 0.9], [0, 20, 0, 5], [1.0, 0.9, 1.0, 0.5], [1, 2, 3, 4], runner.device,
                                  [0.0, 0.5, 0.0, 0.2], [0.0, 0.3, 0.0, 0.1], vocab_size=runner.model.config.vocab_size))
    st.counts.zero_()
    st.counts[1, 7] = 2.0
    before = [t.clone() for t in (st.tokens, st.input_pos, st.counts)]
    whole = runner.steps[(b, mode, kv)].run().clone()
    after = [t.clone() for t in (st.tokens, st.input_pos, st.counts)]
    for t, saved in zip((st.tokens, st.input_pos, st.counts), before):
        t.copy_(saved)
    runner.forward_steps[(b, kv)].run()
    split = runner.sample_steps[(b, mode)].run()
    assert torch.equal(split, whole)
    assert all(torch.equal(t, want) for t, want in zip((st.tokens, st.input_pos, st.counts), after))
    assert not torch.equal(after[0], before[0])  # the step did advance the rows


def test_starting_a_row_clears_the_mask_its_last_request_left() -> None:
    """A grammar row that moves down leaves its last packed mask in its old row, and a free row's
    sampling half applies its packed row too: a request started in that row (its first token
    sampled on its own, or by the riders' sampling half) gets no mask, its neighbours keep theirs;
    a row started for the riders' half sits at its prompt's last position with no penalty counts."""
    from servekit.optimizations.llm.generate import DecodeState
    from servekit.optimizations.llm.sampling import SamplingTensors

    st = DecodeState(4, torch.device("cpu"), vocab_size=40)
    params = SamplingTensors.build([0.0, 0.7], [0, 0], [1.0, 1.0], [1, 2], "cpu", vocab_size=40)
    st.packed.zero_()  # every row's tokens forbidden, as a mask left behind
    st.counts.fill_(3.0)
    st.load_rows(torch.tensor([1]), torch.tensor([7]), torch.tensor([5]), SamplingTensors(*(t[:1] for t in params)))
    st.start_rows(torch.tensor([3]), torch.tensor([11]), SamplingTensors(*(t[1:] for t in params)))
    assert st.packed[1].eq(-1).all() and st.packed[3].eq(-1).all()
    assert st.packed[0].eq(0).all() and st.packed[2].eq(0).all()
    assert st.input_pos[3, 0] == 11 and st.counts[3].eq(0).all() and st.counts[1, 7] == 1 and st.counts[1].sum() == 1
    assert st.params.temperature[3] == pytest.approx(0.7) and st.params.seed[3] == 2
