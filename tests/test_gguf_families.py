"""GGUF files of other Llama-family models than SmolLM2: a Llama 3.1-style one (llama.cpp's q/k row
permutation, Llama 3.1 RoPE scaling as rope_freqs, an end-of-turn id) and a Qwen2 one (biases,
no permutation), written here with the gguf package the way llama.cpp's converter lays them out,
from checkpoints transformers made. Converted by ``convert_gguf_to_safetensors``, they must compute
what the original checkpoints compute."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from decoder_checkpoints import BOS, CHAT_TEMPLATE, EOS, EOT, byte_tokenizer, write_checkpoint
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.models.gguf_weights import convert_gguf_to_safetensors, llama3_scaling_from_divisors
from servekit.optimizations.models.llama import load_config, load_llama
from servekit.optimizations.llm.plan import stop_token_ids

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# Hugging Face module -> llama.cpp tensor, as llama.cpp's converter names them.
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute``: each head's rows from halves to pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs`` for Llama 3.1 scaling (its loop, verbatim in numpy)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(rope["factor"])
        else:
            smooth = ((rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(checkpoint: Path, path: Path, arch: str) -> Path:
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    tok = byte_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(config["vocab_size"] - len(vocab))]
    special = {BOS, EOS, EOT, "<|user|>", "<|assistant|>"}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 4 if t.startswith("[PAD") else 1 for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))  # no merges: transformers derives them (none) from scores
    writer.add_bos_token_id(tok.token_to_id(BOS))
    writer.add_eos_token_id(tok.token_to_id(EOS))
    writer.add_eot_token_id(tok.token_to_id(EOT))
    writer.add_chat_template(CHAT_TEMPLATE)
    if config["rope_parameters"]["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config["rope_parameters"], head_dim))
    for name, t in load_file(str(checkpoint / "model.safetensors")).items():
        w = t.float().numpy()
        if name in TOP:
            writer.add_tensor(TOP[name], w)
            continue
        prefix, kind = name.rsplit(".", 1)  # model.layers.<i>.<module>.<weight|bias>
        _, _, i, module = prefix.split(".", 3)
        if arch == "llama" and module == "self_attn.q_proj":
            w = llama_cpp_permute(w, n_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            w = llama_cpp_permute(w, n_kv)
        writer.add_tensor(f"blk.{i}.{LAYER[module]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family, arch", [("llama3", "llama"), ("qwen2", "qwen2")])
def test_converted_gguf_computes_what_the_checkpoint_computes(family: str, arch: str, tmp_path: Path) -> None:
    # Two heads of 24 dims: two of the 12 RoPE frequencies fall in llama3's smoothed band, which
    # is what recovering the scaling from rope_freqs needs (real Llama 3 heads have 64 or 128 dims).
    checkpoint = write_checkpoint(family, tmp_path / "hf", seed=3, num_attention_heads=2, num_key_value_heads=1)
    path = write_gguf(checkpoint, tmp_path / f"{family}.gguf", arch)
    out = convert_gguf_to_safetensors(path, tmp_path / "converted", torch.float32)
    original, converted = load_config(checkpoint), load_config(out)
    assert converted.rope_scaling == original.rope_scaling and converted.qkv_bias == original.qkv_bias
    assert converted.model_type == original.model_type and converted.tie_embeddings
    ours = load_llama(out)
    ours.setup_caches(2, 48)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    tokens = torch.randint(0, original.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, torch.arange(40).expand(2, 40)), reference(tokens).logits,
                                   atol=2e-5, rtol=1e-4)
        # The converted folder is a Hugging Face checkpoint in its own right.
        again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        torch.testing.assert_close(again(tokens).logits, reference(tokens).logits, atol=2e-5, rtol=1e-4)
    tok = ChatTokenizer(out)
    assert tok.render([{"role": "user", "content": "hi"}]) == f"{BOS}<|user|>hi{EOT}<|assistant|>"
    assert {tok.token_id(EOS), tok.token_id(EOT)} <= set(stop_token_ids(out, tok))


def test_rope_freqs_that_are_not_llama3_scaling_are_refused() -> None:
    rope = {"rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    divisors = llama_cpp_rope_freqs(rope, 128).astype(np.float64)
    fitted = llama3_scaling_from_divisors(divisors, 128, 5e5)
    assert (fitted.factor, fitted.low_freq_factor, fitted.original_max_position_embeddings) == (8.0, 1.0, 8192)
    assert fitted.high_freq_factor == pytest.approx(4.0)
    divisors[-1] = 3.0
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling_from_divisors(divisors, 128, 5e5)
