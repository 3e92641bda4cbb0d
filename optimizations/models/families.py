"""The decoder families servekit serves, in one place: how each one's ``config.json`` and GGUF header
map onto ``LlamaConfig``, how its tensor names map onto ours, which block it runs and what the rest
of the stack supports for it.

Every family runs ``llama.Transformer``; what tells them apart are a few numbers and switches of
``LlamaConfig`` (q/k norms, Gemma's sandwich norms and ``1 + weight`` convention, sliding-window
layers, soft-capping, ...). Adding a family is one ``DecoderFamily`` entry here, plus a switch in
``llama.py`` only when its layers compute something no existing switch covers (see
docs/add-a-family.md). This module imports nothing from the model code, so the model code can import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# Block variants of llama.Transformer (TransformerBlock.forward):
PRE_NORM = "pre-norm"  # x + attn(norm(x)); h + mlp(norm(h))                     (Llama, Qwen, Mistral)
SANDWICH = "sandwich"  # x + norm(attn(norm(x))); h + norm(mlp(norm(h)))         (Gemma 2 / 3)

# Hugging Face layer module -> ours, per block variant. Gemma's post_attention_layernorm is the norm
# after attention; Llama's (same name) is the one before the MLP.
_PRE_NORM_LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_SANDWICH_LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}
_PROJECTIONS = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
_QK_NORMS = {"self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm"}

# llama.cpp tensor -> Hugging Face layer module (llama.cpp's converter names them so).
_GGUF_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_PRE_NORM = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_GGUF_SANDWICH = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config.json name -> ours

GgufKey = Callable[..., Any]  # key(name, default) reads "<arch>.<name>" from a GGUF header


@dataclass(frozen=True)
class DecoderFamily:
    """One decoder family. ``hf_fields`` / ``gguf_fields`` give the ``LlamaConfig`` fields the
    family sets beyond the shared ones (sizes, eps, ids), from ``config.json`` or a GGUF header;
    ``hf_extra`` the ``config.json`` keys it writes back (so a converted checkpoint stays loadable
    by transformers)."""

    model_type: str
    architecture: str  # config.json "architectures" entry written back
    block: str = PRE_NORM
    hf_fields: Callable[[dict], dict] = lambda hf: {}
    hf_extra: Callable[[Any], dict] = lambda config: {}
    gguf_arch: str | None = None  # llama.cpp's general.architecture (None: no GGUF of its own)
    gguf_fields: Callable[[GgufKey, int], dict] = lambda key, n_layers: {}
    gguf_rope_permuted: bool = False  # llama.cpp stores q/k rows interleaved (its "normal" RoPE)
    gguf_norm_shift: float = 0.0  # llama.cpp stores Gemma's norms as 1 + weight: subtract this on read
    qk_norm: bool = False
    # Hugging Face modules that hold several of ours side by side (Phi-3's qkv_proj, gate_up_proj):
    # split along the output dimension into the listed modules when loaded.
    fused_weights: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # llama.cpp layer tensors named otherwise than in the shared table (Phi-3's attn_qkv, and its
    # ffn_up holding gate and up): llama.cpp tensor -> Hugging Face module.
    gguf_tensor_names: Mapping[str, str] = field(default_factory=dict)
    # What the stack supports beyond the eager torch path (plan keys that would compute otherwise).
    triton_decode: bool = True  # optimizations/kernels/triton_decode.py fuses this block
    turn_end_tokens: tuple[str, ...] = ()  # chat-template tokens that end a turn (stop ids)
    default_chat_template: str | None = None  # for GGUFs of base models that carry none

    @property
    def layer_names(self) -> dict[str, str]:
        """Hugging Face layer module -> ours."""
        names = {**(_SANDWICH_LAYER if self.block == SANDWICH else _PRE_NORM_LAYER), **_PROJECTIONS}
        return {**names, **_QK_NORMS} if self.qk_norm else names

    @property
    def gguf_layer_names(self) -> dict[str, str]:
        """llama.cpp layer tensor -> Hugging Face layer module."""
        names = {**(_GGUF_SANDWICH if self.block == SANDWICH else _GGUF_PRE_NORM), **_GGUF_PROJECTIONS,
                 **self.gguf_tensor_names}
        return {**names, **_GGUF_QK_NORMS} if self.qk_norm else names


# --- Llama, Mistral, Qwen2: biases and windows ------------------------------------------------------

def _window(hf: dict, model_type: str) -> int | None:
    """The attention window of models whose every layer would use it (served only where it covers
    the whole context), or None for full attention everywhere."""
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        # Qwen uses its window only when use_sliding_window is set (4.x), or in the layers that
        # layer_types marks as sliding (5.x).
        sliding_layers = "sliding_attention" in (hf.get("layer_types") or [])
        if not (hf.get("use_sliding_window", False) or sliding_layers):
            return None
    return int(window) if window else None


def _llama_fields(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def _llama_extra(c: Any) -> dict:
    return dict(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)


def _mistral_fields(hf: dict) -> dict:
    return {**_llama_fields(hf), "sliding_window": _window(hf, "mistral")}


def _qwen2_fields(hf: dict) -> dict:
    # Qwen2's q/k/v always carry a bias, its o_proj never.
    return dict(qkv_bias=True, o_bias=False, sliding_window=_window(hf, "qwen2"))


def _qwen_extra(c: Any) -> dict:
    return dict(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window)


def _qwen3_fields(hf: dict) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=_window(hf, "qwen3"))


def _qwen3_extra(c: Any) -> dict:
    return {**_qwen_extra(c), "attention_bias": c.qkv_bias}


# --- Phi-3: fused projections, a window over every layer ------------------------------------------

_PHI3_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _phi3_fields(hf: dict) -> dict:
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        raise ValueError("LongRoPE (the 128k-context Phi-3 models) is not implemented: it switches between two sets "
                         "of RoPE factors when a sequence passes original_max_position_embeddings, which the static "
                         "cos/sin tables here cannot; use a 4k-context Phi-3")
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} (RoPE on part of each head) is not implemented")
    window = hf.get("sliding_window")
    # transformers' Phi-3 applies its window in every layer: implemented by each layer's mask.
    return dict(sliding_window=int(window) if window else None,
                layer_types=(SLIDING,) * hf["num_hidden_layers"] if window else ())


def _phi3_extra(c: Any) -> dict:
    return dict(sliding_window=c.sliding_window)


# llama.cpp's converter writes qkv_proj as attn_qkv and gate_up_proj as ffn_up (gate rows first, as
# in the checkpoint); fused_weights splits them like the safetensors' own. Its q/k rows are not
# permuted: llama.cpp rotates Phi-3 in halves (NeoX style), as transformers does.
_PHI3_GGUF_TENSORS = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def _phi3_gguf(key: GgufKey, n_layers: int) -> dict:
    """What llama.cpp's converter records of Phi-3: the window (0 for none, as Phi-4 has), the RoPE
    dimensions, and for the 128k models the LongRoPE attention factor beside rope_factors_* tensors."""
    if key("rope.scaling.attn_factor") is not None:
        raise ValueError("LongRoPE (the 128k-context Phi-3 models: rope_factors_long/short in the GGUF) is not "
                         "implemented; use a 4k-context Phi-3")
    head_dim = int(key("attention.key_length", int(key("embedding_length")) // int(key("attention.head_count"))))
    rotated = int(key("rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise ValueError(f"RoPE over {rotated} of each head's {head_dim} dimensions (partial_rotary_factor) is "
                         "not implemented")
    window = int(key("attention.sliding_window", 0) or 0)
    return dict(sliding_window=window or None, layer_types=(SLIDING,) * n_layers if window else ())


# --- Gemma 2 and 3 ----------------------------------------------------------------------------------

SLIDING, FULL = "sliding_attention", "full_attention"


def _gemma_layer_types(hf: dict, default_pattern: int) -> tuple[str, ...]:
    """Which layers slide: config.json's layer_types (5.x), else every ``sliding_window_pattern``-th
    layer is global (4.x; Gemma 2 alternates, Gemma 3 has five local layers per global one)."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = int(hf.get("sliding_window_pattern") or default_pattern)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"]))


def _gemma_common(hf: dict, default_pattern: int) -> dict:
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an encoder-style Gemma) is not supported by the causal LM runtime")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return dict(activation=act, norm_offset=1.0, embed_scale=True,
                attn_scalar=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256),
                attn_softcap=hf.get("attn_logit_softcapping"), logit_softcap=hf.get("final_logit_softcapping"),
                sliding_window=int(hf["sliding_window"]) if hf.get("sliding_window") else None,
                layer_types=_gemma_layer_types(hf, default_pattern),
                qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)))


def _gemma2_fields(hf: dict) -> dict:
    return _gemma_common(hf, 2)


def _gemma3_fields(hf: dict) -> dict:
    """Gemma 3's global layers use rope_theta (and any scaling), its local ones their own base."""
    fields = {**_gemma_common(hf, 6), "qk_norm": True}
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # 5.x: parameters per layer type
        local = params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"RoPE scaling of Gemma 3's local layers ({local.get('rope_type')!r}) is not supported")
        fields["rope_hf"] = {"rope_parameters": params.get(FULL) or {"rope_type": "default", "rope_theta": 1e6}}
        fields["rope_local_base"] = float(local.get("rope_theta", 10000.0))
    else:  # 4.x
        fields["rope_hf"] = {"rope_theta": hf.get("rope_theta", 1e6), "rope_scaling": hf.get("rope_scaling")}
        fields["rope_local_base"] = float(hf.get("rope_local_base_freq", 10000.0))
    return fields


def _gemma_extra(c: Any) -> dict:
    return dict(hidden_activation={v: k for k, v in ACTIVATIONS.items()}[c.activation],
                # transformers 5 validates it as an int
                query_pre_attn_scalar=int(c.attn_scalar) if float(c.attn_scalar).is_integer() else c.attn_scalar,
                attn_logit_softcapping=c.attn_softcap,
                final_logit_softcapping=c.logit_softcap, sliding_window=c.sliding_window,
                layer_types=list(c.layer_types), attention_bias=c.qkv_bias)


def _gemma3_extra(c: Any) -> dict:
    full = c.rope_scaling.to_hf() if c.rope_scaling else {"rope_type": "default"}
    return {**_gemma_extra(c),
            # 4.x reads rope_theta, rope_local_base_freq and rope_scaling; 5.x per-layer-type parameters.
            "rope_local_base_freq": c.rope_local_base,
            "rope_scaling": c.rope_scaling.to_hf() if c.rope_scaling else None,
            "rope_parameters": {FULL: {**full, "rope_theta": c.rope_base},
                                SLIDING: {"rope_type": "default", "rope_theta": c.rope_local_base}}}


def _gemma_attn_scalar(key: GgufKey, n_layers: int, big: int) -> float:
    """llama.cpp scales Gemma's attention scores by 1/sqrt(head_dim), except for the 27B models
    (``big`` layers), whose query_pre_attn_scalar is hidden / heads; the GGUF does not record it."""
    if n_layers == big:
        return float(int(key("embedding_length")) // int(key("attention.head_count")))
    return float(key("attention.key_length"))


def _gguf_layer_types(key: GgufKey, n_layers: int, pattern: int) -> tuple[str, ...]:
    """llama.cpp's per-layer sliding flags where the GGUF records them, else its fixed pattern."""
    flags = key("attention.sliding_window_pattern")
    if isinstance(flags, list) and len(flags) == n_layers:
        return tuple(SLIDING if f else FULL for f in flags)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n_layers))


def _gemma2_gguf(key: GgufKey, n_layers: int) -> dict:
    return dict(activation="gelu_tanh", norm_offset=1.0, embed_scale=True,
                attn_scalar=_gemma_attn_scalar(key, n_layers, 46),
                attn_softcap=key("attn_logit_softcapping"), logit_softcap=key("final_logit_softcapping"),
                sliding_window=int(key("attention.sliding_window", 4096)),
                layer_types=_gguf_layer_types(key, n_layers, 2))


def _gemma3_gguf(key: GgufKey, n_layers: int) -> dict:
    return dict(activation="gelu_tanh", norm_offset=1.0, embed_scale=True, qk_norm=True,
                attn_scalar=_gemma_attn_scalar(key, n_layers, 62),
                logit_softcap=key("final_logit_softcapping"),
                sliding_window=int(key("attention.sliding_window", 4096)),
                layer_types=_gguf_layer_types(key, n_layers, 6),
                rope_local_base=float(key("rope.freq_base_swa", 10000.0)))


# Gemma's chat format; base-model GGUFs (gemma-3-270m) carry no template, their vocabulary has the turn tokens.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")

_GEMMA = dict(block=SANDWICH, gguf_norm_shift=1.0, triton_decode=False, turn_end_tokens=("<end_of_turn>",),
              default_chat_template=GEMMA_CHAT_TEMPLATE)

DECODER_FAMILIES: Mapping[str, DecoderFamily] = {f.model_type: f for f in (
    # Llama 2/3.x and SmolLM; llama.cpp writes Mistral GGUFs as "llama" too.
    DecoderFamily("llama", "LlamaForCausalLM", hf_fields=_llama_fields, hf_extra=_llama_extra, gguf_arch="llama",
                  gguf_rope_permuted=True),
    # A window shorter than the context is refused (every layer would use it).
    DecoderFamily("mistral", "MistralForCausalLM", hf_fields=_mistral_fields,
                  hf_extra=lambda c: {**_llama_extra(c), "sliding_window": c.sliding_window}),
    DecoderFamily("qwen2", "Qwen2ForCausalLM", hf_fields=_qwen2_fields, hf_extra=_qwen_extra, gguf_arch="qwen2"),
    DecoderFamily("qwen3", "Qwen3ForCausalLM", hf_fields=_qwen3_fields, hf_extra=_qwen3_extra, gguf_arch="qwen3",
                  qk_norm=True, triton_decode=False),
    DecoderFamily("phi3", "Phi3ForCausalLM", hf_fields=_phi3_fields, hf_extra=_phi3_extra, gguf_arch="phi3",
                  gguf_fields=_phi3_gguf, fused_weights=_PHI3_FUSED, gguf_tensor_names=_PHI3_GGUF_TENSORS,
                  triton_decode=False, turn_end_tokens=("<|end|>",)),
    DecoderFamily("gemma2", "Gemma2ForCausalLM", hf_fields=_gemma2_fields, hf_extra=_gemma_extra, gguf_arch="gemma2",
                  gguf_fields=_gemma2_gguf, **_GEMMA),  # type: ignore[arg-type]
    # Text models only: model_type gemma3 (with a vision tower) is not in this table.
    DecoderFamily("gemma3_text", "Gemma3ForCausalLM", hf_fields=_gemma3_fields, hf_extra=_gemma3_extra,
                  gguf_arch="gemma3", gguf_fields=_gemma3_gguf, qk_norm=True, **_GEMMA),  # type: ignore[arg-type]
)}

GGUF_FAMILIES: Mapping[str, DecoderFamily] = {f.gguf_arch: f for f in DECODER_FAMILIES.values() if f.gguf_arch}


def decoder_family(model_type: str, architectures: list[str] | None = None) -> DecoderFamily:
    """The family of a ``config.json``'s model_type; ValueError naming the supported ones otherwise."""
    family = DECODER_FAMILIES.get(model_type)
    if family is None:
        arch = f" ({', '.join(architectures)})" if architectures else ""
        raise ValueError(f"model_type {model_type!r}{arch} is not supported; supported decoder architectures: "
                         f"{', '.join(DECODER_FAMILIES)}")
    return family


def gguf_family(arch: str) -> DecoderFamily:
    family = GGUF_FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_FAMILIES)}")
    return family


__all__ = ["DecoderFamily", "DECODER_FAMILIES", "GGUF_FAMILIES", "decoder_family", "gguf_family", "PRE_NORM",
           "SANDWICH", "ACTIVATIONS", "GEMMA_CHAT_TEMPLATE"]
