"""Bring your own decoder: Llama (llama3 / linear RoPE, biases, tied and untied), Qwen2 (q/k/v
biases, sharded safetensors) and Mistral checkpoints written by transformers, served by servekit's
runtime from exactly the files an archive ships. transformers (fp32) is the reference throughout."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from decoder_checkpoints import CHAT_TEMPLATE, EOS, EOT, FAMILIES, write_checkpoint
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.continuous import ContinuousBatcher
from servekit.optimizations.llm.generate import LlamaRunner, SamplingParams
from servekit.optimizations.llm.offline import generate
from servekit.optimizations.models.llama import LlamaConfig, generation_stop_ids, load_config, load_llama
from servekit.optimizations.llm.plan import LlmPlan, SpecPlan, load_llm_runner, stop_token_ids
from servekit.optimizations.plan import PlanError

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    return {f: write_checkpoint(f, root / f, seed=i, shard=f == "qwen2") for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {f: transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            for f, d in checkpoints.items()}


def test_qwen2_checkpoint_is_sharded(checkpoints: dict[str, Path]) -> None:
    files = {p.name for p in checkpoints["qwen2"].iterdir()}
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert len([f for f in files if f.endswith(".safetensors")]) > 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_logits_equal_transformers(family: str, checkpoints, references) -> None:
    ours = load_llama(checkpoints[family], "cpu", torch.float32)
    ours.setup_caches(max_batch_size=2, max_seq_len=64)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = references[family](tokens).logits
        full = ours(tokens, torch.arange(24).expand(2, 24))
        steps = [ours(tokens[:, :10], torch.arange(10).expand(2, 10))]  # prefill, then one token a step
        steps += [ours(tokens[:, p:p + 1], torch.full((2, 1), p)) for p in range(10, 24)]
    torch.testing.assert_close(full, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, dim=1), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama-linear-bias", "qwen2"])
def test_fused_projections_keep_the_biases(family: str, checkpoints) -> None:
    model = load_llama(checkpoints[family], "cpu", torch.float32)
    model.setup_caches(1, 32)
    tokens = torch.arange(3, 19)[None]
    with torch.no_grad():
        before = model(tokens, torch.arange(16)[None])
        model.fuse_projections()
        after = model(tokens, torch.arange(16)[None])
    attn = model.layers[0].attention
    assert attn.wqkv.bias is not None and attn.wqkv.bias.shape[0] == attn.wqkv.weight.shape[0]
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_rope_scaling_is_applied(checkpoints) -> None:
    """The llama3 and linear checkpoints' logits depend on their scaling (so the parity above checks it)."""
    for family in ("llama3", "llama-linear-bias"):
        scaled = load_llama(checkpoints[family])
        config = json.loads((checkpoints[family] / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
        plain = load_llama(checkpoints[family])
        plain.config = LlamaConfig.from_hf(config)
        tokens = torch.arange(3, 27)[None]
        for m in (scaled, plain):
            m.setup_caches(1, 32)
        with torch.no_grad():
            diff = (scaled(tokens, torch.arange(24)[None]) - plain(tokens, torch.arange(24)[None])).abs().max()
        assert diff > 1e-2, family


def _rebuilt(folder: Path, **changes: object) -> torch.nn.Module:
    """The checkpoint's weights under its config with ``changes`` (switches turned off)."""
    from servekit.optimizations.models.llama import model_from_hf_state_dict
    from servekit.optimizations.models.weights import load_safetensors

    config = dataclasses.replace(load_config(folder), **changes)
    return model_from_hf_state_dict(config, load_safetensors(folder))


@pytest.mark.parametrize("family, changes", [
    ("gemma3", {"layer_types": ("full_attention",) * 3}),  # the sliding window
    ("gemma3", {"rope_local_base": None}),  # the local layers' own RoPE base
    ("gemma3", {"rope_scaling": None}),  # linear scaling of the global layers
    ("gemma3", {"qk_norm": False}),
    ("gemma3", {"attn_scalar": None}),  # query_pre_attn_scalar
    ("gemma2", {"attn_softcap": None}),
    ("gemma2", {"logit_softcap": None}),
    ("gemma2", {"layer_types": ("full_attention",) * 2}),
    ("qwen3", {"qk_norm": False}),
    ("phi3", {"layer_types": (), "sliding_window": None}),  # its window, in every layer
])
def test_each_family_switch_changes_the_logits(family: str, changes: dict, checkpoints) -> None:
    """Each switch a family sets matters on these checkpoints (so the parity above checks it)."""
    folder = checkpoints[family]
    if changes.get("qk_norm") is False:  # the norms' weights are then unused: drop them
        from servekit.optimizations.models.llama import model_from_hf_state_dict
        from servekit.optimizations.models.weights import load_safetensors

        state = {k: v for k, v in load_safetensors(folder).items() if "_norm" not in k.rsplit(".", 2)[-2]}
        plain = model_from_hf_state_dict(dataclasses.replace(load_config(folder), **changes), state)
    else:
        plain = _rebuilt(folder, **changes)
    models = [load_llama(folder), plain]
    tokens = torch.arange(3, 27)[None]
    for m in models:
        m.setup_caches(1, 32)
    with torch.no_grad():
        a, b = (m(tokens, torch.arange(24)[None]) for m in models)
    assert (a - b).abs().max() > 1e-2


def _hf_greedy(reference, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [lg[0] for lg in out.logits]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_runner_greedy_and_logprobs_equal_transformers_generate(family: str, checkpoints, references) -> None:
    """Chat and plain prompts of different lengths in one batch through the runner (fused
    projections, bucketed prefill and decode), greedy with the model's own stop ids."""
    folder = checkpoints[family]
    tok = ChatTokenizer(folder)
    stops = stop_token_ids(folder, tok)
    prompts = [tok.encode_chat(MESSAGES), tok.encode_prompt("The sea is"), tok.encode_prompt("x")]
    runner = LlamaRunner(load_llama(folder, "cpu", torch.float32), max_seq_len=96, batch_buckets=(1, 4),
                         prefill_buckets=(16, 64), kv_buckets=(32, 96))
    n = 12
    plain = generate(runner, prompts, [SamplingParams(max_tokens=n, stop_token_ids=stops)] * 3)
    with_logprobs = generate(runner, prompts, [SamplingParams(max_tokens=n, stop_token_ids=stops, logprobs=0)] * 3)
    for prompt, ours, ours_lp in zip(prompts, plain, with_logprobs):
        ref_tokens, ref_logits = _hf_greedy(references[family], prompt, n)
        # transformers stops at the eos ids of generation_config.json, ours at every stop id: the same here.
        assert ours.tokens == ref_tokens[:len(ours.tokens)] and ours_lp.tokens == ours.tokens
        assert (ours.finish_reason == "stop") == (len(ours.tokens) < n or ours.tokens[-1] in stops)
        ref_lp = [torch.log_softmax(lg.float(), -1)[t].item() for lg, t in zip(ref_logits, ours.tokens)]
        assert [lp.logprob for lp in ours_lp.logprobs] == pytest.approx(ref_lp, abs=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma2", "phi3"])
def test_continuous_engine_output_equals_solo_output(family: str, checkpoints) -> None:
    """Requests joining a running batch, long prompts in chunks (across the sliding windows),
    greedy, sampled and with logprobs: each gets what it gets alone."""
    from servekit.optimizations.llm.continuous import ContinuousBatcher

    runner = LlamaRunner(load_llama(checkpoints[family]), max_seq_len=96, batch_buckets=(1, 2, 4),
                         prefill_buckets=(8, 16, 32, 64))
    gen = torch.Generator().manual_seed(1)
    cases = {"a": (20, SamplingParams(max_tokens=20)),
             "b": (37, SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=7)),
             "c": (9, SamplingParams(max_tokens=16, logprobs=2))}
    prompts = {k: torch.randint(3, 260, (n,), generator=gen).tolist() for k, (n, _) in cases.items()}
    batcher = ContinuousBatcher(runner, prefill_chunk=8)
    got: dict[str, list[int]] = {k: [] for k in cases}
    logprobs: dict[str, list] = {k: [] for k in cases}
    batcher.add("a", prompts["a"], cases["a"][1])
    for step in range(200):
        if step == 3:
            batcher.add("b", prompts["b"], cases["b"][1])
            batcher.add("c", prompts["c"], cases["c"][1])
        for key, update in batcher.step().items():
            got[key] += update.tokens
            logprobs[key] += update.logprobs
        if step > 3 and not batcher.has_work:
            break
    for key, (_, params) in cases.items():
        solo = generate(runner, [prompts[key]], [params])[0]
        assert got[key] == solo.tokens, key
        assert [lp.logprob for lp in logprobs[key]] == pytest.approx([lp.logprob for lp in solo.logprobs], abs=1e-5)


def test_triton_kernels_are_refused_for_blocks_they_do_not_fuse(checkpoints) -> None:
    pytest.importorskip("triton")
    from servekit.optimizations.kernels.triton_decode import TritonDecode

    with pytest.raises(ValueError, match="kernels: torch"):
        TritonDecode(load_llama(checkpoints["qwen3"]))


def test_the_families_page_lists_every_family_of_the_registry() -> None:
    from servekit.optimizations.models.families import DECODER_FAMILIES

    page = (Path(__file__).resolve().parents[1] / "docs" / "families.md").read_text()
    for family in DECODER_FAMILIES.values():
        assert f"`{family.model_type}`" in page, family.model_type
        assert family.gguf_arch is None or f"`{family.gguf_arch}`" in page, family.gguf_arch


def _first_occurrences(tokens: list[int], skip: set[int]) -> list[int]:
    """Positions j where tokens[j] appears for the first time (and is not in ``skip``)."""
    return [j for j, t in enumerate(tokens) if t not in skip and t not in tokens[:j]]


def test_generation_stops_on_every_eos_id_of_the_model_files(checkpoints, tmp_path: Path) -> None:
    """An id from config.json (an int, then a list) and from generation_config.json each end the
    generation where the model first emits it."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["llama3"], folder)
    tok = ChatTokenizer(folder)
    runner = LlamaRunner(load_llama(folder), max_seq_len=96, batch_buckets=(1,), prefill_buckets=(64,))
    prompt = tok.encode_chat(MESSAGES)
    free = generate(runner, [prompt], [SamplingParams(max_tokens=24)])[0].tokens
    positions = _first_occurrences(free, {tok.eos_token_id})[1:4]
    assert len(positions) == 3, f"the tiny model repeats itself too much: {free}"
    a, b, c = (free[j] for j in positions)
    cases = [({"eos_token_id": a}, {"eos_token_id": None}, positions[0]),
             ({"eos_token_id": [c, b]}, {}, positions[1]),
             ({"eos_token_id": None}, {"eos_token_id": [c]}, positions[2])]
    for config_eos, gen_eos, stop_at in cases:
        for name, update in (("config.json", config_eos), ("generation_config.json", gen_eos)):
            data = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**data, **update}))
        stops = stop_token_ids(folder, ChatTokenizer(folder))
        assert set(generation_stop_ids(folder)) <= set(stops) and tok.eos_token_id in stops
        out = generate(runner, [prompt], [SamplingParams(max_tokens=24, stop_token_ids=stops)])[0]
        assert out.finish_reason == "stop" and out.tokens == free[:stop_at + 1], (config_eos, gen_eos)


def test_chat_template_and_prompts_tokenize_as_transformers(checkpoints) -> None:
    folder = checkpoints["qwen2"]
    ours, ref = ChatTokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    expected = ref.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ours.encode_chat(MESSAGES) == expected
    assert ours.render(MESSAGES).startswith("<s><|system|>Be brief.<|eot|>")
    assert ours.encode_prompt("héllo") == ref("héllo")["input_ids"]
    assert ours.eos_token_id == ref.convert_tokens_to_ids(EOS)


def test_chat_template_as_named_list_and_special_tokens_map(checkpoints, tmp_path: Path) -> None:
    """Older tokenizer_config.json files: named templates, special tokens only in special_tokens_map.json."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["mistral"], folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "unused"}, {"name": "default", "template": CHAT_TEMPLATE}]}))
    tok = ChatTokenizer(folder)
    assert tok.render([{"role": "user", "content": "hi"}]) == "<s><|user|>hi<|eot|><|assistant|>"
    assert tok.eos_token_id == tok.token_id(EOS)


def _hf(model_type: str, **extra) -> dict:
    return {"model_type": model_type, "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 256, **extra}


def test_transformers_4_and_5_config_keys_read_the_same() -> None:
    v4 = _hf("llama", rope_theta=5e5, rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    v5 = _hf("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64})
    assert LlamaConfig.from_hf(v4) == LlamaConfig.from_hf(v5)
    assert LlamaConfig.from_hf(v4).rope_scaling.rope_type == "llama3"
    config = LlamaConfig.from_hf(_hf("qwen2", eos_token_id=[5, 7], tie_word_embeddings=True))
    assert config.qkv_bias and not config.o_bias and config.eos_token_ids == (5, 7)
    assert LlamaConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("hf, message", [
    (_hf("phi"), "model_type 'phi'"),
    (_hf("phi3", rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
     "LongRoPE .* is not implemented: it switches between two sets of RoPE factors"),
    (_hf("phi3", partial_rotary_factor=0.75), "partial_rotary_factor 0.75"),
    (_hf("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic' is not supported"),
    (_hf("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "RoPE type 'yarn'"),
    (_hf("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "lack 'factor'"),
    (_hf("llama", hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_by_name(hf: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf(hf)


def test_sliding_window_must_cover_the_context(checkpoints, tmp_path: Path) -> None:
    assert LlamaConfig.from_hf(_hf("mistral", sliding_window=None)).sliding_window is None
    assert LlamaConfig.from_hf(_hf("qwen2", sliding_window=16, use_sliding_window=False)).sliding_window is None
    windowed = LlamaConfig.from_hf(_hf("qwen2", sliding_window=16, use_sliding_window=True))
    windowed.check_context(16)
    with pytest.raises(ValueError, match="sliding window of 16 tokens"):
        windowed.check_context(17)
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["mistral"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    assert load_config(folder).sliding_window == 32
    with pytest.raises(PlanError, match="servekit.max_seq_len: .*sliding window of 32 tokens"):
        load_llm_runner(str(folder), LlmPlan(device="cpu", max_seq_len=64, batch_sizes=(1,), warmup=False))


def test_checkpoint_with_unannounced_bias_is_refused(checkpoints, tmp_path: Path) -> None:
    """Biases the config does not declare would be dropped silently: refuse instead."""
    folder = tmp_path / "model"
    shutil.copytree(checkpoints["llama-linear-bias"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    with pytest.raises(KeyError, match="does not use"):
        load_llama(folder)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3", "gemma2", "phi3"])
def test_speculator_trained_on_a_model_dir_serves_plain_greedy_output(family: str, checkpoints, tmp_path: Path) -> None:
    """`servekit train-speculator --model-dir` on a Qwen2 checkpoint (sharded, biases), a Qwen3 one
    (q/k norms per head), Gemma ones (scaled embeddings, sliding layers, soft-capped logits) and a
    Phi-3 one (fused qkv and gate_up weights), then the heads served from the model folder:
    speculative greedy output equals plain greedy output."""
    from servekit.optimizations.training import train_speculator

    folder = tmp_path / "model"
    shutil.copytree(checkpoints[family], folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Say {w}." for w in "one two three four five six seven eight nine ten".split()))
    assert train_speculator.main(["--model-dir", str(folder), "--dtype", "fp32", "--out", str(folder / "speculator"),
                                  "--prompts", str(prompts), "--new-tokens", "8", "--samples", "0", "--steps", "5",
                                  "--heads", "2", "--hidden-mult", "0.5", "--gen-batch", "4", "--topic-prompts", "0",
                                  "--draft-vocab", "0", "--threads", "1", "--quiet"]) == 0
    report = json.loads((folder / "speculator" / "speculator.json").read_text())["training"]
    assert report["base_config"]["vocab_size"] == load_config(folder).vocab_size
    plan = LlmPlan(device="cpu", max_seq_len=64, batch_sizes=(1, 2), prompt_lens=(32,), kv_lens=(64,),
                   speculation=SpecPlan(heads="speculator", max_batch=2))
    runner, _, _ = load_llm_runner(str(folder), plan)
    assert runner.speculation is not None
    tok = ChatTokenizer(folder)
    stops = stop_token_ids(folder, tok)
    batch = [tok.encode_chat([{"role": "user", "content": "Say hi."}]), tok.encode_prompt("Hello")]
    params = [SamplingParams(max_tokens=10, stop_token_ids=stops)] * 2
    batcher = ContinuousBatcher(runner)
    speculated = generate(runner, batch, params, batcher=batcher)
    assert batcher.spec_stats.proposed[0] > 0  # the heads did draft
    plain = generate(runner, batch, params, speculate=[False, False])
    assert [c.tokens for c in speculated] == [c.tokens for c in plain]


def test_llm_handler_serves_a_model_folder_as_an_archive_ships_it(checkpoints, references, tmp_path: Path) -> None:
    """The handler loads exactly the files an archive of a model folder holds (Qwen2, sharded) and
    answers chat and text completions with transformers' greedy tokens, stopping on the model's ids."""
    from mock_context import mock_context, serve

    from servekit.handlers.llm_handler import LlmService

    folder = tmp_path / "archive"
    folder.mkdir()
    src = checkpoints["qwen2"]
    shipped = ["config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json", "special_tokens_map.json",
               *json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()]
    for name in set(shipped):
        shutil.copy(src / name, folder / name)
    config = {"continuousBatching": True,
              "servekit": {"device": "cpu", "precision": "fp32", "max_seq_len": 96, "limits": {"max_tokens": 16},
                           "buckets": {"batch_sizes": [1, 2], "prompt_lens": [64], "kv_lens": [96]}}}
    ctx = mock_context(folder, config, batch_size=2, model_name="byo")
    service = LlmService()
    service.initialize(ctx)
    tok = ChatTokenizer(folder)
    assert set(service.api.stop_ids) == {tok.token_id(EOS), tok.token_id(EOT)}
    # Logprobs name each generated token (its bytes; random weights emit bytes that are no text).
    answers = serve(service.handle, ctx, [("v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16,
                                                                   "temperature": 0, "logprobs": True}),
                                          ("v1/completions", {"prompt": "The sea is", "max_tokens": 16,
                                                              "temperature": 0, "logprobs": 0})])
    assert [a[0] for a in answers] == [200, 200]
    out = [json.loads(a[1]) for a in answers]
    chat, text = out[0]["choices"][0], out[1]["choices"][0]
    got = [[bytes(e["bytes"]) for e in chat["logprobs"]["content"]], text["logprobs"]["tokens"]]
    for answer, choice, tokens, prompt in zip(out, (chat, text), got,
                                              [tok.encode_chat(MESSAGES), tok.encode_prompt("The sea is")]):
        ref_tokens, _ = _hf_greedy(references["qwen2"], prompt, 16)
        n = answer["usage"]["completion_tokens"]
        stopped = ref_tokens[n - 1] in service.api.stop_ids
        assert choice["finish_reason"] == ("stop" if stopped else "length")
        shown = ref_tokens[:n - 1] if stopped else ref_tokens[:n]  # a stop token is not part of the answer
        name = tok.token_bytes if choice is chat else tok.token_text
        assert tokens == [name(t) for t in shown]
