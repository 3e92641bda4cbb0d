"""Post-LayerNorm Transformer encoders (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, MPNet) from safetensors.

Written out instead of using transformers' models so that the forward pass is one small,
static-shape function that torch.compile and CUDA graphs capture without surprises. The five
families share one layer; what differs is read from `config.json` into `EncoderConfig`:

- BERT: positions 0..s-1, token type 0 added (sentence-transformers feeds single segments).
- RoBERTa / XLM-RoBERTa: positions start at padding_idx + 1 (fairseq's convention); their one
  token type embedding is added as BERT's is.
- DistilBERT: other tensor names, no token types.
- MPNet: RoBERTa's positions plus a relative-position bias shared by every layer (T5 buckets).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from servekit.optimizations.models.errors import UnsupportedModel
from servekit.optimizations.models.weights import embedding, load_safetensors

if TYPE_CHECKING:  # rotary_encoder imports this module
    from servekit.optimizations.models.rotary_encoder import RotaryEncoderConfig

# model_type (config.json) -> family; also what `servekit archive` recognises as an encoder.
FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert",
            "mpnet": "mpnet"}
# Pre-norm rotary encoders (rotary_encoder.py), served as sentence embeddings only.
ROTARY_FAMILIES = {"modernbert": "modernbert", "nomic_bert": "nomic_bert"}
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# MPNet's relative-position buckets: transformers computes them with these constants whatever the config says.
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128


@dataclass(frozen=True)
class EncoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 0          # 0: no token type embedding
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0          # first position id (RoBERTa, MPNet: padding_idx + 1)
    relative_buckets: int = 0         # MPNet's relative attention bias size; 0: none
    pad_token_id: int = 0

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_json(cls, path: Path) -> "EncoderConfig":
        raw = json.loads(Path(path).read_text())
        family = encoder_family(raw, path)
        pad = int(raw.get("pad_token_id") if raw.get("pad_token_id") is not None else (0 if family in ("bert", "distilbert") else 1))
        if family == "distilbert":
            act = raw.get("activation", "gelu")
            # sinusoidal_pos_embds: the table is stored in the checkpoint like a learnt one.
            kw = dict(vocab_size=raw["vocab_size"], hidden_size=raw.get("dim", 768), num_hidden_layers=raw.get("n_layers", 6),
                      num_attention_heads=raw.get("n_heads", 12), intermediate_size=raw.get("hidden_dim", 3072),
                      max_position_embeddings=raw.get("max_position_embeddings", 512), layer_norm_eps=1e-12)
        else:
            act = raw.get("hidden_act", "gelu")
            kw = dict(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=raw["num_hidden_layers"],
                      num_attention_heads=raw["num_attention_heads"], intermediate_size=raw["intermediate_size"],
                      max_position_embeddings=raw["max_position_embeddings"],
                      layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)))
            if family in ("bert", "roberta"):
                kw["type_vocab_size"] = int(raw.get("type_vocab_size", 2 if family == "bert" else 1))
            if family in ("roberta", "mpnet"):
                kw["position_offset"] = pad + 1
            if family == "mpnet":
                kw["relative_buckets"] = int(raw.get("relative_attention_num_buckets", MPNET_BUCKETS))
        if family == "bert" and raw.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModel(f"{path}: position_embedding_type {raw['position_embedding_type']!r} is not "
                                   "supported (absolute only)")
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"{path}: activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        return cls(family=family, hidden_act=act, pad_token_id=pad, **kw)


def encoder_family(raw: dict, where: Path | str = "config.json") -> str:
    """The encoder family of a config.json mapping; UnsupportedModel naming the model type otherwise."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        arch = ", ".join(raw.get("architectures") or []) or "none given"
        raise UnsupportedModel(f"{where}: model_type {model_type!r} (architectures: {arch}) is not a supported "
                               f"encoder; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.act = ACTIVATIONS[cfg.hidden_act]
        # Queries, keys and values in one projection (the checkpoint's three, stacked at load): one
        # matmul three times as wide runs the GPU better than three narrow ones (hidden 384: MiniLM).
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, first_only: bool = False) -> torch.Tensor:
        """`first_only`: the output at the first position only, (b, 1, h): every key is still attended,
        but the attention output, norms and feed-forward run for one position instead of `s`."""
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, h // self.n_heads).permute(2, 0, 3, 1, 4)
        if first_only:
            x, q, attn_bias = x[:, :1], q[:, :, :1], attn_bias[:, :, :1]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        a = a.transpose(1, 2).reshape(b, x.shape[1], h)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.output(self.act(self.intermediate(x))))


def relative_position_bucket(relative: torch.Tensor, buckets: int = MPNET_BUCKETS,
                             max_distance: int = MPNET_MAX_DISTANCE) -> torch.Tensor:
    """MPNet's (T5's bidirectional) bucketing of key - query distances, as transformers computes it."""
    n = -relative
    half = buckets // 2
    ret = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (half - exact)).long()
    large = large.clamp(max=half - 1)
    return ret + torch.where(n < exact, n, large)


class Encoder(nn.Module):
    """Token ids + attention mask -> last hidden states (batch, seq, hidden)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = embedding(cfg.max_position_embeddings, cfg.hidden_size)
        if cfg.type_vocab_size:
            self.token_type_embeddings = embedding(cfg.type_vocab_size, cfg.hidden_size)
        if cfg.relative_buckets:
            self.relative_attention_bias = embedding(cfg.relative_buckets, cfg.num_attention_heads)
        self.emb_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, first_only: bool = False) -> torch.Tensor:
        """`first_only`: the hidden state of the first token only, (batch, 1, hidden), all a
        classification head reads; the last layer then computes that one position (1/6 of a
        6-layer encoder's work saved, less its keys and values)."""
        s = input_ids.shape[1]
        # Rows are right-padded, so every real token sits at its index: positions need no cumsum
        # over the ids (padding positions differ from transformers' but are never attended or pooled).
        pos = torch.arange(s, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos + self.cfg.position_offset)
        if self.cfg.type_vocab_size:
            # Single texts are all segment 0; a BERT text pair (cross-encoders) marks its second text 1.
            x = x + (self.token_type_embeddings.weight[0] if token_type_ids is None
                     else self.token_type_embeddings(token_type_ids))
        x = self.emb_norm(x)
        # Additive bias in the activation dtype: 0 where attended, a large negative where padded.
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        if self.cfg.relative_buckets:
            rel = relative_position_bucket(pos[None, :] - pos[:, None])
            bias = bias + self.relative_attention_bias(rel).permute(2, 0, 1).unsqueeze(0).to(x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, bias, first_only=first_only and i == last)
        return x


# Checkpoint tensor name (Hugging Face layout, per family) -> our parameter name.
_BERT_LAYER = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
               "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
               "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm"}
_LAYER_KEYS = {
    "bert": _BERT_LAYER,
    "roberta": _BERT_LAYER,
    "mpnet": {"attention.attn.q": "query", "attention.attn.k": "key", "attention.attn.v": "value",
              "attention.attn.o": "attn_out", "attention.LayerNorm": "attn_norm",
              "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm"},
    "distilbert": {"attention.q_lin": "query", "attention.k_lin": "key", "attention.v_lin": "value",
                   "attention.out_lin": "attn_out", "sa_layer_norm": "attn_norm", "ffn.lin1": "intermediate",
                   "ffn.lin2": "output", "output_layer_norm": "out_norm"},
}
_PREFIXES = ("bert.", "roberta.", "distilbert.", "mpnet.", "model.")
_LAYER_ROOTS = ("encoder.layer.", "transformer.layer.")


def _rename(key: str, family: str) -> str | None:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    if key.startswith("embeddings."):
        name = key.removeprefix("embeddings.")
        if name.startswith(("position_ids", "token_type_ids")):
            return None  # buffers, not weights
        return name.replace("LayerNorm", "emb_norm")
    if key == "encoder.relative_attention_bias.weight":
        return "relative_attention_bias.weight"
    for root in _LAYER_ROOTS:
        if key.startswith(root):
            idx, rest = key[len(root):].split(".", 1)
            for src, dst in _LAYER_KEYS[family].items():
                if rest.startswith(src + "."):
                    return f"layers.{idx}.{dst}.{rest[len(src) + 1:]}"
    if key.startswith(("pooler.", "lm_head.", "cls.", "vocab_", "classifier.", "pre_classifier.")):
        return None  # heads: sentence embeddings pool the hidden states themselves
    raise UnsupportedModel(f"unexpected tensor {key!r} in a {family} checkpoint")


def _is_rotary(model_dir: Path) -> bool:
    try:
        return json.loads((model_dir / "config.json").read_text()).get("model_type") in ROTARY_FAMILIES
    except (OSError, ValueError, AttributeError):
        return False  # EncoderConfig.from_json names what is wrong with the file


_QKV = ("query", "key", "value")


def _checkpoint_names(name: str) -> tuple[str, ...]:
    """The renamed checkpoint tensors an Encoder parameter is built from: a layer's stacked `qkv`
    from its `query`, `key` and `value`, any other from the tensor of its own name."""
    layer, dot, rest = name.partition(".qkv.")
    return tuple(f"{layer}.{part}.{rest}" for part in _QKV) if dot else (name,)


def _stack_qkv(state: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    """`state` (renamed checkpoint tensors) with each layer's query, key and value weights and biases
    stacked into its `qkv` projection, in that order."""
    out: dict[str, torch.Tensor] = {}
    stacked: set[str] = set()
    for key, tensor in state.items():
        bits = key.split(".")  # layers.<i>.<name>.<weight|bias>
        if len(bits) == 4 and bits[0] == "layers" and bits[2] in _QKV:
            stacked.add(f"layers.{bits[1]}.qkv.{bits[3]}")
        else:
            out[key] = tensor
    for name in sorted(stacked):
        parts = _checkpoint_names(name)
        absent = [p for p in parts if p not in state]
        if absent:
            raise UnsupportedModel(f"{where}: checkpoint lacks the attention tensor {absent[0]!r} beside "
                                   f"{', '.join(p for p in parts if p in state)}")
        out[name] = torch.cat([state[p] for p in parts])
    return out


def load_encoder(model_dir: Path) -> nn.Module:
    """Build the encoder from `config.json` + safetensors (one file or shards; no pickle is ever loaded)."""
    model_dir = Path(model_dir)
    if _is_rotary(model_dir):
        from servekit.optimizations.models.rotary_encoder import load_rotary_encoder
        return load_rotary_encoder(model_dir)
    cfg = EncoderConfig.from_json(model_dir / "config.json")
    with torch.device("meta"):
        model = Encoder(cfg)
    state = {}
    for key, tensor in load_safetensors(model_dir).items():
        name = _rename(key, cfg.family)
        if name is not None:
            state[name] = tensor.float()
    state = _stack_qkv(state, model_dir)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {len(missing)} tensors of a {cfg.family} encoder "
                               f"(first: {missing[0]})")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def check_checkpoint(model_dir: Path) -> "EncoderConfig | RotaryEncoderConfig":
    """Check without loading any tensor data that `model_dir` holds an encoder servekit serves:
    a supported config and safetensors whose tensors are exactly those the encoder needs."""
    from servekit.optimizations.models.weights import tensor_names

    model_dir = Path(model_dir)
    if _is_rotary(model_dir):
        from servekit.optimizations.models.rotary_encoder import check_rotary_checkpoint
        return check_rotary_checkpoint(model_dir)
    cfg = EncoderConfig.from_json(model_dir / "config.json")
    names = tensor_names(model_dir, lambda k: _rename(k, cfg.family))
    with torch.device("meta"):
        expected = {n for name in Encoder(cfg).state_dict() for n in _checkpoint_names(name)}
    missing = sorted(expected - names)
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {len(missing)} tensors of a {cfg.family} encoder "
                               f"(first: {missing[0]})")
    return cfg
