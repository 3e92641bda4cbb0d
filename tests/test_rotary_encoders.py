"""ModernBERT (rotary, GeGLU, pre-norm, alternating global and sliding-window layers) against
sentence-transformers on a tiny random model built with transformers' own ModernBertConfig (fp32, CPU):
embeddings, padding, texts longer than the local window, prompts, the published config spelling,
refusals, and `servekit archive PATH` through a live TorchServe."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from servekit.optimizations.embed.runner import EmbeddingRunner
from servekit.optimizations.models.encoder import UnsupportedModel, check_checkpoint, load_encoder
from servekit.optimizations.models.rotary_encoder import GLOBAL, LOCAL, RotaryEncoderConfig
from servekit.optimizations.plan import parse_plan
from tiny_encoders import LONG, SHORT, TEXTS, reference, st_model

PLAN = {"device": "cpu", "buckets": {"batch_sizes": [1, 4], "seq_lens": [8, 16, 24]}}
# nomic-embed-text's task prefixes, applied as sentence-transformers prompts.
PROMPTS = {"query": "search_query: ", "document": "search_document: "}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return st_model(tmp_path_factory.mktemp("rotary") / "modernbert", "modernbert", "mean", prompts=PROMPTS)


@pytest.fixture(scope="module")
def runner(model_dir, one_thread) -> EmbeddingRunner:
    return EmbeddingRunner(model_dir, parse_plan(PLAN), golden_texts=TEXTS)


def test_embeddings_equal_sentence_transformers(model_dir, runner):
    cfg = runner_encoder_cfg(model_dir)
    assert cfg.layer_types == (GLOBAL, LOCAL, LOCAL, GLOBAL) and cfg.window == 4
    assert cfg.rope_theta == {GLOBAL: 160000.0, LOCAL: 10000.0}
    # Texts longer than a local layer's reach (4 keys either side): the window really cuts attention.
    assert max(len(ids) for ids in runner.tokenize(TEXTS)[0]) == 24 > 2 * cfg.window + 1
    torch.testing.assert_close(runner.embed(TEXTS), reference(model_dir, TEXTS), atol=2e-5, rtol=1e-4)


def test_cls_pooling_and_dense_head(tmp_path, one_thread):
    path = st_model(tmp_path / "cls", "modernbert", "cls", dense=16, normalize=False, seed=5)
    r = EmbeddingRunner(path, parse_plan(PLAN), golden_texts=TEXTS)
    torch.testing.assert_close(r.embed(TEXTS), reference(path, TEXTS), atol=2e-5, rtol=1e-4)


def test_padded_rows_do_not_change_results(model_dir, runner):
    """The module itself on one right-padded batch of mixed lengths: each row's real tokens get the
    hidden states that row gets alone at its exact length (the CPU runner never pads, a captured
    GPU bucket does)."""
    encoder = load_encoder(model_dir)
    rows = runner.tokenize(TEXTS)[0]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [encoder.cfg.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        batched = encoder(ids, mask)
        for i, r in enumerate(rows):
            alone = encoder(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0]
            torch.testing.assert_close(batched[i, :len(r)], alone, atol=1e-5, rtol=1e-5)
    # Mixed lengths really were padded, some past a local layer's window.
    assert len({len(r) for r in rows}) > 2 and min(len(r) for r in rows) < width


def test_task_prefixes_as_sentence_transformers_prompts(model_dir, runner):
    for name in PROMPTS:
        torch.testing.assert_close(runner.embed(SHORT, prompt_name=name), reference(model_dir, SHORT, prompt_name=name),
                                   atol=2e-5, rtol=1e-4)
    assert not torch.allclose(runner.embed(SHORT, "query"), runner.embed(SHORT, "document"))
    assert not torch.allclose(runner.embed(SHORT, "query"), runner.embed(SHORT))


def test_published_config_spelling_reads_the_same(model_dir, tmp_path):
    """Published ModernBERT checkpoints write global_attn_every_n_layers and global/local_rope_theta
    instead of transformers 5's layer_types and rope_parameters."""
    raw = json.loads((model_dir / "config.json").read_text())
    old = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    old.update(global_rope_theta=160000.0, local_rope_theta=10000.0, global_attn_every_n_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert RotaryEncoderConfig.from_json(tmp_path / "config.json") == runner_encoder_cfg(model_dir)


def test_refusals_name_the_problem(model_dir, tmp_path):
    raw = json.loads((model_dir / "config.json").read_text())
    raw["rope_parameters"][GLOBAL] = {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModel, match="rope_type 'yarn' for full_attention layers is not supported"):
        RotaryEncoderConfig.from_json(tmp_path / "config.json")
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    save_file({k: v for k, v in state.items() if k != "layers.2.mlp.Wi.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="lacks 1 tensors of a modernbert encoder .first: layers.2.mlp_in.weight"):
        check_checkpoint(tmp_path)
    save_file({**state, "layers.0.attn.rotary.inv_freq": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="unexpected tensor 'layers.0.attn.rotary.inv_freq'"):
        check_checkpoint(tmp_path)


def test_archive_recognises_a_modernbert_folder(model_dir):
    from servekit.model_source import EMBEDDING, embedding_source, infer_kind

    assert infer_kind(model_dir) == EMBEDDING
    source = embedding_source(model_dir)
    assert source.max_tokens == 24
    names = {Path(w if isinstance(w, Path) else w[0]).name for w in source.files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "config_sentence_transformers.json"} <= names


@pytest.mark.server
def test_live_torchserve_serves_an_archived_modernbert(model_dir, tmp_path):
    """`servekit archive PATH` -> TorchServe -> the OpenAI client: sentence-transformers' numbers, prompts included."""
    from openai import OpenAI

    from servekit.archive import archive_path
    from servekit.torchserve import TorchServe

    store = tmp_path / "store"
    mar, _ = archive_path(model_dir, store, name="modernbert", device="cpu", compress=False)
    assert mar.exists()
    with TorchServe(tmp_path / "run", store) as ts:
        ts.register("modernbert.mar", "modernbert", batch_size=4, max_batch_delay_ms=20, workers=1)
        client = OpenAI(base_url=f"{ts.inference_url}/predictions/modernbert/1.0/v1", api_key="unused")
        resp = client.embeddings.create(model="modernbert", input=TEXTS, encoding_format="float")
        torch.testing.assert_close(torch.tensor([d.embedding for d in resp.data]), reference(model_dir, TEXTS),
                                   atol=2e-5, rtol=1e-4)
        query = client.embeddings.create(model="modernbert", input=SHORT + LONG, encoding_format="float",
                                         extra_body={"prompt_name": "query"})
        torch.testing.assert_close(torch.tensor([d.embedding for d in query.data]),
                                   reference(model_dir, SHORT + LONG, prompt_name="query"), atol=2e-5, rtol=1e-4)


def runner_encoder_cfg(model_dir: Path) -> RotaryEncoderConfig:
    return RotaryEncoderConfig.from_json(model_dir / "config.json")
