"""A plain PyTorch Llama (SmolLM2 and friends) with a static, preallocated KV cache.

One readable module in the spirit of gpt-fast's ``model.py``:

* ``LlamaConfig``: the handful of numbers that define the architecture, read from / written to a
  Hugging Face ``config.json`` so a converted checkpoint stays loadable by ``transformers`` too.
* RoPE from precomputed cos/sin tables (no complex numbers), in the Hugging Face "rotate half"
  layout. GGUF files store q/k rows permuted for llama.cpp's interleaved RoPE; ``gguf_weights``
  undoes that permutation when it reads them, so every checkpoint we load is in this layout.
* RMSNorm computed in fp32 (as transformers does), grouped-query attention, SwiGLU MLP, tied
  input/output embeddings when the checkpoint ties them.
* ``KVCache``: buffers of shape ``(max_batch, n_kv_heads, max_seq_len, head_dim)`` written at
  per-row positions. Every row carries its own positions (``input_pos`` has shape ``(B, T)``), so
  prompts of different lengths share a batch without left padding: a row's token at position p
  attends to cache slots ``0..p`` of that row and nothing else. A batch of ``B`` rows uses cache
  rows ``0..B-1``; fixed shapes per batch bucket make the decode step capturable as a CUDA graph.

No TorchServe imports here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


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
    eos_token_id: int | None = 2
    pad_token_id: int | None = 2

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

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
        """Build from a Hugging Face Llama ``config.json`` dict (transformers 4.x or 5.x keys)."""
        if hf.get("model_type", "llama") != "llama":
            raise ValueError(f"expected a llama config, got model_type={hf.get('model_type')!r}")
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ValueError(f"only default RoPE is implemented, config has {rope or hf.get('rope_scaling')}")
        n_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            intermediate_size=hf["intermediate_size"],
            rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self, dtype: torch.dtype = torch.float32) -> dict:
        """A ``config.json`` dict that both transformers 4.x and 5.x load as ``LlamaForCausalLM``."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            # Both spellings: 4.x reads rope_theta, 5.x reads rope_parameters.
            "rope_theta": self.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_base},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }


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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics as in transformers' LlamaRMSNorm, so bf16 runs match it closely.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, base: float, device: torch.device | str | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(max_seq_len, head_dim)`` in fp32, "rotate half" layout."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
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
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.wqkv: nn.Linear | None = None  # set by fuse()
        self.kv_cache: KVCache | None = None

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
        q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is None:
            raise RuntimeError("call Transformer.setup_caches() before forward()")
        k, v = self.kv_cache.update(input_pos, k, v, mask.shape[-1], rows)
        # GQA without copying the cache: fold each kv head's query group into the query-length
        # axis, (B, n_kv, group*T, D), and repeat the (B, T, S) mask to match.
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(b, self.n_kv_heads, group * t, self.head_dim)
        m = mask[:, None, None].expand(b, 1, group, t, mask.shape[-1]).reshape(b, 1, group * t, -1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        y = y.reshape(b, self.n_heads, t, self.head_dim).transpose(1, 2).reshape(b, t, -1)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)  # down
        self.w13: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        """Replace the gate and up projections by one (see ``Attention.fuse``)."""
        if self.w13 is not None:
            return
        self.w13 = _concat_linears(self.w1, self.w3)
        del self.w1, self.w3

    def forward(self, x: Tensor) -> Tensor:
        if self.w13 is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def _concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose output is the given Linears' outputs side by side."""
    weight = torch.cat([m.weight for m in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor,
                rows: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos, rows)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.max_batch_size = 0
        self.max_seq_len = 0

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
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        w = self.tok_embeddings.weight
        for layer in self.layers:
            # One spare slot that attention never reads: a kv_len equal to the buffer length would
            # make the sliced cache contiguous, and torch.compile would specialize (compile twice) on it.
            # One spare row too: where padding rows of a prefill into given rows write (``rows``).
            layer.attention.kv_cache = KVCache(max_batch_size + 1, self.config.n_kv_heads, max_seq_len + 1,
                                               self.config.head_dim, w.dtype, w.device)
        cos, sin = rope_tables(self.config.head_dim, max_seq_len, self.config.rope_base, w.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
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
        ``self.layers`` (compiled copies of them, see ``servekit.optimizations.generate.RegionalCompiled``).
        ``rows`` ``(B,)``: the cache rows the batch's rows use (default ``0..B-1``); a prefill into
        free slots of a running batch passes them (``max_batch_size`` is the spare row).
        """
        return self.output(self.hidden(tokens, input_pos, last_idx, kv_len, blocks, rows)).float()

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
        cos = self.rope_cos[input_pos].unsqueeze(1).to(x.dtype)
        sin = self.rope_sin[input_pos].unsqueeze(1).to(x.dtype)
        # (B, T, S): a token at position p sees cache slots 0..p of its own row.
        kv_len = self.max_seq_len if kv_len is None else kv_len
        mask = self.cache_positions[None, None, :kv_len] <= input_pos[:, :, None]
        for layer in self.layers if blocks is None else blocks:
            x = layer(x, cos, sin, mask, input_pos, rows)
        if last_idx is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_idx]
        return self.norm(x)


# Hugging Face parameter names <-> ours. Checkpoints on disk use the Hugging Face names so that
# transformers can load them too (the GPU benchmark's baseline does).
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_ours(name: str) -> str:
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    parts = name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_LAYER_NAMES:
        return f"layers.{parts[2]}.{_HF_LAYER_NAMES[parts[3]]}"
    raise KeyError(f"unexpected Llama checkpoint tensor {name!r}")


def ours_to_hf(name: str) -> str:
    top = {v: k for k, v in _HF_TOP_NAMES.items()}
    if name in top:
        return top[name]
    layers, i, rest = name.split(".", 2)
    hf = {v: k for k, v in _HF_LAYER_NAMES.items()}
    if layers != "layers" or rest not in hf:
        raise KeyError(f"unexpected parameter {name!r}")
    return f"model.layers.{i}.{hf[rest]}"


def model_from_hf_state_dict(config: LlamaConfig, state_dict: dict[str, Tensor],
                             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Transformer:
    """Build a ``Transformer`` from Hugging Face-named tensors, without a random init pass."""
    with torch.device("meta"):
        model = Transformer(config)
    ours = {hf_to_ours(k): v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if config.tie_embeddings:
        ours.pop("output.weight", None)  # tied: the embedding is the output projection
        ours["output.weight"] = ours["tok_embeddings.weight"]
    missing = set(model.state_dict()) - set(ours)
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    model.load_state_dict(ours, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def load_llama(model_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """Load ``config.json`` + ``model.safetensors`` (Hugging Face names) from ``model_dir``."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = LlamaConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    state_dict = load_file(model_dir / "model.safetensors", device=str(device))
    return model_from_hf_state_dict(config, state_dict, device, dtype)


def init_random(config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    """Random weights for logic tests (scaled so activations stay in a sane range)."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model.to(dtype).eval()


__all__ = ["LlamaConfig", "KVCache", "Transformer", "load_llama", "model_from_hf_state_dict",
           "hf_to_ours", "ours_to_hf", "init_random", "rope_tables", "apply_rope"]
