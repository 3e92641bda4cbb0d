"""servekit's encoder and pooling head against sentence-transformers, for every supported
architecture and pooling mode, on tiny random models built here (fp32, CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servekit.optimizations.embed.runner import EmbeddingRunner
from servekit.optimizations.plan import parse_plan
from tiny_encoders import LONG, SHORT, TEXTS, hf_encoder, reference, st_model

# A small bucket (8) that the short texts fit and the long ones overflow, up to the models' limit (24).
PLAN = {"device": "cpu", "buckets": {"batch_sizes": [1, 4], "seq_lens": [8, 16, 24]}}


def runner(path: Path, plan: dict | None = None) -> EmbeddingRunner:
    return EmbeddingRunner(path, parse_plan(plan or PLAN), golden_texts=TEXTS)


@pytest.mark.parametrize("family, pooling, dense, normalize", [
    ("bert", "mean", None, True),
    ("roberta", "cls", None, True),
    ("xlm-roberta", "max", 16, True),
    ("distilbert", "mean_sqrt_len_tokens", None, False),
    ("mpnet", "weightedmean", None, True),
    ("bert", "lasttoken", 16, False),
    ("roberta", ("cls", "mean", "max"), 24, True),
])
def test_embeddings_equal_sentence_transformers(tmp_path, one_thread, family, pooling, dense, normalize):
    path = st_model(tmp_path / "model", family, pooling, dense=dense, normalize=normalize)
    ref = reference(path, TEXTS)
    r = runner(path)
    assert r.max_tokens == 24 and r.normalized == normalize
    ours = r.embed(TEXTS)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    # The long texts really were cut where sentence-transformers cuts them, not at the 8-token bucket.
    assert all(len(ids) == 24 for ids in r.tokenize(LONG)[0])


def test_plain_encoder_is_mean_pooled_up_to_its_positions(tmp_path, one_thread, caplog):
    path = hf_encoder(tmp_path / "plain", "bert")
    ref = reference(path, TEXTS)
    r = runner(path, {"device": "cpu", "buckets": {"batch_sizes": [1, 4], "seq_lens": [8, 32, 80]}})
    assert "no modules.json: mean pooling" in caplog.text
    assert r.spec.pooling == ("mean",) and not r.normalized and r.max_tokens == 80
    torch.testing.assert_close(r.embed(TEXTS), ref, atol=2e-5, rtol=1e-4)


def test_prompts_from_the_model(tmp_path, one_thread):
    prompts = {"query": "query: ", "passage": "passage: "}
    path = st_model(tmp_path / "model", "mpnet", "mean", prompts=prompts, default_prompt_name="passage")
    r = runner(path)
    for name in ("query", "passage"):
        torch.testing.assert_close(r.embed(SHORT, prompt_name=name), reference(path, SHORT, prompt_name=name),
                                   atol=2e-5, rtol=1e-4)
    # No prompt named: the model's default applies, as in sentence-transformers.
    torch.testing.assert_close(r.embed(SHORT), reference(path, SHORT), atol=2e-5, rtol=1e-4)
    assert not torch.allclose(r.embed(SHORT, "query"), r.embed(SHORT, "passage"))


def test_token_ids_give_the_texts_embeddings(tmp_path, one_thread):
    path = st_model(tmp_path / "model", "roberta", "mean")
    r = runner(path)
    tokens = r.encode_texts(TEXTS)
    assert all(r.prefix[0] not in t for t in tokens)  # a text's own tokens, no <s>
    torch.testing.assert_close(r.embed_ids(r.wrap(tokens)[0]), r.embed(TEXTS))


def test_compiled_mpnet_serves_every_bucket_without_recompiling(tmp_path, one_thread):
    """The relative-position bias and the pooling head compile with the encoder (fullgraph), in one
    dynamic-shape graph for batches 2 and 4 (batch 1's own graph: test_embedding_runner.py)."""
    path = st_model(tmp_path / "model", "mpnet", "weightedmean", dense=16)
    r = runner(path, {**PLAN, "compile": "default", "buckets": {"batch_sizes": [2, 4], "seq_lens": [8, 24]}})
    ref = reference(path, TEXTS)
    for texts in (SHORT[:1], SHORT, LONG, TEXTS):
        torch.testing.assert_close(r.embed(texts), reference(path, texts), atol=2e-5, rtol=1e-4)
    assert r.recompiles() == 0
    torch.testing.assert_close(r.embed(TEXTS), ref, atol=2e-5, rtol=1e-4)


def test_sequence_buckets_default_to_the_models_own_limit(tmp_path) -> None:
    """A plan without `seq_lens` gets buckets up to the model's max_seq_length: a text longer than
    the old fixed 256-token default embeds as sentence-transformers embeds it, uncut."""
    folder = st_model(tmp_path / "long", "bert", max_seq_length=300, seed=3, max_positions=320)
    runner = EmbeddingRunner(folder, parse_plan({"device": "cpu", "buckets": {"batch_sizes": [1, 2]}}),
                             golden_texts=["a text"])
    assert runner.buckets.seq_lens == (16, 32, 64, 128, 256, 300) and runner.max_tokens == 300
    words = (" ".join(LONG) * 4).split()
    n = next(k for k in range(len(words)) if len(runner.encode_texts([" ".join(words[:k])])[0]) > 264)
    text = " ".join(words[:n])  # just over 264 tokens: past the old 256 default, within the model's 300
    assert 264 < len(runner.encode_texts([text])[0]) <= 298
    got = runner.embed([text, "short"])
    want = reference(folder, [text, "short"])
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family", ["bert", "mpnet", "distilbert"])
def test_first_position_alone_equals_the_full_pass(tmp_path, one_thread, family):
    """A classification head reads the first position only: the encoder's `first_only` pass (its last
    layer computing that one position, MPNet's relative bias included) gives the full pass's values."""
    from servekit.optimizations.models.encoder import load_encoder

    model = load_encoder(hf_encoder(tmp_path / "m", family))
    ids = torch.randint(5, model.cfg.vocab_size, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        full, first = model(ids, mask), model(ids, mask, first_only=True)
    assert first.shape == (3, 1, full.shape[-1])
    torch.testing.assert_close(first[:, 0], full[:, 0], atol=1e-5, rtol=1e-5)


def test_a_missing_attention_tensor_is_named(tmp_path):
    """Queries, keys and values are stacked at load: a checkpoint without one of them says which."""
    from safetensors.torch import load_file, save_file

    from servekit.optimizations.models.encoder import UnsupportedModel, load_encoder

    path = hf_encoder(tmp_path / "m", "bert")
    state = load_file(str(path / "model.safetensors"))
    key = next(k for k in state if k.endswith("layer.1.attention.self.value.bias"))
    save_file({k: v for k, v in state.items() if k != key}, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match=r"lacks the attention tensor 'layers.1.value.bias' beside "
                                               r"layers.1.query.bias, layers.1.key.bias"):
        load_encoder(path)
