"""Rotary encoders, fp32 on CPU.

ModernBERT (rotary, GeGLU, pre-norm, alternating global and sliding-window layers) against
sentence-transformers on a tiny random model built with transformers' own ModernBertConfig:
embeddings, padding, texts longer than the local window, prompts, the published config spelling,
refusals, and `servekit archive PATH` through a live TorchServe.

Nomic BERT (nomic-embed-text: rotary, SwiGLU, post-norm) has no config class outside its own remote
code, so its tiny checkpoint is written by hand and compared with a reference written here from the
published formulas, one text at a time, with its task prefixes applied as sentence-transformers does.

Both run unpadded on eager plans (every test here but the compiled one): checked against the padded
path, and by what the linear layers receive."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from servekit.optimizations.embed.runner import EmbeddingRunner
from servekit.optimizations.models.encoder import UnsupportedModel, check_checkpoint, load_encoder
from servekit.optimizations.models.rotary_encoder import GLOBAL, LOCAL, RotaryEncoderConfig
from servekit.optimizations.plan import parse_plan
from tiny_encoders import LONG, SHORT, TEXTS, nomic_st_model, reference, st_model

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
        # The padded path (compiled and captured plans) gives the same real-token states.
        torch.testing.assert_close(encoder.forward_padded(ids, mask)[mask.bool()], batched[mask.bool()],
                                   atol=1e-5, rtol=1e-5)
    # Mixed lengths really were padded, some past a local layer's window.
    assert len({len(r) for r in rows}) > 2 and min(len(r) for r in rows) < width


def test_the_cpu_runner_computes_no_padding(model_dir, runner):
    """Through the served path: the eager CPU plan pads each chunk to its longest text, and the
    encoder's linear layers still receive only each chunk's real tokens."""
    rows = runner.tokenize(TEXTS)[0]
    chunks = runner.chunks(rows)
    real = sorted(sum(len(rows[i]) for i in c.indices) for c in chunks)
    padded = sorted(c.batch * c.seq for c in chunks)
    assert real != padded  # the chunks do hold padding
    seen = []

    def record(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            seen.append(inputs[0].shape[:-1].numel())

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        runner.embed_ids(rows, chunks)
    finally:
        hook.remove()
    per_pass = 4 * runner_encoder_cfg(model_dir).num_hidden_layers  # qkv, out, MLP in and out per layer
    assert sorted(seen) == sorted(n for n in real for _ in range(per_pass))


def _rotary_encoder(family: str, model_dir: Path, tmp_path: Path):
    return load_encoder(model_dir if family == "modernbert" else nomic_st_model(tmp_path / "nomic"))


# Very different lengths: one token, the longest the tests serve, and between; past the window of 4.
LENGTHS = [1, 24, 3, 11]


def _random_batch(vocab: int, lengths: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    width = max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, vocab, (len(lengths), width), generator=gen).masked_fill(mask == 0, pad_id)
    return ids, mask


@pytest.mark.parametrize("family", ["modernbert", "nomic_bert"])
def test_unpadded_equals_padded_on_very_different_lengths(family, model_dir, tmp_path, one_thread):
    encoder = _rotary_encoder(family, model_dir, tmp_path)
    ids, mask = _random_batch(encoder.cfg.vocab_size, LENGTHS, encoder.cfg.pad_token_id)
    with torch.no_grad():
        unpadded, padded = encoder.forward_unpadded(ids, mask), encoder.forward_padded(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(unpadded[real], padded[real], atol=1e-5, rtol=1e-5)
    assert unpadded[~real].abs().max() == 0  # nothing was computed there
    assert padded[~real].abs().max() > 0


@pytest.mark.parametrize("family", ["modernbert", "nomic_bert"])
def test_padding_is_not_computed(family, model_dir, tmp_path, one_thread):
    """What every linear layer, norm and the embedding lookup receive: the real tokens only on the
    default (eager) path, every padded position on the padded one."""
    encoder = _rotary_encoder(family, model_dir, tmp_path)
    ids, mask = _random_batch(encoder.cfg.vocab_size, LENGTHS, encoder.cfg.pad_token_id)
    seen: list[tuple[str, int]] = []

    def record(module, inputs, output):
        x = inputs[0]
        seen.append((type(module).__name__, x.numel() if isinstance(module, torch.nn.Embedding) else x.shape[:-1].numel()))

    hooks = [m.register_forward_hook(record) for m in encoder.modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Embedding))]
    try:
        with torch.no_grad():
            encoder(ids, mask)
            unpadded, seen[:] = list(seen), []
            encoder.forward_padded(ids, mask)
    finally:
        for h in hooks:
            h.remove()
    # q/k/v and out per layer, the MLP's projections, the embedding lookup: all on sum(lengths) tokens.
    linears = sum(1 for name, _ in unpadded if name == "Linear")
    assert linears == encoder.cfg.num_hidden_layers * (5 if family == "nomic_bert" else 4)
    assert {name for name, _ in unpadded} == {"Linear", "LayerNorm", "Embedding"}
    assert {n for _, n in unpadded} == {sum(LENGTHS)} == {39}
    assert {n for _, n in seen} == {len(LENGTHS) * max(LENGTHS)} == {96}


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


def nomic_reference(model_dir: Path, texts: list[str], prefix: str = "", max_len: int = 24) -> torch.Tensor:
    """nomic-embed-text's sentence embedding from its published formulas, one unpadded text at a
    time: emb_ln(word + token type 0); per layer h = norm1(h + out_proj(softmax(q k^T / sqrt(d)) v))
    with q, k turned by rotary angles pos * base^(-2i/r) on pairs (i, i + r/2), or (2i, 2i + 1)
    interleaved; h = norm2(h + fc2(fc11(h) * act(fc12(h)))); then mean over tokens, unit length.
    Texts are cut at `max_len` tokens (the folder's max_seq_length)."""
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((model_dir / "config.json").read_text())
    w = load_file(str(model_dir / "model.safetensors"))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    act = {"swiglu": torch.nn.functional.silu, "geglu": torch.nn.functional.gelu}[cfg["activation_function"]]
    h, heads = cfg["n_embd"], cfg["n_head"]
    d = h // heads
    r = int(d * cfg["rotary_emb_fraction"])
    first, second = ((torch.arange(0, r, 2), torch.arange(1, r, 2)) if cfg["rotary_emb_interleaved"]
                     else (torch.arange(r // 2), torch.arange(r // 2, r)))
    inv = cfg["rotary_emb_base"] ** (-torch.arange(0, r, 2).double() / r)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ w[name + ".weight"].double().T + (w[name + ".bias"].double() if name + ".bias" in w else 0)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (h,), w[name + ".weight"].double(), w[name + ".bias"].double(),
                                              cfg["layer_norm_epsilon"])

    def turn(x: torch.Tensor) -> torch.Tensor:  # (tokens, heads, d)
        angle = torch.arange(x.shape[0]).double()[:, None, None] * inv  # (tokens, 1, r/2)
        a, b = x[..., first], x[..., second]
        out = x.clone()
        out[..., first], out[..., second] = a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()
        return out

    rows = []
    for text in texts:
        ids = torch.tensor(tok(prefix + text, truncation=True, max_length=max_len)["input_ids"])
        x = norm(w["embeddings.word_embeddings.weight"].double()[ids]
                 + w["embeddings.token_type_embeddings.weight"].double()[0], "emb_ln")
        for i in range(cfg["n_layer"]):
            p = f"encoder.layers.{i}."
            q, k, v = lin(x, p + "attn.Wqkv").view(len(ids), 3, heads, d).unbind(1)
            scores = torch.einsum("qhd,khd->hqk", turn(q), turn(k)) / d ** 0.5
            a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), h)
            x = norm(x + lin(a, p + "attn.out_proj"), p + "norm1")
            x = norm(x + lin(lin(x, p + "mlp.fc11") * act(lin(x, p + "mlp.fc12")), p + "mlp.fc2"), p + "norm2")
        rows.append(torch.nn.functional.normalize(x.mean(0), dim=0))
    return torch.stack(rows).float()


NOMIC_VARIANTS = {
    "nomic-embed-text": {},
    # Partial rotary, interleaved pairs, every bias and a GeGLU gate: the other paths the config allows.
    "partial-interleaved-biases": dict(rotary_emb_fraction=0.5, rotary_emb_interleaved=True, qkv_proj_bias=True,
                                       mlp_fc1_bias=True, mlp_fc2_bias=True, activation_function="geglu",
                                       rotary_emb_base=10000),
}


@pytest.mark.parametrize("variant", NOMIC_VARIANTS)
def test_nomic_bert_equals_the_published_formulas(tmp_path, one_thread, variant):
    path = nomic_st_model(tmp_path / "nomic", prompts=PROMPTS, **NOMIC_VARIANTS[variant])
    r = EmbeddingRunner(path, parse_plan(PLAN), golden_texts=TEXTS)
    assert r.max_tokens == 24 and r.normalized
    torch.testing.assert_close(r.embed(TEXTS), nomic_reference(path, TEXTS), atol=2e-5, rtol=1e-4)
    # Task prefixes: the prompt's text goes before each text, as sentence-transformers applies it.
    for name, prefix in PROMPTS.items():
        torch.testing.assert_close(r.embed(SHORT + LONG, prompt_name=name),
                                   nomic_reference(path, SHORT + LONG, prefix), atol=2e-5, rtol=1e-4)
    assert not torch.allclose(r.embed(SHORT, "query"), r.embed(SHORT, "document"))


def test_nomic_bert_padding_archive_and_refusals(tmp_path, one_thread):
    from servekit.model_source import EMBEDDING, embedding_source, infer_kind

    path = nomic_st_model(tmp_path / "nomic")
    assert infer_kind(path) == EMBEDDING and embedding_source(path).max_tokens == 24
    cfg = check_checkpoint(path)
    assert (cfg.family, cfg.intermediate_size, cfg.vocab_size) == ("nomic_bert", 256, 40)  # rounded as published
    encoder = load_encoder(path)
    ids = [[2, 7, 8, 9, 10, 11, 3], [2, 12, 3]]
    padded = torch.tensor([ids[0], ids[1] + [0] * 4])
    with torch.no_grad():
        batched = encoder(padded, (padded != 0).long())
        torch.testing.assert_close(batched[1, :3], encoder(torch.tensor([ids[1]]), torch.ones(1, 3, dtype=torch.long))[0],
                                   atol=1e-5, rtol=1e-5)
    raw = json.loads((path / "config.json").read_text())
    for change, message in [({"prenorm": True}, "prenorm=True .pre-norm blocks. is not supported"),
                            ({"rotary_emb_fraction": 0.0}, "rotary_emb_fraction 0.0 is not supported"),
                            ({"activation_function": "gelu"}, "activation_function 'gelu' is not supported")]:
        (path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(UnsupportedModel, match=message):
            check_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**raw, "n_inner": 300}))
    with pytest.raises(UnsupportedModel, match=r"mlp_value.weight has shape \(256, 32\), the config implies \(512, 32\)"):
        load_encoder(path)
    # Dynamic NTK scaling (past max_trained_positions) is not built: such a model is served up to there.
    (path / "config.json").write_text(json.dumps({**raw, "rotary_scaling_factor": 2.0, "max_trained_positions": 16}))
    assert check_checkpoint(path).max_tokens == 16


def test_compiled_modernbert_serves_every_bucket_without_recompiling(model_dir, one_thread):
    """Rotary angles, the sliding-window bias and the pooling head compile with the encoder. Batches
    2 and 4 share one dynamic-shape graph (a batch-1 bucket would get a second, ~20 s of compiling on
    2 cores: test_embedding_runner.py covers that one)."""
    r = EmbeddingRunner(model_dir, parse_plan({**PLAN, "compile": "default",
                                               "buckets": {"batch_sizes": [2, 4], "seq_lens": [8, 24]}}),
                        golden_texts=TEXTS)
    for texts in (SHORT[:1], SHORT, LONG, TEXTS):
        torch.testing.assert_close(r.embed(texts), reference(model_dir, texts), atol=2e-5, rtol=1e-4)
    assert r.recompiles() == 0

