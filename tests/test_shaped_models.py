"""benchmarks/shaped_models.py's decoder shapes, as small copies (same code, fewer and narrower
layers): the folder loads in servekit's runtime as the family and shape it claims, and its padded
tokenizer decodes every id of the vocabulary and is one llguidance reads itself (grammar masks at
native speed, as a real tokenizer gets them)."""
from __future__ import annotations

from pathlib import Path

import pytest

from servekit.benchmarks import shaped_models
from servekit.benchmarks.llm_workload_bench import weight_bytes_per_token
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.llm.grammar import llg_tokenizer


@pytest.mark.parametrize("name, model_type, tied", [("llama-3.1-8b", "llama", False), ("gemma3-270m", "gemma3_text", True),
                                                    ("qwen2.5-0.5b", "qwen2", True)])
def test_decoder_shapes_load(name: str, model_type: str, tied: bool, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from servekit.optimizations.models.llama import load_llama

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1 if name == "gemma3-270m" else 2)
    if name == "gemma3-270m":
        small["head_dim"] = 16
    shaped_models.decoder(tmp_path, name, **small)
    model = load_llama(tmp_path)
    cfg = model.config
    vocab = shaped_models.DECODERS[name][2]["vocab_size"]
    assert (cfg.model_type, cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.tie_embeddings) == (model_type, vocab, 64, 2, tied)
    if name == "llama-3.1-8b":
        assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_base == 500000.0
    if name == "gemma3-270m":
        assert cfg.sliding_window == 512 and cfg.qk_norm
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab and tok.decode([vocab - 1]) == f"<|extra_{vocab - 1}|>"
    assert len(tok.get_added_tokens_decoder()) < 100  # SmolLM2's own, not one per padded id
    chat = ChatTokenizer(tmp_path)
    table, why = llg_tokenizer(chat, vocab, (chat.eos_token_id,))
    assert why is None, why  # llguidance's own reading, checked against servekit's byte table
    assert table.decode_bytes([vocab - 1]) == f"<|extra_{vocab - 1}|>".encode()
    assert table.tokenize_str('{"a": 1}') == chat.tokenizer.encode('{"a": 1}', add_special_tokens=False).ids
    # One decode step reads every weight but the input embedding table, unless it is the output matrix too.
    params = sum(p.numel() for p in model.parameters())
    embed = vocab * 64
    assert weight_bytes_per_token(tmp_path, "bf16") == 2 * (params if tied else params - embed)
