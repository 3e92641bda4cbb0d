"""A plain BERT encoder (the all-MiniLM-L6-v2 architecture) loaded from safetensors.

Written out instead of using transformers' BertModel so that the forward pass is one small,
static-shape function that torch.compile and CUDA graphs capture without surprises.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: only hidden_act=gelu is supported, got {raw['hidden_act']!r}")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        heads = lambda t: t.view(b, s, self.n_heads, h // self.n_heads).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        a = a.transpose(1, 2).reshape(b, s, h)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    """Token ids + attention mask -> last hidden states (batch, seq, hidden)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.emb_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        # Single-segment inputs: token type 0 everywhere, as sentence-transformers feeds them.
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings.weight[0]
        x = self.emb_norm(x)
        # Additive bias in the activation dtype: 0 where attended, a large negative where padded.
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, bias)
        return x


def mean_pool_normalize(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' mean pooling over the attention mask followed by L2 normalisation."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    counts = mask.sum(dim=1).clamp(min=1e-9)
    return F.normalize((summed / counts).float(), p=2, dim=1)


# Checkpoint name (Hugging Face BertModel layout) -> our parameter name.
_LAYER_KEYS = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "out_norm",
}


def _rename(key: str) -> str | None:
    key = key.removeprefix("bert.")
    if key.startswith("embeddings."):
        name = key.removeprefix("embeddings.")
        if name.startswith("position_ids"):
            return None
        return name.replace("LayerNorm", "emb_norm")
    if key.startswith("encoder.layer."):
        _, _, idx, rest = key.split(".", 3)
        for src, dst in _LAYER_KEYS.items():
            if rest.startswith(src + "."):
                return f"layers.{idx}.{dst}.{rest[len(src) + 1:]}"
    if key.startswith("pooler."):
        return None  # sentence embeddings use mean pooling, not BERT's pooler
    raise KeyError(f"unexpected tensor {key!r} in BERT checkpoint")


def load_bert(model_dir: Path) -> BertEncoder:
    """Build the encoder from `config.json` + `model.safetensors` (no pickle is ever loaded)."""
    model_dir = Path(model_dir)
    cfg = BertConfig.from_json(model_dir / "config.json")
    with torch.device("meta"):
        model = BertEncoder(cfg)
    state = {}
    for key, tensor in load_file(str(model_dir / "model.safetensors")).items():
        name = _rename(key)
        if name is not None:
            state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
