"""`servekit archive PATH` on users' models built here: the kind read from config.json, a model-config
fitted to the model written beside the archive, the archive serving what sentence-transformers
computes; and a one-line exit-2 error, with nothing written, for what cannot be served."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from tiny_encoders import TEXTS, reference, st_model

ROOT = Path(__file__).resolve().parent.parent


def archive(*args: str | Path) -> subprocess.CompletedProcess:
    """`servekit archive ARGS` as its own process (what the user sees on stderr, import-time output included)."""
    return subprocess.run([sys.executable, "-m", "servekit.archive", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def archive_here(capsys: pytest.CaptureFixture, *args: str | Path) -> subprocess.CompletedProcess:
    """`servekit archive ARGS` through its main() in this process: the same code without the seconds a
    fresh interpreter spends importing torch, for the checks of what the command decides."""
    from servekit.archive import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["servekit archive", *map(str, args)], rc, out, err)


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory) -> Path:
    return st_model(tmp_path_factory.mktemp("models") / "My Encoder", "xlm-roberta", ("cls", "mean"), dense=16,
                    prompts={"query": "query: "})


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint folder written by transformers (config, safetensors, tokenizer,
    generation config): archiving the bundled SmolLM2's 270 MB folder checks nothing more."""
    from decoder_checkpoints import write_checkpoint

    return write_checkpoint("llama3", tmp_path_factory.mktemp("models") / "hf", num_attention_heads=2,
                            num_key_value_heads=1)


def test_archive_of_a_sentence_transformers_folder(st_dir, tmp_path, one_thread):
    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import parse_plan

    out = tmp_path / "store"
    r = archive(st_dir, "--out", out, "--device", "cpu", "--no-compress")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["My-Encoder.mar", "My-Encoder.yaml"]  # name sanitised
    cfg = yaml.safe_load((out / "My-Encoder.yaml").read_text())
    assert cfg["servekit"]["device"] == "cpu" and cfg["servekit"]["buckets"]["seq_lens"] == [16, 24]  # to 24 tokens
    with zipfile.ZipFile(out / "My-Encoder.mar") as z:
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
        assert manifest["model"]["handler"] == "embedding_handler.py"  # kind inferred: embedding
        names = set(z.namelist())
        assert {"config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json",
                "2_Dense/config.json", "2_Dense/model.safetensors", "config_sentence_transformers.json"} <= names
        z.extractall(tmp_path / "unpacked")
    # The unpacked archive, as a worker loads it with the generated plan, equals sentence-transformers.
    runner = EmbeddingRunner(tmp_path / "unpacked", parse_plan(cfg["servekit"]), golden_texts=TEXTS)
    torch.testing.assert_close(runner.embed(TEXTS), reference(st_dir, TEXTS), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(runner.embed(TEXTS, "query"), reference(st_dir, TEXTS, prompt_name="query"),
                               atol=2e-5, rtol=1e-4)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("breakage, message", [
    ("architecture", "config.json: model_type 't5' (architectures: T5EncoderModel) is not supported"),
    ("pooling", "1_Pooling/config.json: pooling mode 'median' is not supported"),
    ("weights", "model.safetensors: no weights (neither model.safetensors nor model.safetensors.index.json)"),
    ("shard", "model-00002-of-00002.safetensors: shard listed in model.safetensors.index.json is missing"),
    ("tensors", "checkpoint lacks 2 tensors of a roberta encoder"),
    ("attention", "checkpoint lacks 1 tensors of a roberta encoder (first: layers.1.key.weight)"),
    ("speculator", "--speculator applies to causal LMs"),
    ("no-heads", "speculator heads not found"),
])
def test_unservable_models_fail_in_one_line_leaving_nothing(st_dir, llm_dir, tmp_path, capsys, breakage, message):
    d = _copy(st_dir, tmp_path / "model")
    if breakage == "architecture":
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "model_type": "t5", "architectures": ["T5EncoderModel"]}))
    elif breakage == "pooling":
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": "median"}))
    elif breakage == "weights":
        (d / "model.safetensors").unlink()
        (d / "pytorch_model.bin").write_bytes(b"not loaded")
    elif breakage == "shard":
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "embeddings.word_embeddings.weight": "model-00001-of-00002.safetensors",
            "encoder.layer.1.output.dense.weight": "model-00002-of-00002.safetensors"}}))
    elif breakage == "tensors":
        from safetensors.torch import load_file, save_file

        state = load_file(str(d / "model.safetensors"))
        save_file({k: v for k, v in state.items() if not k.startswith("encoder.layer.1.output.dense.")},
                  str(d / "model.safetensors"))
    elif breakage == "attention":  # one of the three tensors the stacked projection is built from
        from safetensors.torch import load_file, save_file

        state = load_file(str(d / "model.safetensors"))
        save_file({k: v for k, v in state.items() if k != "encoder.layer.1.attention.self.key.weight"},
                  str(d / "model.safetensors"))
    out = tmp_path / "store"
    extra: list = []
    if breakage == "speculator":  # heads for an encoder
        (tmp_path / "heads").mkdir()
        extra = ["--speculator", tmp_path / "heads"]
    if breakage == "no-heads":  # an LLM folder, and heads that are not there
        d, extra = llm_dir, ["--speculator", tmp_path / "no-such-heads"]
    # One case as the user's own command (nothing else on its stderr), the others through main().
    run = archive if breakage == "architecture" else functools.partial(archive_here, capsys)
    r = run(d, "--out", out, "--device", "cpu", "--no-compress", *extra)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servekit archive: error: ") and message in lines[0], r.stderr
    assert not out.exists() or not list(out.iterdir())  # no .mar, no yaml


def test_sharded_checkpoint_and_kind_override(st_dir, tmp_path, capsys, one_thread):
    """A checkpoint split into shards with an index archives and loads as the single file does."""
    from safetensors.torch import load_file, save_file

    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import parse_plan

    d = _copy(st_dir, tmp_path / "sharded")
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, str(d / name))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}))
    out = tmp_path / "store"
    r = archive_here(capsys, d, "--out", out, "--device", "cpu", "--kind", "embedding", "--name", "sharded",
                     "--no-compress")
    assert r.returncode == 0, r.stderr
    with zipfile.ZipFile(out / "sharded.mar") as z:
        assert set(shards) | {"model.safetensors.index.json"} <= set(z.namelist())
        z.extractall(tmp_path / "unpacked")
    runner = EmbeddingRunner(tmp_path / "unpacked", parse_plan({"device": "cpu", "buckets": {"seq_lens": [24]}}),
                             golden_texts=TEXTS)
    torch.testing.assert_close(runner.embed(TEXTS), reference(st_dir, TEXTS), atol=2e-5, rtol=1e-4)
    r = archive_here(capsys, d, "--out", tmp_path / "llm", "--kind", "llm", "--device", "cpu")
    assert r.returncode == 2 and "is not a causal LM" in r.stderr and not (tmp_path / "llm").exists()


def test_llm_folder_and_gguf_file_archive_as_llm(llm_dir, tmp_path, capsys):
    """A Llama-family folder and a GGUF file, both a tiny random Llama (the bundled SmolLM2's folder
    is 270 MB to copy and its GGUF takes 24 s to convert to an fp32 archive; the real conversion is
    checked by the weight tests): kind llm inferred, the model's files shipped, a model-config fitted
    to its context length generated."""
    from test_gguf_families import write_gguf

    from servekit.optimizations.models.gguf_weights import find_smollm2_gguf

    tiny = write_gguf(llm_dir, tmp_path / "tiny-llama.gguf", "llama")
    for src, name in ((llm_dir, "from-folder"), (tiny, "from-gguf")):
        out = tmp_path / name
        r = archive_here(capsys, src, "--out", out, "--device", "cpu", "--name", name, "--no-compress")
        assert r.returncode == 0, r.stderr
        with zipfile.ZipFile(out / f"{name}.mar") as z:
            assert json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]["handler"] == "llm_handler.py"
            assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "generation_config.json"} <= set(z.namelist())
        plan = yaml.safe_load((out / f"{name}.yaml").read_text())["servekit"]
        assert plan["device"] == "cpu" and plan["max_seq_len"] == 256  # the checkpoint's context
        assert "model-config written" in r.stdout and "max_seq_len" not in r.stdout  # nothing cut: no notes
    r = archive_here(capsys, find_smollm2_gguf(), "--out", tmp_path / "enc", "--kind", "embedding")
    assert r.returncode == 2 and "a GGUF file is a causal LM" in r.stderr and not (tmp_path / "enc").exists()


SMOLLM2_KV = 2 * 30 * 3 * 64  # keys and values per token: layers x KV heads x head_dim, each
LLAMA_8B_KV = 2 * 32 * 8 * 128
LLAMA_70B_KV = 2 * 80 * 8 * 128


@pytest.mark.parametrize("device,model_max,kv_values,context", [
    ("cuda", 8192, SMOLLM2_KV, 8192),     # the GPU template's 8,192: 32 rows take 5.6 GiB in bf16
    ("cuda", 131072, LLAMA_8B_KV, 4096),  # 32 rows of 8,192 would take 32 GiB: halved to 16 GiB
    ("cuda", 131072, LLAMA_70B_KV, 2048),  # 20 GiB at 2,048: not cut below it
    ("cuda", 1500, SMOLLM2_KV, 1500),     # the model's context, shorter
    ("cpu", 131072, LLAMA_8B_KV, 1024),   # the CPU template's own 1,024 tokens
])
def test_a_generated_llm_config_fits_its_kv_cache(device, model_max, kv_values, context):
    """A generated LLM config serves its template's context or the model's, halved while its rows'
    KV cache would exceed GENERATED_KV_CACHE_BYTES; buckets and limits fitted to it, its header says
    how to serve more and what the cache would take; the plan parses."""
    from servekit.model_source import GENERATED_KV_CACHE_BYTES, ModelSource, generated_config
    from servekit.optimizations.llm.plan import parse_llm_plan
    from servekit.resources import model_config

    assert yaml.safe_load(model_config("smollm2").read_text())["servekit"]["max_seq_len"] == 8192
    text, cfg = generated_config(ModelSource("llm", [], model_max, "llama", kv_values), device, "model")
    plan = cfg["servekit"]
    assert plan["max_seq_len"] == context
    assert plan["buckets"]["kv_lens"][-1] == plan["buckets"]["prompt_lens"][-1] == context
    assert plan["limits"]["max_tokens"] < context
    assert (f"max_seq_len {context} of the model's {model_max} tokens: raise it here" in text) == (context < model_max)
    kv_bytes = cfg["batchSize"] * context * kv_values * (4 if plan["precision"] == "fp32" else 2)
    assert kv_bytes <= GENERATED_KV_CACHE_BYTES or context == 2048
    assert ("of KV cache;" in text) == (device == "cuda" and context < min(8192, model_max))
    parse_llm_plan(plan, "servekit")


def test_an_llm_source_counts_its_kv_cache_per_token(tmp_path):
    """The keys and values a token adds to the cache, from the checkpoint's own config (its layers,
    KV heads and head size), for every family: what the generated config's context is fitted to."""
    from decoder_checkpoints import write_checkpoint

    from servekit.model_source import llm_source

    for family in ("llama3", "mistral", "qwen3", "gemma3"):
        model = write_checkpoint(family, tmp_path / family)
        raw = json.loads((model / "config.json").read_text())
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
        assert llm_source(model).kv_values == 2 * raw["num_hidden_layers"] * kv_heads * head_dim, family


def test_archive_says_what_the_generated_llm_config_cut(tmp_path, capsys):
    """`servekit archive` of a checkpoint with a longer context than its generated config serves
    prints the config's notes after the path it wrote: how much of the context, and how to serve more."""
    from decoder_checkpoints import write_checkpoint

    model = write_checkpoint("llama3", tmp_path / "long", max_position_embeddings=4096)
    r = archive_here(capsys, model, "--out", tmp_path / "out", "--device", "cpu", "--no-compress")
    assert r.returncode == 0, r.stderr
    notes = r.stdout.split("model-config written: ", 1)[1].splitlines()[1:]
    assert notes[0] == "  max_seq_len 1024 of the model's 4096 tokens: raise it here to serve longer prompts", notes
    assert "batchSize rows of max_seq_len tokens" in notes[1]


def test_a_generated_llm_config_stays_within_a_window_every_layer_uses(tmp_path):
    """A Mistral checkpoint with a 1,024-token window in every layer (no layer_types) and 32,768
    positions: its generated GPU config serves 1,024 tokens, which the plan's load check accepts,
    rather than 2,048, which that check refuses."""
    from decoder_checkpoints import write_checkpoint

    from servekit.model_source import generated_config, llm_source
    from servekit.optimizations.models.llama import load_config

    model = write_checkpoint("mistral", tmp_path / "mistral", max_position_embeddings=32768, sliding_window=1024)
    _, cfg = generated_config(llm_source(model), "cuda", "model")
    assert cfg["servekit"]["max_seq_len"] == 1024
    load_config(model).check_context(1024)
    with pytest.raises(ValueError, match="sliding window of 1024 tokens"):
        load_config(model).check_context(2048)


def test_weights_are_staged_as_links_and_copied_where_links_fail(tmp_path, monkeypatch):
    """The staging folder torch-model-archiver reads holds hard links to the weight files (one
    fewer full copy of a model's weights while its archive is built); where the filesystem refuses
    a link, a copy with the same bytes. The user's file is untouched either way."""
    import errno
    import os

    from servekit import archive as archive_module

    src = tmp_path / "model" / "model.safetensors"
    src.parent.mkdir()
    src.write_bytes(b"weights" * 1000)
    linked = archive_module.stage("m", tmp_path / "linked", [(src, "sub/model.safetensors")])
    staged = linked / "sub" / "model.safetensors"
    assert staged.stat().st_ino == src.stat().st_ino and src.stat().st_nlink == 2

    def refuse(a, b, **kw):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)
    copied = archive_module.stage("m", tmp_path / "copied", [src]) / "model.safetensors"
    assert copied.stat().st_ino != src.stat().st_ino and copied.read_bytes() == src.read_bytes()
    assert src.read_bytes() == b"weights" * 1000
