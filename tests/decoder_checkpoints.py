"""Tiny Llama-family checkpoints written by transformers itself (config classes + save_pretrained),
with a byte-level tokenizer and a chat template of their own: what "bring your own model" gets
from a user, in miniature. Shared by the decoder-family tests."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VOCAB = 272  # the tokenizer's 261 ids, padded up as real checkpoints often are
BOS, EOS, EOT = "<s>", "</s>", "<|eot|>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# name -> (transformers config class, its kwargs); every variant the runtime must tell apart.
FAMILIES: dict[str, tuple[str, dict]] = {
    # Llama 3.1/3.2: llama3 RoPE scaling (original context 64 so the tiny head's middle
    # frequencies fall in the smoothed band), tied embeddings, eos given as a list.
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Llama 2 style: untied, linear RoPE scaling, biases everywhere (attention_bias, mlp_bias).
    "llama-linear-bias": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                               "factor": 2.0})),
    # Qwen2.5: q/k/v biases, tied, a large theta.
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000000.0})),
    # Mistral: untied, a head_dim that is not hidden/heads, a window longer than any test context.
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, head_dim=24, sliding_window=4096,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Qwen3: RMSNorm of each q/k head, no q/k/v bias, an explicit head_dim, untied.
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Gemma 3: sandwich norms (1 + weight), q/k norms, GeGLU, scaled embeddings, a window of 6 tokens
    # in its sliding layers (shorter than every test prompt) with their own RoPE base, linear scaling
    # on the global ones, a query_pre_attn_scalar that is not head_dim.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        num_hidden_layers=3, rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                            "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1000000.0}})),
    # Phi-3: fused qkv_proj and gate_up_proj, its window (7 tokens, shorter than the test prompts) in every layer.
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, sliding_window=7,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Gemma 2: attention and final logit soft-capping (caps low enough to bite on random weights),
    # alternating sliding (window 5) and global layers, no q/k norms.
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                                    attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (every byte is a token) plus special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, EOT, "<|user|>", "<|assistant|>"])
    return tok


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits are far from uniform (so greedy choices are not near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def write_checkpoint(family: str, out: Path, seed: int = 0, eos_config: int | list[int] | None = None,
                     eos_generation: list[int] | None = None, shard: bool = False, **overrides: object) -> Path:
    """A tiny random checkpoint of ``family`` in ``out``: config.json, safetensors (sharded with an
    index when ``shard``), generation_config.json, tokenizer.json, tokenizer_config.json.
    ``overrides``: config keyword arguments that replace the tiny defaults."""
    import transformers

    cls_name, extra = FAMILIES[family]
    tok = byte_tokenizer()
    eos_id, eot_id = tok.token_to_id(EOS), tok.token_to_id(EOT)
    kwargs = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.token_to_id(BOS),
                  eos_token_id=[eos_id, eot_id] if eos_config is None else eos_config, pad_token_id=eos_id)
    config = getattr(transformers, cls_name)(**{**kwargs, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, pad_token_id=eos_id,
        eos_token_id=eos_generation if eos_generation is not None else [eos_id, eot_id])
    model.save_pretrained(out, safe_serialization=True, **({"max_shard_size": "60KB"} if shard else {}))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE}))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return out
