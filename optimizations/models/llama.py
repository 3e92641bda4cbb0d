"""A plain PyTorch Llama-family decoder with a static, preallocated KV cache.

Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3, SmolLM, Gemma 2 / 3: the same layers, told apart by
their ``config.json`` (q/k/v biases, q/k norms, RoPE scaling, tied embeddings, sliding-window
layers, Gemma's sandwich norms and soft-capping), never by name; ``families.py`` lists each family's
mapping. One readable module in the spirit of gpt-fast's ``model.py``:

* ``LlamaConfig``: the handful of numbers that define the architecture, read from / written to a
  Hugging Face ``config.json`` so a converted checkpoint stays loadable by ``transformers`` too.
  What this module would compute differently from transformers (other RoPE types, a sliding
  window shorter than the context, other activations) is refused with a message saying so.
* RoPE from precomputed cos/sin tables (no complex numbers), in the Hugging Face "rotate half"
  layout, with ``linear`` or ``llama3`` frequency scaling folded into the tables. GGUF files store q/k rows permuted for llama.cpp's interleaved RoPE; ``gguf_weights``
  undoes that permutation when it reads them, so every checkpoint we load is in this layout.
* RMSNorm computed in fp32 (as transformers does; Gemma's scales by ``1 + weight`` in fp32),
  grouped-query attention, SwiGLU (or Gemma's tanh-GELU) MLP, tied input/output embeddings when
  the checkpoint ties them. Sliding-window layers (Gemma) attend through a windowed mask over the
  same full-length cache, with their own RoPE tables where their base differs.
* ``KVCache``: buffers of shape ``(max_batch, n_kv_heads, max_seq_len, head_dim)`` written at
  per-row positions. Every row carries its own positions (``input_pos`` has shape ``(B, T)``), so
  prompts of different lengths share a batch without left padding: a row's token at position p
  attends to cache slots ``0..p`` of that row and nothing else. A batch of ``B`` rows uses cache
  rows ``0..B-1``; fixed shapes per batch bucket make the decode step capturable as a CUDA graph.

No TorchServe imports here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from servekit.optimizations.models.families import (ACTIVATIONS, DECODER_FAMILIES, SANDWICH, SLIDING,
                                                   DecoderFamily, decoder_family)
from servekit.optimizations.models.weights import INDEX, embedding, safetensors_files

# Architectures served by this module (families.py says what each one sets).
SUPPORTED_MODEL_TYPES = tuple(DECODER_FAMILIES)
ROPE_TYPES = ("default", "linear", "llama3")  # dynamic NTK, YaRN, LongRoPE: not implemented


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` (positions divided by ``factor``) or ``llama3`` (Llama 3.1's
    wavelength-dependent rescaling). Applied once to the inverse frequencies, so every step (plain,
    compiled, captured) uses the same static cos/sin tables."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_hf(self) -> dict:
        out: dict = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        return out


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rope_base: float = 100000.0
    norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2  # config.json allows one id or a list
    pad_token_id: int | None = 2
    model_type: str = "llama"
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets it and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    # Attention span. Without layer_types every layer would use it, which is served only where it
    # covers the whole context; with layer_types, the "sliding_attention" layers use it (Gemma).
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    activation: str = "silu"  # silu (SwiGLU) | gelu_tanh (Gemma's GeGLU)
    norm_offset: float = 0.0  # 1.0: norms scale by 1 + weight, in fp32 (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(dim), rounded to the model's dtype (Gemma)
    attn_scalar: float | None = None  # scores scaled by attn_scalar ** -0.5 (default head_dim; Gemma's query_pre_attn_scalar)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    logit_softcap: float | None = None  # the same on the output logits (Gemma 2)
    layer_types: tuple[str, ...] = ()  # per layer, "full_attention" or "sliding_attention"; () all full
    rope_local_base: float | None = None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_base

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"RoPE type {self.rope_scaling.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.activation not in ACTIVATIONS.values():
            raise ValueError(f"activation {self.activation!r} is not supported; supported: {', '.join(ACTIVATIONS.values())}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    @property
    def family(self) -> DecoderFamily:
        return DECODER_FAMILIES[self.model_type]

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window (implemented by its mask)."""
        return tuple(t == SLIDING for t in self.layer_types) or (False,) * self.n_layers

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.eos_token_id
        return () if ids is None else (ids,) if isinstance(ids, int) else tuple(ids)

    @property
    def max_context(self) -> int:
        """The longest KV cache that computes this model: its positions, and a window every layer
        would use when layer_types does not say which layers slide (``check_context``)."""
        if self.sliding_window is not None and not self.layer_types:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def check_context(self, max_seq_len: int) -> None:
        """Raise ValueError if a KV cache of ``max_seq_len`` tokens would not compute this model."""
        if max_seq_len > self.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                             f"max_position_embeddings={self.max_position_embeddings}")
        # Without layer_types, attention here is full causal attention; it equals the model's
        # sliding-window attention only while no token is further than the window from another.
        if self.sliding_window is not None and not self.layer_types and max_seq_len > self.sliding_window:
            raise ValueError(f"the model attends over a sliding window of {self.sliding_window} tokens, which is not "
                             f"implemented; use a max_seq_len of at most {self.sliding_window}")

    @classmethod
    def tiny(cls, **overrides: object) -> "LlamaConfig":
        """A random-init model of the same architecture, small enough for fast CPU tests."""
        base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    intermediate_size=128, rope_base=10000.0, max_position_embeddings=512,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Build from a Hugging Face ``config.json`` dict of a family in ``families.py`` (transformers
        4.x or 5.x keys); anything this module would compute differently is refused."""
        model_type = hf.get("model_type", "llama")
        family = decoder_family(model_type, hf.get("architectures"))
        fields = family.hf_fields(hf)
        act = fields.pop("activation", hf.get("hidden_act", "silu"))
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        n_heads = hf["num_attention_heads"]
        theta, scaling = _rope_from_hf(fields.pop("rope_hf", hf))
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            rope_base=theta,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # transformers' default for every family here
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", model_type.startswith("gemma"))),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            model_type=model_type,
            activation=ACTIVATIONS[act],
            rope_scaling=scaling,
            **fields,
        )

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict:
        """A ``config.json`` dict that both transformers 4.x and 5.x load as this architecture."""
        rope = self.rope_scaling.to_hf() if self.rope_scaling else {"rope_type": "default"}
        out = {
            "architectures": [self.family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": {v: k for k, v in ACTIVATIONS.items()}[self.activation],
            "rms_norm_eps": self.norm_eps,
            # Both spellings: 4.x reads rope_theta and rope_scaling, 5.x reads rope_parameters.
            "rope_theta": self.rope_base,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "rope_parameters": {**rope, "rope_theta": self.rope_base},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        return {**out, **self.family.hf_extra(self)}


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope theta, scaling) from 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer RoPE parameters are not supported: {sorted(params)}")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    try:
        if rope_type == "linear":
            return theta, RopeScaling("linear", float(params["factor"]))
        return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                                  float(params["high_freq_factor"]),
                                  int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{rope_type} RoPE parameters {params} lack {e.args[0]!r}") from None


class KVCache(nn.Module):
    def __init__(self, max_batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, kv_len: int,
               rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write k/v ``(B, H, T, D)`` at per-row positions ``input_pos`` ``(B, T)``.

        Returns cache rows ``:B`` (or the cache rows ``rows`` ``(B,)``: a prefill into given slots
        while other rows decode), slots ``:kv_len`` (what attention reads).
        """
        b, h, t, d = k.shape
        if rows is not None:
            index = (rows[:, None, None], torch.arange(h, device=k.device)[None, :, None], input_pos[:, None, :])
            self.k_cache.index_put_(index, k)
            self.v_cache.index_put_(index, v)
            return self.k_cache[rows, :, :kv_len], self.v_cache[rows, :, :kv_len]
        idx = input_pos[:, None, :, None].expand(b, h, t, d)
        k_out = self.k_cache[:b]
        v_out = self.v_cache[:b]
        # In-place on a view of the buffer: the write lands in the preallocated cache.
        k_out.scatter_(2, idx, k)
        v_out.scatter_(2, idx, v)
        return k_out[:, :, :kv_len], v_out[:, :, :kv_len]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset  # Gemma: the weight is stored as (scale - 1)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics as in transformers' LlamaRMSNorm, so bf16 runs match it closely.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in fp32 before casting back (transformers' Gemma RMSNorm)
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def local_rope_config(config: LlamaConfig) -> LlamaConfig | None:
    """The RoPE settings of the sliding layers where they differ from the global ones (Gemma 3:
    their own base, no scaling), else None."""
    if config.rope_local_base is None or not any(config.sliding_layers):
        return None
    if config.rope_local_base == config.rope_base and config.rope_scaling is None:
        return None
    return dataclasses.replace(config, rope_base=config.rope_local_base, rope_scaling=None)


def rope_inv_freq(config: LlamaConfig, device: torch.device | str | None = None) -> Tensor:
    """Inverse frequencies ``(head_dim / 2,)`` in fp32, scaled as the config says (the same
    arithmetic as transformers' ``modeling_rope_utils``, so tables agree to the last bit)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # llama3: long wavelengths slowed down by `factor`, short ones kept, a smooth blend between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: LlamaConfig, max_seq_len: int, device: torch.device | str | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(max_seq_len, head_dim)`` in fp32, "rotate half" layout."""
    inv_freq = rope_inv_freq(config, device)
    freqs = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``(B, H, T, D)``; cos/sin ``(B, 1, T, D)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        bias = config.qkv_bias
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.o_bias)
        self.wqkv: nn.Linear | None = None  # set by fuse()
        self.kv_cache: KVCache | None = None
        # Set while a packed prefill runs (servekit.optimizations.llm.packed): it writes k/v and attends instead.
        self.packed: Callable[..., Tensor] | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset)
        self.qk_norm = config.qk_norm
        self.scale = None if config.attn_scalar is None else config.attn_scalar ** -0.5  # None: SDPA's 1/sqrt(head_dim)
        self.softcap = config.attn_softcap

    def fuse(self) -> None:
        """Replace wq, wk, wv by one projection: a decode step is bound by kernel launches, and one
        matmul with the three outputs costs about what each of the three small ones did."""
        if self.wqkv is not None:
            return
        self.wqkv = _concat_linears(self.wq, self.wk, self.wv)
        del self.wq, self.wk, self.wv

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.wqkv is None:
            return self.wq(x), self.wk(x), self.wv(x)
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        return q, k, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor,
                rows: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.packed is not None:  # one row of several requests' tokens, each attending over its own cache row
            return self.wo(self.packed(self, q, k, v).reshape(b, t, -1))
        if self.kv_cache is None:
            raise RuntimeError("call Transformer.setup_caches() before forward()")
        k, v = self.kv_cache.update(input_pos, k, v, mask.shape[-1], rows)
        # GQA without copying the cache: fold each kv head's query group into the query-length
        # axis, (B, n_kv, group*T, D), and repeat the (B, T, S) mask to match.
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(b, self.n_kv_heads, group * t, self.head_dim)
        m = mask[:, None, None].expand(b, 1, group, t, mask.shape[-1]).reshape(b, 1, group * t, -1)
        y = self._softcapped(q, k, v, m) if self.softcap else F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                                           scale=self.scale)
        y = y.reshape(b, self.n_heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)
        return self.wo(y)

    def _softcapped(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """Attention with Gemma 2's score soft-capping (which SDPA has no option for), softmax in
        fp32 as transformers' eager attention does."""
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=bias)  # gate
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=bias)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=bias)  # down
        self.w13: nn.Linear | None = None  # set by fuse()
        self.act = F.silu if config.activation == "silu" else functools.partial(F.gelu, approximate="tanh")

    def fuse(self) -> None:
        """Replace the gate and up projections by one (see ``Attention.fuse``)."""
        if self.w13 is not None:
            return
        self.w13 = _concat_linears(self.w1, self.w3)
        del self.w1, self.w3

    def forward(self, x: Tensor) -> Tensor:
        if self.w13 is None:
            return self.w2(self.act(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.act(gate) * up)


def _concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs side by side (biases concatenated
    too: they all have one or none, as the config gives every projection of a group the same)."""
    weight = torch.cat([m.weight for m in linears])
    has_bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    return fused


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.sandwich = config.family.block == SANDWICH
        if self.sandwich:  # Gemma: each sub-block's output normed too, before the residual add
            self.post_attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
            self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor,
                rows: Tensor | None = None) -> Tensor:
        if self.sandwich:
            h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, mask, input_pos, rows))
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos, rows)
        return h + self.feed_forward(self.ffn_norm(h))


class SoftCappedLinear(nn.Linear):
    """The output projection with Gemma 2's final logit soft-capping, cap * tanh(logits / cap), so
    every caller of ``model.output`` (plain and speculative steps) gets the capped logits."""

    def __init__(self, in_features: int, out_features: int, cap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.cap = cap

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(super().forward(x) / self.cap) * self.cap


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.output = (SoftCappedLinear(config.dim, config.vocab_size, config.logit_softcap) if config.logit_softcap
                       else nn.Linear(config.dim, config.vocab_size, bias=False))
        self.tie_weights()
        self.max_batch_size = 0
        self.max_seq_len = 0
        self._row_views: dict[int, list[Tensor]] = {}

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up projections in every layer, in place (idempotent). Serving only:
        the fused model's parameter names no longer map to checkpoint names."""
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the KV cache (model dtype and device) and the RoPE tables; idempotent."""
        if max_batch_size <= self.max_batch_size and max_seq_len == self.max_seq_len:
            return
        self.config.check_context(max_seq_len)
        w = self.tok_embeddings.weight
        for layer in self.layers:
            # One spare slot that attention never reads: a kv_len equal to the buffer length would
            # make the sliced cache contiguous, and torch.compile would specialize (compile twice) on it.
            # One spare row too: where padding rows of a prefill into given rows write (``rows``).
            layer.attention.kv_cache = KVCache(max_batch_size + 1, self.config.n_kv_heads, max_seq_len + 1,
                                               self.config.head_dim, w.dtype, w.device)
        cos, sin = rope_tables(self.config, max_seq_len, w.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        local = local_rope_config(self.config)
        if local is not None:  # the sliding layers' own tables (Gemma 3)
            cos, sin = rope_tables(local, max_seq_len, w.device)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        self.register_buffer("cache_positions", torch.arange(max_seq_len, device=w.device), persistent=False)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def forward(self, tokens: Tensor, input_pos: Tensor, last_idx: Tensor | None = None,
                kv_len: int | None = None, blocks: Sequence[Callable[..., Tensor]] | None = None,
                rows: Tensor | None = None) -> Tensor:
        """tokens, input_pos: ``(B, T)`` int64 with per-row positions.

        Returns fp32 logits ``(B, T, V)``, or ``(B, V)`` at column ``last_idx[b]`` of each row when
        ``last_idx`` is given (prefill only needs each prompt's last token: skips the vocab
        projection of every other position). Attention reads cache slots ``:kv_len`` only (default:
        the whole cache); the caller guarantees every position that matters is below ``kv_len``,
        which saves reading the cache's unused tail. ``blocks``: callables run instead of
        ``self.layers`` (compiled copies of them, see ``servekit.optimizations.llm.generate.RegionalCompiled``).
        ``rows`` ``(B,)``: the cache rows the batch's rows use (default ``0..B-1``); a prefill into
        free slots of a running batch passes them (``max_batch_size`` is the spare row).
        """
        return self.output(self.hidden(tokens, input_pos, last_idx, kv_len, blocks, rows)).float()

    def cache_row(self, row: int) -> list[Tensor]:
        """Cache row ``row`` of every layer's K and V (views), made once per row: the engine copies
        whole rows (prefix-cache placements, compaction) many times a second, and building the
        ``2 x layers`` views each time cost more host time than the copy's launch."""
        views = self._row_views.get(row)
        if views is None or views[0]._base is not self.layers[0].attention.kv_cache.k_cache:
            # (none yet, or the caches were replaced since: moved to another device, reallocated)
            caches = [layer.attention.kv_cache for layer in self.layers]
            views = self._row_views[row] = [t[row] for c in caches for t in (c.k_cache, c.v_cache)]
        return views

    @property
    def spare_row(self) -> int:
        """A cache row no request uses: padding rows of a prefill into given rows write there."""
        return self.max_batch_size

    def hidden(self, tokens: Tensor, input_pos: Tensor, last_idx: Tensor | None = None,
               kv_len: int | None = None, blocks: Sequence[Callable[..., Tensor]] | None = None,
               rows: Tensor | None = None) -> Tensor:
        """``forward`` without the vocab projection: the final normed hidden state ``(B, T, dim)``
        (``(B, dim)`` with ``last_idx``), in the model's dtype. Writes the KV cache like ``forward``."""
        if tokens.shape[0] > self.max_batch_size:
            raise ValueError(f"batch {tokens.shape[0]} exceeds the cache's max_batch_size={self.max_batch_size}")
        x = self.tok_embeddings(tokens)
        if self.config.embed_scale:
            x = x * _rounded(self.config.dim ** 0.5, x.dtype)
        cos = self.rope_cos[input_pos].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[input_pos].unsqueeze(1).to(x.dtype)
        # (B, T, S): a token at position p sees cache slots 0..p of its own row.
        kv_len = self.max_seq_len if kv_len is None else kv_len
        slots = self.cache_positions[None, None, :kv_len]
        mask = slots <= input_pos[:, :, None]
        sliding = self.config.sliding_layers
        local_mask, local_cos, local_sin = mask, cos, sin
        if any(sliding):  # ... and, in a sliding layer, only the last sliding_window of them.
            local_mask = mask & (slots > input_pos[:, :, None] - self.config.sliding_window)
            if hasattr(self, "rope_local_cos"):
                local_cos = self.rope_local_cos[input_pos].unsqueeze(1).to(x.dtype)
                local_sin = self.rope_local_sin[input_pos].unsqueeze(1).to(x.dtype)
        for layer, local in zip(self.layers if blocks is None else blocks, sliding):
            if local:
                x = layer(x, local_cos, local_sin, local_mask, input_pos, rows)
            else:
                x = layer(x, cos, sin, mask, input_pos, rows)
        if last_idx is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_idx]
        return self.norm(x)



class WithBlocks:
    """``model`` with its layers run as ``blocks`` (callables with ``TransformerBlock.forward``'s
    signature: compiled copies, fused kernels): looks like the model to the step functions
    (``__call__``, ``hidden``, every other attribute is the model's)."""

    def __init__(self, model: Transformer, blocks: Sequence[Callable[..., Tensor]]) -> None:
        self._model = model
        self.blocks = list(blocks)

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def __call__(self, tokens: Tensor, input_pos: Tensor, last_idx: Tensor | None = None,
                 kv_len: int | None = None, rows: Tensor | None = None) -> Tensor:
        return self._model(tokens, input_pos, last_idx, kv_len, blocks=self.blocks, rows=rows)

    def hidden(self, tokens: Tensor, input_pos: Tensor, last_idx: Tensor | None = None,
               kv_len: int | None = None) -> Tensor:
        return self._model.hidden(tokens, input_pos, last_idx, kv_len, blocks=self.blocks)

@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as ``dtype`` stores it: Gemma's embedding scale is a tensor of the model's dtype in
    transformers (sqrt(640) becomes 25.25 in bf16), and products must round the same way."""
    return float(torch.tensor(value, dtype=dtype))


# Hugging Face parameter names <-> ours (per family: families.py's layer_names). Checkpoints on
# disk use the Hugging Face names so that transformers can load them too (the GPU benchmark's
# baseline does).
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


@functools.lru_cache(maxsize=None)
def _layer_names(family: str) -> dict[str, str]:
    return {f"{hf}.{kind}": f"{ours}.{kind}" for hf, ours in DECODER_FAMILIES[family].layer_names.items()
            for kind in ("weight", "bias")}


def hf_to_ours(name: str, config: LlamaConfig | None = None) -> str:
    """Our parameter name of a Hugging Face tensor name (of ``config``'s family; default Llama)."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    family = config.model_type if config else "llama"
    parts = name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _layer_names(family):
        return f"layers.{parts[2]}.{_layer_names(family)[parts[3]]}"
    raise KeyError(f"unexpected {family} checkpoint tensor {name!r}")


def ours_to_hf(name: str, config: LlamaConfig | None = None) -> str:
    top = {v: k for k, v in _HF_TOP_NAMES.items()}
    if name in top:
        return top[name]
    layers, i, rest = name.split(".", 2)
    hf = {v: k for k, v in _layer_names(config.model_type if config else "llama").items()}
    if layers != "layers" or rest not in hf:
        raise KeyError(f"unexpected parameter {name!r}")
    return f"model.layers.{i}.{hf[rest]}"


def _is_derived(name: str) -> bool:
    """Tensors some checkpoints carry that are recomputed here, not weights (older Llama
    checkpoints saved each layer's RoPE ``inv_freq``)."""
    return name.endswith("rotary_emb.inv_freq")


def _split_fused(config: LlamaConfig, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoint tensors of modules that hold several of ours (``families.py``'s fused_weights:
    Phi-3's qkv_proj, gate_up_proj) split, along the output dimension, into those modules."""
    fused = config.family.fused_weights
    if not fused:
        return state_dict
    kv = config.n_kv_heads * config.head_dim
    rows = {"self_attn.q_proj": config.n_heads * config.head_dim, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "mlp.gate_proj": config.intermediate_size, "mlp.up_proj": config.intermediate_size}
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        parts = name.split(".")  # model.layers.<i>.<module...>.<weight|bias>
        module = ".".join(parts[3:-1])
        if parts[:2] != ["model", "layers"] or module not in fused:
            out[name] = t
            continue
        sizes = [rows[m] for m in fused[module]]
        if t.shape[0] != sum(sizes):
            raise KeyError(f"{name} has {t.shape[0]} rows, expected {sum(sizes)} ({' + '.join(fused[module])})")
        for m, piece in zip(fused[module], t.split(sizes)):
            out[f"model.layers.{parts[2]}.{m}.{parts[-1]}"] = piece
    return out


def model_from_hf_state_dict(config: LlamaConfig, state_dict: dict[str, Tensor],
                             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """Build a ``Transformer`` from Hugging Face-named tensors, without a random init pass."""
    with torch.device("meta"):
        model = Transformer(config)
    state_dict = _split_fused(config, state_dict)
    ours = {hf_to_ours(k, config): v.to(device=device, dtype=dtype) for k, v in state_dict.items() if not _is_derived(k)}
    if config.tie_embeddings:
        ours.pop("output.weight", None)  # tied: the embedding is the output projection
        ours["output.weight"] = ours["tok_embeddings.weight"]
    missing = set(model.state_dict()) - set(ours)
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    unexpected = set(ours) - set(model.state_dict())
    if unexpected:  # e.g. biases the config does not announce: loading them silently would drop them
        raise KeyError(f"checkpoint has tensors this config does not use: {sorted(unexpected)[:5]}")
    model.load_state_dict(ours, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def load_config(model_dir: str | Path) -> LlamaConfig:
    return LlamaConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


def load_llama(model_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """Load ``config.json`` + safetensors weights (Hugging Face names, one file or sharded) from
    ``model_dir``. Each tensor is cast as it is read, so peak memory stays near the model's size
    in ``dtype``."""
    from safetensors import safe_open

    config = load_config(model_dir)
    state_dict: dict[str, Tensor] = {}
    for path in (f for f in safetensors_files(Path(model_dir)) if f.name != INDEX):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                state_dict[name] = f.get_tensor(name).to(dtype)
    return model_from_hf_state_dict(config, state_dict, device, dtype)


def generation_stop_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Every end-of-sequence id the model's own files declare: ``eos_token_id`` (one id or a list)
    of ``config.json`` and of ``generation_config.json`` (Llama 3 instruct models end a turn with
    an id listed only in the latter)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
    return tuple(sorted(ids))


def init_random(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """Random weights for logic tests (scaled so activations stay in a sane range)."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 - config.norm_offset + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model.to(dtype).eval()


__all__ = ["LlamaConfig", "RopeScaling", "KVCache", "Transformer", "load_llama", "load_config", "model_from_hf_state_dict",
           "hf_to_ours", "ours_to_hf", "init_random", "rope_inv_freq", "rope_tables", "apply_rope", "local_rope_config",
           "generation_stop_ids"]
