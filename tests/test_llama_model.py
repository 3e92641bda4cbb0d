"""Logic of servekit.optimizations.models.llama on a tiny random-init model (fast, CPU)."""

from __future__ import annotations


import pytest
import torch

from servekit.optimizations.models.llama import (LlamaConfig, Transformer, hf_to_ours, init_random, model_from_hf_state_dict,
                                 ours_to_hf)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    model = init_random(LlamaConfig.tiny(), seed=0)
    model.setup_caches(max_batch_size=4, max_seq_len=64)
    return model


def _forward(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Full forward of one row from position 0."""
    pos = torch.arange(tokens.shape[-1])[None]
    with torch.no_grad():
        return model(tokens[None], pos)[0]


def test_matches_transformers_llama_with_same_weights(tiny: Transformer) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(**{k: v for k, v in tiny.config.to_hf().items()
                                            if k not in ("architectures", "model_type", "torch_dtype")})
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    ours = tiny.state_dict()
    hf.load_state_dict({k: ours[hf_to_ours(k)] for k in hf.state_dict()}, strict=True)
    tokens = torch.randint(0, tiny.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = tiny(tokens, torch.arange(20).expand(2, 20))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_incremental_decode_equals_full_forward(tiny: Transformer) -> None:
    tokens = torch.randint(0, tiny.config.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    full = _forward(tiny, tokens)
    with torch.no_grad():
        steps = [tiny(tokens[None, :10], torch.arange(10)[None])[0]]  # prefill 10, then 1 by 1
        for p in range(10, 24):
            steps.append(tiny(tokens[None, p:p + 1], torch.tensor([[p]]))[0])
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-5, rtol=1e-5)


def test_right_padded_batch_rows_equal_single_rows(tiny: Transformer) -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 17, 11]
    prompts = [torch.randint(0, tiny.config.vocab_size, (n,), generator=gen) for n in lengths]
    batch = torch.zeros(3, 17, dtype=torch.int64)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    last_idx = torch.tensor([n - 1 for n in lengths])
    with torch.no_grad():
        last = tiny(batch, torch.arange(17).expand(3, 17), last_idx)
        # Then one decode step per row at its own position: each row attends only to its own span.
        nxt = torch.tensor([[7], [8], [9]])
        step = tiny(nxt, last_idx[:, None] + 1)[:, 0]
    for i, p in enumerate(prompts):
        torch.testing.assert_close(last[i], _forward(tiny, p)[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[i], _forward(tiny, torch.cat([p, nxt[i]]))[-1], atol=1e-5, rtol=1e-5)


def test_cache_rows_are_independent(tiny: Transformer) -> None:
    """Writing rows 0..1 leaves rows 2..3 of every layer's cache untouched."""
    cache = tiny.layers[0].attention.kv_cache
    cache.k_cache[2:].fill_(123.0)
    with torch.no_grad():
        tiny(torch.ones(2, 5, dtype=torch.int64), torch.arange(5).expand(2, 5))
    assert torch.all(cache.k_cache[2:] == 123.0)
    assert not torch.all(cache.k_cache[:2, :, :5] == 0.0)


def test_batch_larger_than_cache_is_rejected(tiny: Transformer) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        tiny(torch.ones(5, 1, dtype=torch.int64), torch.zeros(5, 1, dtype=torch.int64))


def test_tied_embeddings_share_storage_after_loading() -> None:
    config = LlamaConfig.tiny()
    model = init_random(config, seed=1)
    sd = {ours_to_hf(k): v for k, v in model.state_dict().items() if k != "output.weight"}
    loaded = model_from_hf_state_dict(config, sd)
    assert loaded.output.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()
    loaded.setup_caches(1, 16)
    model.setup_caches(1, 16)
    tokens = torch.arange(8)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, tokens), model(tokens, tokens))


def test_missing_tensor_is_named() -> None:
    config = LlamaConfig.tiny()
    with pytest.raises(KeyError, match="checkpoint lacks"):
        model_from_hf_state_dict(config, {"model.embed_tokens.weight": torch.zeros(256, 64)})


def test_config_roundtrip_through_hf_dict() -> None:
    config = LlamaConfig()
    assert LlamaConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        LlamaConfig.from_hf({**config.to_hf(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="lack 'factor'"):
        LlamaConfig.from_hf({**config.to_hf(), "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}})


def test_attending_over_a_cache_prefix_equals_the_whole_cache(tiny: Transformer) -> None:
    tokens = torch.randint(0, tiny.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        whole = tiny(tokens, pos)
        prefix = tiny(tokens, pos, kv_len=12)
        step = tiny(tokens[:, :1], torch.tensor([[12], [5]]), kv_len=13)
        step_whole = tiny(tokens[:, :1], torch.tensor([[12], [5]]))
    torch.testing.assert_close(prefix, whole)
    torch.testing.assert_close(step, step_whole)


def test_fused_projections_give_the_same_logits_with_fewer_matmuls() -> None:
    model = init_random(LlamaConfig.tiny(), seed=3)
    model.setup_caches(max_batch_size=2, max_seq_len=32)
    tokens = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    before = _forward(model, tokens)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    model.fuse_projections()
    model.fuse_projections()  # idempotent
    torch.testing.assert_close(_forward(model, tokens), before, rtol=1e-5, atol=1e-5)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == n_linear - 3 * model.config.n_layers
    layer = model.layers[0]
    assert not hasattr(layer.attention, "wq") and not hasattr(layer.feed_forward, "w1")
    cfg = model.config
    assert layer.attention.wqkv.weight.shape == ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.dim)
    assert layer.feed_forward.w13.weight.shape == (2 * cfg.intermediate_size, cfg.dim)
