"""Rotary encoders for sentence embeddings: ModernBERT, from safetensors.

Written out like `encoder.py`'s post-LayerNorm encoders so that the forward pass is one small
static-shape function. What ModernBERT changes against BERT:

- no position table: rotary embeddings on queries and keys (half-split, GPT-NeoX style), with
  one base for global layers and another for local ones;
- pre-norm blocks (the first layer's attention input is the embeddings' norm itself), a final
  norm, LayerNorms and linears without biases unless the config asks for them;
- a GeGLU MLP: one `Wi` projection split into an activated half and a gate half;
- global attention every `global_attn_every_n_layers` layers and a sliding window elsewhere: a
  token sees keys at most `local_attention // 2` positions away on either side.

Padding: rows are right-padded, so a real token's position is its index and its keys never
include a padded one (the padding bias); what a padded row computes is never pooled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from servekit.optimizations.models.encoder import UnsupportedModel
from servekit.optimizations.models.weights import load_safetensors

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
GLOBAL, LOCAL = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RotaryEncoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]          # GLOBAL or LOCAL per layer
    rope_theta: dict[str, float]          # per layer type
    window: int                           # a LOCAL layer's keys: |query - key| <= window
    norm_eps: float = 1e-5
    hidden_act: str = "gelu"
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    pad_token_id: int = 0

    @property
    def max_tokens(self) -> int:
        """The longest sequence the model was configured for (rotary has no table to run out of)."""
        return self.max_position_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: Path) -> "RotaryEncoderConfig":
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type") != "modernbert":
            raise UnsupportedModel(f"{path}: model_type {raw.get('model_type')!r} is not a rotary encoder servekit "
                                   "serves (modernbert)")
        n = int(raw["num_hidden_layers"])
        # transformers >= 5 writes layer_types and rope_parameters; earlier versions and the published
        # checkpoints write global_attn_every_n_layers and global/local_rope_theta.
        every = int(raw.get("global_attn_every_n_layers", 3))
        types = tuple(raw.get("layer_types") or (LOCAL if i % every else GLOBAL for i in range(n)))
        if len(types) != n or set(types) - {GLOBAL, LOCAL}:
            raise UnsupportedModel(f"{path}: layer_types must list {GLOBAL!r} or {LOCAL!r} for each of {n} layers")
        theta = {GLOBAL: float(raw.get("global_rope_theta", 160000.0)),
                 LOCAL: float(raw.get("local_rope_theta") or raw.get("global_rope_theta", 10000.0))}
        for kind, params in (raw.get("rope_parameters") or {}).items():
            if params is None:
                continue
            if params.get("rope_type", "default") != "default":
                raise UnsupportedModel(f"{path}: rope_type {params['rope_type']!r} for {kind} layers is not "
                                       "supported (default rotary only)")
            theta[kind] = float(params["rope_theta"])
        act = raw.get("hidden_activation", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"{path}: hidden_activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if raw["hidden_size"] % raw["num_attention_heads"]:
            raise UnsupportedModel(f"{path}: hidden_size {raw['hidden_size']} is not a multiple of "
                                   f"num_attention_heads {raw['num_attention_heads']}")
        return cls(family="modernbert", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   num_hidden_layers=n, num_attention_heads=raw["num_attention_heads"],
                   intermediate_size=raw["intermediate_size"],
                   max_position_embeddings=raw.get("max_position_embeddings", 8192), layer_types=types,
                   rope_theta=theta, window=int(raw.get("local_attention", 128)) // 2,
                   norm_eps=float(raw.get("norm_eps", 1e-5)), hidden_act=act,
                   norm_bias=bool(raw.get("norm_bias", False)), attention_bias=bool(raw.get("attention_bias", False)),
                   mlp_bias=bool(raw.get("mlp_bias", False)),
                   pad_token_id=int(raw["pad_token_id"] if raw.get("pad_token_id") is not None else 0))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the last dim, its two halves paired (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class RotaryLayer(nn.Module):
    def __init__(self, cfg: RotaryEncoderConfig, first: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.act = ACTIVATIONS[cfg.hidden_act]
        # The first layer attends to the embeddings' norm directly: no second norm there.
        self.attn_norm = nn.Identity() if first else nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(h, h, bias=cfg.attention_bias)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp_in = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp_out = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, h // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, attn_mask=bias)
        x = x + self.attn_out(a.transpose(1, 2).reshape(b, s, h))
        value, gate = self.mlp_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_out(self.act(value) * gate)


class RotaryEncoder(nn.Module):
    """Token ids + attention mask -> last hidden states (batch, seq, hidden)."""

    def __init__(self, cfg: RotaryEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.emb_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.layers = nn.ModuleList(RotaryLayer(cfg, i == 0) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        d = cfg.head_dim
        for kind in set(cfg.layer_types):
            inv_freq = 1.0 / (cfg.rope_theta[kind] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            self.register_buffer(f"inv_freq_{kind}", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.emb_norm(self.word_embeddings(input_ids))
        pos = torch.arange(s, device=input_ids.device)
        neg = torch.finfo(x.dtype).min
        padding = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * neg
        biases, rotary = {GLOBAL: padding}, {}
        if LOCAL in self.cfg.layer_types:
            far = (pos[None, :] - pos[:, None]).abs() > self.cfg.window
            biases[LOCAL] = padding.masked_fill(far, neg)
        for kind in set(self.cfg.layer_types):
            freqs = pos[:, None].float() * getattr(self, f"inv_freq_{kind}")
            emb = torch.cat((freqs, freqs), dim=-1)
            rotary[kind] = (emb.cos(), emb.sin())
        for layer, kind in zip(self.layers, self.cfg.layer_types):
            x = layer(x, biases[kind], *rotary[kind])
        return self.final_norm(x)


def _rename(key: str) -> str | None:
    """Checkpoint tensor name (ModernBertModel, or a head model's `model.` prefix) -> our parameter name."""
    key = key.removeprefix("model.")
    if key.startswith(("head.", "decoder.", "classifier.", "dense.")):
        return None  # MLM and classification heads: sentence embeddings pool the hidden states themselves
    names = {"embeddings.tok_embeddings.": "word_embeddings.", "embeddings.norm.": "emb_norm.",
             "final_norm.": "final_norm."}
    for src, dst in names.items():
        if key.startswith(src):
            return dst + key[len(src):]
    if key.startswith("layers."):
        idx, rest = key[len("layers."):].split(".", 1)
        parts = {"attn_norm.": "attn_norm.", "attn.Wqkv.": "qkv.", "attn.Wo.": "attn_out.",
                 "mlp_norm.": "mlp_norm.", "mlp.Wi.": "mlp_in.", "mlp.Wo.": "mlp_out."}
        for src, dst in parts.items():
            if rest.startswith(src):
                return f"layers.{idx}.{dst}{rest[len(src):]}"
    raise UnsupportedModel(f"unexpected tensor {key!r} in a modernbert checkpoint")


def _expected(cfg: RotaryEncoderConfig) -> set[str]:
    with torch.device("meta"):
        return set(RotaryEncoder(cfg).state_dict())


def load_rotary_encoder(model_dir: Path) -> RotaryEncoder:
    """Build the encoder from `config.json` + safetensors (one file or shards; no pickle is ever loaded)."""
    model_dir = Path(model_dir)
    cfg = RotaryEncoderConfig.from_json(model_dir / "config.json")
    state = {}
    for key, tensor in load_safetensors(model_dir).items():
        name = _rename(key)
        if name is not None:
            state[name] = tensor.float()
    missing = sorted(_expected(cfg) - set(state))
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {len(missing)} tensors of a {cfg.family} encoder "
                               f"(first: {missing[0]})")
    model = RotaryEncoder(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval()


def check_rotary_checkpoint(model_dir: Path) -> RotaryEncoderConfig:
    """Check without loading tensor data that `model_dir` holds exactly the tensors the encoder needs."""
    from safetensors import safe_open

    from servekit.optimizations.models.weights import INDEX, safetensors_files

    model_dir = Path(model_dir)
    cfg = RotaryEncoderConfig.from_json(model_dir / "config.json")
    names = set()
    for f in safetensors_files(model_dir):
        if f.name == INDEX:
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                names.update(filter(None, (_rename(k) for k in st.keys())))
        except UnsupportedModel:
            raise
        except Exception as e:
            raise UnsupportedModel(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    missing = sorted(_expected(cfg) - names)
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {len(missing)} tensors of a {cfg.family} encoder "
                               f"(first: {missing[0]})")
    return cfg
