"""GGUF files of other Llama-family models than SmolLM2: a Llama 3.1-style one (llama.cpp's q/k row
permutation, Llama 3.1 RoPE scaling as rope_freqs, an end-of-turn id), a Qwen2 one (biases,
no permutation), a Qwen3 one (q/k norms), a Gemma 3 one (sandwich norms stored as 1 + weight,
sliding layers in llama.cpp's fixed pattern, linear RoPE scaling, no chat template), a Gemma 2
one (its soft-capping values in the header, alternating sliding layers) and a Phi-3 one (fused
attn_qkv, ffn_up holding gate and up, its window in every layer), written here
with the gguf package the way llama.cpp's converter lays them out, from checkpoints transformers
made. Converted by ``convert_gguf_to_safetensors``, they must compute what the original checkpoints
compute."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from decoder_checkpoints import BOS, CHAT_TEMPLATE, EOS, EOT, byte_tokenizer, write_checkpoint
from servekit.optimizations.llm.chat_template import ChatTokenizer
from servekit.optimizations.models.gguf_weights import (check_gguf_architecture, convert_gguf_to_safetensors,
                                                       gguf_architecture, llama3_scaling_from_divisors,
                                                       load_llama_from_gguf, read_gguf)
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
QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GEMMA = {**LAYER, **QK_NORMS, "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# Phi-3: the checkpoint's fused modules keep their fusion in llama.cpp's names.
PHI3 = {**{k: v for k, v in LAYER.items() if not k.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))},
        "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
ARCH_LAYERS = {"llama": LAYER, "qwen2": LAYER, "qwen3": {**LAYER, **QK_NORMS}, "gemma3": GEMMA,
               "gemma2": {k: v for k, v in GEMMA.items() if k not in QK_NORMS}, "phi3": PHI3}


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
    rope = config["rope_parameters"].get("full_attention", config["rope_parameters"])  # Gemma 3: per layer type
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    if arch == "phi3":  # llama.cpp's Phi-3 converter: rotated dimensions and window, no key length
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_scaling_orig_ctx_len(config["max_position_embeddings"])
        writer.add_sliding_window(config["sliding_window"] or 0)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch.startswith("gemma"):  # llama.cpp's converter writes the window; the pattern is its own rule
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
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
    if not arch.startswith("gemma"):  # like gemma-3-270m's own GGUF: a base model without a template
        writer.add_chat_template(CHAT_TEMPLATE)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, head_dim))
    for name, t in load_file(str(checkpoint / "model.safetensors")).items():
        w = t.float().numpy()
        if name in TOP:
            writer.add_tensor(TOP[name], w + 1 if arch.startswith("gemma") and name.endswith("norm.weight") else w)
            continue
        prefix, kind = name.rsplit(".", 1)  # model.layers.<i>.<module>.<weight|bias>
        _, _, i, module = prefix.split(".", 3)
        if arch == "llama" and module == "self_attn.q_proj":
            w = llama_cpp_permute(w, n_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            w = llama_cpp_permute(w, n_kv)
        elif arch.startswith("gemma") and module.endswith("norm"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as 1 + weight
        writer.add_tensor(f"blk.{i}.{ARCH_LAYERS[arch][module]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Gemma 3 as llama.cpp knows it: five sliding layers per global one, local RoPE base 10000, scores
# scaled by 1/sqrt(head_dim) (none of which its GGUF records).
GEMMA3_LLAMA_CPP = dict(num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=16, rope_parameters={
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})


@pytest.mark.parametrize("family, arch", [("llama3", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                          ("gemma3", "gemma3"), ("gemma2", "gemma2"), ("phi3", "phi3")])
def test_converted_gguf_computes_what_the_checkpoint_computes(family: str, arch: str, tmp_path: Path) -> None:
    # Two heads of 24 dims: two of the 12 RoPE frequencies fall in llama3's smoothed band, which
    # is what recovering the scaling from rope_freqs needs (real Llama 3 heads have 64 or 128 dims).
    heads = {"gemma3": GEMMA3_LLAMA_CPP, "gemma2": {}}.get(family, dict(num_attention_heads=2, num_key_value_heads=1))
    checkpoint = write_checkpoint(family, tmp_path / "hf", seed=3, **heads)
    path = write_gguf(checkpoint, tmp_path / f"{family}.gguf", arch)
    assert gguf_architecture(path) == arch
    out = convert_gguf_to_safetensors(path, tmp_path / "converted", torch.float32)
    original, converted = load_config(checkpoint), load_config(out)
    assert converted.rope_scaling == original.rope_scaling and converted.qkv_bias == original.qkv_bias
    assert (converted.qk_norm, converted.layer_types, converted.rope_local_base, converted.attn_scalar) == (
        original.qk_norm, original.layer_types, original.rope_local_base, original.attn_scalar)
    assert (converted.attn_softcap, converted.logit_softcap) == (original.attn_softcap, original.logit_softcap)
    assert converted.model_type == original.model_type and converted.tie_embeddings == original.tie_embeddings
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
    turn = ("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n" if arch.startswith("gemma")  # Gemma's format
            else "<|user|>hi<|eot|><|assistant|>")
    assert tok.render([{"role": "user", "content": "hi"}]) == BOS + turn
    assert {tok.token_id(EOS), tok.token_id(EOT)} <= set(stop_token_ids(out, tok))


def _greedy(logits_of, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation, the whole sequence run again at every step (no cache to get wrong)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(logits_of(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_phi3_gguf_greedy_equals_transformers_phi3(tmp_path: Path) -> None:
    """A Phi-3 GGUF, dequantized at load and converted alike, decodes greedily what transformers'
    Phi3ForCausalLM decodes from the original checkpoint (its window of 7 shorter than the text)."""
    checkpoint = write_checkpoint("phi3", tmp_path / "hf", seed=5)
    path = write_gguf(checkpoint, tmp_path / "phi3.gguf", "phi3")
    config, tensors = read_gguf(path)
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors and "model.layers.0.mlp.gate_up_proj.weight" in tensors
    assert config.sliding_window == 7 and set(config.layer_types) == {"sliding_attention"}
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert type(reference).__name__ == "Phi3ForCausalLM"
    prompt = ChatTokenizer(checkpoint).encode_chat([{"role": "user", "content": "Tell me about the sea."}])
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    for ours in (load_llama_from_gguf(path), load_llama(convert_gguf_to_safetensors(path, tmp_path / "out",
                                                                                     torch.float32))):
        ours.setup_caches(1, 64)
        got = _greedy(lambda ids: ours(ids, torch.arange(ids.shape[1])[None]), prompt, 12)
        assert got == want


@pytest.mark.parametrize("extra, message", [({"rope.scaling.attn_factor": 1.19}, "LongRoPE"),
                                            ({"rope.dimension_count": 6}, "RoPE over 6 of each head's 12")])
def test_phi3_ggufs_this_runtime_cannot_compute_are_refused(extra: dict, message: str, tmp_path: Path) -> None:
    """The 128k models (LongRoPE) and partial rotary embeddings, refused from the header by name."""
    writer = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    writer.add_block_count(1)
    writer.add_embedding_length(48)
    writer.add_head_count(4)
    writer.add_feed_forward_length(96)
    for key, value in extra.items():
        if isinstance(value, float):
            writer.add_float32(f"phi3.{key}", value)
        else:
            writer.add_uint32(f"phi3.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 48), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
        read_gguf(tmp_path / "phi3.gguf")


def test_gguf_precision_is_the_one_asked_for(tmp_path: Path) -> None:
    """fp32 conversions keep gguf's dequantized values; bf16 ones round them once."""
    checkpoint = write_checkpoint("qwen3", tmp_path / "hf", seed=4)
    path = write_gguf(checkpoint, tmp_path / "qwen3.gguf", "qwen3")
    _, fp32 = read_gguf(path, torch.float32)
    _, bf16 = read_gguf(path, torch.bfloat16)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert fp32[name].dtype == torch.float32 and bf16[name].dtype == torch.bfloat16
    assert not torch.equal(fp32[name], fp32[name].bfloat16().float())  # fp32 values bf16 cannot hold
    torch.testing.assert_close(bf16[name], fp32[name].bfloat16(), atol=0, rtol=0)


def test_unsupported_gguf_architecture_is_refused_from_the_header(tmp_path: Path) -> None:
    """The refusal reads the header only: a file whose tensor data is cut off is still refused by name."""
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.add_block_count(1)
    writer.add_token_list([f"t{i}" for i in range(5000)])  # a vocabulary before the tensors, as in real files
    writer.add_tensor("token_embd.weight", np.zeros((5000, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "phi.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="GGUF architecture 'phi2' is not supported; supported: llama, qwen2, qwen3, phi3"):
        check_gguf_architecture(tmp_path / "cut.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_architecture(tmp_path / "not.gguf")


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
