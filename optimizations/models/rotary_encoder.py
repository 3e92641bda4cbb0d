"""Rotary encoders for sentence embeddings: ModernBERT and Nomic BERT, from safetensors.

Written out like `encoder.py`'s post-LayerNorm encoders so that the forward pass is one small
static-shape function. Neither has a position table: rotary embeddings turn queries and keys
(half-split as GPT-NeoX does, or interleaved pairs where the config says so).

ModernBERT (transformers' ModernBertConfig):
- pre-norm blocks (the first layer's attention input is the embeddings' norm itself), a final
  norm, LayerNorms and linears without biases unless the config asks for them;
- a GeGLU MLP: one `Wi` projection split into an activated half and a gate half;
- global attention every `global_attn_every_n_layers` layers and a sliding window elsewhere (a
  token sees keys at most `local_attention // 2` positions away on either side), each kind with
  its own rotary base.

Nomic BERT (nomic-embed-text; its `NomicBertConfig` is GPT-2's field names plus rotary settings):
- BERT's post-norm blocks and embeddings LayerNorm, token type 0 added, no final norm;
- a gated MLP from two projections, `fc2(fc11(x) * act(fc12(x)))` (SwiGLU: act = SiLU);
- every layer global, one rotary base over `rotary_emb_fraction` of each head.

Unpadded execution (the default, as ModernBERT's reference implementation runs): the padded batch's
real tokens are gathered into one packed sequence (total_tokens, hidden), each with its own
position in its text; embeddings, norms, the q/k/v/o projections, rotary and the MLPs run on those
tokens only, and the output is scattered back to the (batch, seq, hidden) layout the pooling heads
read (zeros at padding). Attention is the one step that goes back to rows: see `Packing`.

Padded execution (`forward_padded`) is what a compiled or CUDA-graph-captured plan traces: the
packed length depends on the mask's values, and captured graphs and compiled buckets need shapes
fixed by the bucket alone, so there every (batch, seq) position is computed. Rows are right-padded,
so a real token's position is its index and its keys never include a padded one (the padding bias);
what a padded position computes is never pooled. Both paths give the same real-token states.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from servekit.optimizations.models.errors import UnsupportedModel
from servekit.optimizations.models.weights import embedding, load_safetensors

ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu}
# Nomic BERT's activation_function -> the gate's activation (its gated MLPs; the plain ones are refused).
NOMIC_GATES = {"swiglu": "silu", "geglu": "gelu", "glu": "sigmoid"}
ACTIVATIONS["sigmoid"] = torch.sigmoid
FAMILIES = ("modernbert", "nomic_bert")
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
    mlp_bias: bool = False                # ModernBERT's Wi and Wo; Nomic BERT's fc11/fc12
    mlp_out_bias: bool = False            # Nomic BERT's fc2 (ModernBERT: mlp_bias)
    pad_token_id: int = 0
    rotary_dim: int = 0                   # rotated dims of each head; 0: all
    interleaved: bool = False             # rotate (even, odd) pairs instead of the two halves
    type_vocab_size: int = 0              # Nomic BERT adds token type 0's embedding

    @property
    def max_tokens(self) -> int:
        """The longest sequence the model was configured for (rotary has no table to run out of)."""
        return self.max_position_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotated(self) -> int:
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_json(cls, path: Path) -> "RotaryEncoderConfig":
        try:
            return cls._from_json(path)
        except KeyError as e:
            raise UnsupportedModel(f"{path}: {e.args[0]!r} is missing") from None

    @classmethod
    def _from_json(cls, path: Path) -> "RotaryEncoderConfig":
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type") == "nomic_bert":
            return _nomic_config(raw, path)
        if raw.get("model_type") != "modernbert":
            raise UnsupportedModel(f"{path}: model_type {raw.get('model_type')!r} is not a rotary encoder servekit "
                                   f"serves ({', '.join(FAMILIES)})")
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
                   mlp_bias=bool(raw.get("mlp_bias", False)), mlp_out_bias=bool(raw.get("mlp_bias", False)),
                   pad_token_id=int(raw["pad_token_id"] if raw.get("pad_token_id") is not None else 0))


def _nomic_config(raw: dict, path: Path) -> RotaryEncoderConfig:
    """NomicBertConfig (GPT2Config's fields and defaults plus Nomic's) as the published modelling code reads it."""
    refused = {"prenorm": "pre-norm blocks", "parallel_block": "parallel blocks", "use_rms_norm": "RMSNorm",
               "causal": "causal attention", "rotary_emb_scale_base": "xPos rotary scaling"}
    for key, what in refused.items():
        if raw.get(key):
            raise UnsupportedModel(f"{path}: {key}={raw[key]!r} ({what}) is not supported; servekit serves "
                                   "nomic-embed-text's post-norm rotary blocks")
    fraction = float(raw.get("rotary_emb_fraction", 0.0))
    if not 0.0 < fraction <= 1.0:
        raise UnsupportedModel(f"{path}: rotary_emb_fraction {fraction} is not supported (learnt positions are not "
                               "built for nomic_bert; 0 < fraction <= 1)")
    act = raw.get("activation_function", "gelu_new")
    if act not in NOMIC_GATES:
        raise UnsupportedModel(f"{path}: activation_function {act!r} is not supported; gated MLPs: "
                               f"{', '.join(NOMIC_GATES)}")
    h, heads = int(raw["n_embd"]), int(raw["n_head"])
    if h % heads:
        raise UnsupportedModel(f"{path}: n_embd {h} is not a multiple of n_head {heads}")
    head_dim = h // heads
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2:
        raise UnsupportedModel(f"{path}: rotary_emb_fraction {fraction} rotates an odd number of dims ({rotary_dim})")
    # The published code rounds the gated MLP's width up to a multiple of 256 and the vocabulary
    # up to pad_vocab_size_multiple; the checkpoint's tensors have those shapes.
    inner = int(raw.get("n_inner") or int(8 * h / 3))
    inner = (inner + 255) // 256 * 256
    vocab, multiple = int(raw["vocab_size"]), int(raw.get("pad_vocab_size_multiple", 1))
    vocab += -vocab % multiple
    positions = int(raw.get("n_positions", 1024))
    if raw.get("rotary_scaling_factor"):
        # Dynamic NTK scaling changes the rotary base only past max_trained_positions: not built,
        # so such a model is served up to there.
        positions = min(positions, int(raw.get("max_trained_positions", 2048)))
    n = int(raw["n_layer"])
    theta = float(raw.get("rotary_emb_base", 10000.0))
    return RotaryEncoderConfig(
        family="nomic_bert", vocab_size=vocab, hidden_size=h, num_hidden_layers=n, num_attention_heads=heads,
        intermediate_size=inner, max_position_embeddings=positions, layer_types=(GLOBAL,) * n,
        rope_theta={GLOBAL: theta}, window=0, norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        hidden_act=NOMIC_GATES[act], norm_bias=True, attention_bias=bool(raw.get("qkv_proj_bias", True)),
        mlp_bias=bool(raw.get("mlp_fc1_bias", True)), mlp_out_bias=bool(raw.get("mlp_fc2_bias", True)),
        pad_token_id=int(raw["pad_token_id"] if raw.get("pad_token_id") is not None else 0),
        rotary_dim=rotary_dim, interleaved=bool(raw.get("rotary_emb_interleaved", False)),
        type_vocab_size=int(raw.get("type_vocab_size", 2)))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding on the first cos.shape[-1] dims of the last one: each pair (a, b), the two
    halves or (even, odd) neighbours, becomes (a cos - b sin, b cos + a sin); the rest pass through."""
    d = cos.shape[-1]
    r = x[..., :d].float()
    if interleaved:
        turned = torch.stack((-r[..., 1::2], r[..., ::2]), dim=-1).flatten(-2)
    else:
        a, b = r.chunk(2, dim=-1)
        turned = torch.cat((-b, a), dim=-1)
    return torch.cat(((r * cos + turned * sin).to(x.dtype), x[..., d:]), dim=-1)


class Packing:
    """Where a right-padded (batch, seq) batch's real tokens are, for the unpadded path.

    Attention runs per text over its own keys in the (batch, seq) layout: the packed q, k and v are
    scattered into zero-filled rows and torch SDPA takes the padding (and sliding-window) bias, so
    each text's scores are its own seq x seq tile, the diagonal blocks of a block-diagonal mask over
    the packed sequence. Chosen because it runs the same on CPU and CUDA with torch 2.11-2.13 at
    batch x seq^2 scores: a block-diagonal mask over the whole packed sequence makes SDPA score
    total_tokens^2 pairs (batch times more for equal lengths); FlexAttention's document mask skips
    those blocks but only when compiled (eager, it materialises every score), and eager plans are
    the ones that run unpadded; torch's varlen attention is CUDA-only. The padded query rows that
    SDPA also scores are dropped before the output projection.
    """

    def __init__(self, attention_mask: torch.Tensor) -> None:
        self.batch, self.seq = attention_mask.shape
        # Row-major flat positions of the real tokens: each text's tokens in order, texts in order.
        self.index = attention_mask.reshape(-1).nonzero().squeeze(1)
        # A right-padded row's real tokens sit at their own positions in their text.
        self.positions = self.index % self.seq

    @property
    def tokens(self) -> int:
        return self.index.numel()

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, ...) -> (tokens, ...): the real tokens only."""
        return x.reshape(self.batch * self.seq, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) -> (batch, seq, ...), zeros at padding."""
        out = x.new_zeros(self.batch * self.seq, *x.shape[1:]).index_copy_(0, self.index, x)
        return out.view(self.batch, self.seq, *x.shape[1:])


class RotaryAttention(nn.Module):
    def __init__(self, cfg: RotaryEncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads, self.interleaved = cfg.num_attention_heads, cfg.interleaved
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(h, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                packing: Packing | None = None) -> torch.Tensor:
        """x: (batch, seq, hidden), or (tokens, hidden) with its `packing`; cos and sin per position
        of x's leading dims, broadcast over heads."""
        h = x.shape[-1]
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_heads, h // self.n_heads)).unbind(-3)
        q, k = rotate(q, cos, sin, self.interleaved), rotate(k, cos, sin, self.interleaved)
        if packing is not None:
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=bias).transpose(1, 2)
        if packing is not None:
            a = packing.pack(a)
        return self.attn_out(a.flatten(-2))


class ModernBertLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + GeGLU(norm(x)) from one split projection."""

    def __init__(self, cfg: RotaryEncoderConfig, first: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        # The first layer attends to the embeddings' norm directly: no second norm there.
        self.attn_norm = nn.Identity() if first else nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.attn = RotaryAttention(cfg)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp_in = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp_out = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_out_bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                packing: Packing | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias, cos, sin, packing)
        value, gate = self.mlp_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_out(self.act(value) * gate)


class NomicBertLayer(nn.Module):
    """Post-norm: norm(x + attn(x)), then norm(x + fc2(fc11(x) * act(fc12(x))))."""

    def __init__(self, cfg: RotaryEncoderConfig, first: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.attn = RotaryAttention(cfg)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.mlp_value = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp_gate = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp_out = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_out_bias)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                packing: Packing | None = None) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, bias, cos, sin, packing))
        return self.mlp_norm(x + self.mlp_out(self.mlp_value(x) * self.act(self.mlp_gate(x))))


class RotaryEncoder(nn.Module):
    """Token ids + right-padded attention mask -> last hidden states (batch, seq, hidden)."""

    def __init__(self, cfg: RotaryEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.type_vocab_size:
            self.token_type_embeddings = embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.emb_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        layer = ModernBertLayer if cfg.family == "modernbert" else NomicBertLayer
        self.layers = nn.ModuleList(layer(cfg, i == 0) for i in range(cfg.num_hidden_layers))
        self.final_norm = (nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
                           if cfg.family == "modernbert" else nn.Identity())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Unpadded unless the pass is being compiled or captured into a CUDA graph: those need
        shapes that the bucket alone fixes, and the packed length depends on the mask's values
        (reading it back is a host sync, which capture forbids)."""
        # is_compiling() first: dynamo cannot trace is_current_stream_capturing() (it returns a bool),
        # and while compiling the short-circuit keeps it from being traced at all.
        if torch.compiler.is_compiling() or (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.forward_padded(input_ids, attention_mask, token_type_ids)
        return self.forward_unpadded(input_ids, attention_mask, token_type_ids)

    def forward_unpadded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Every position-wise step on the real tokens only; (batch, seq, hidden) out, zeros at padding."""
        packing = Packing(attention_mask)
        ids = packing.pack(input_ids)
        types = None if token_type_ids is None else packing.pack(token_type_ids)
        x = self._embed(ids, types)
        biases = self._biases(attention_mask, x.dtype)
        rotary = self._rotary(packing.positions)
        for layer, kind in zip(self.layers, self.cfg.layer_types):
            x = layer(x, biases[kind], *rotary[kind], packing)
        return packing.unpack(self.final_norm(x))

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Every (batch, seq) position computed; the padding bias keeps padded keys out."""
        x = self._embed(input_ids, token_type_ids)
        biases = self._biases(attention_mask, x.dtype)
        rotary = self._rotary(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer, kind in zip(self.layers, self.cfg.layer_types):
            x = layer(x, biases[kind], *rotary[kind])
        return self.final_norm(x)

    def _embed(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if self.cfg.type_vocab_size:
            x = x + (self.token_type_embeddings.weight[0] if token_type_ids is None
                     else self.token_type_embeddings(token_type_ids))
        return self.emb_norm(x)

    def _biases(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Additive attention bias per layer type over (batch, 1, seq, seq) scores: padded keys out,
        and for sliding layers keys farther than the window."""
        neg = torch.finfo(dtype).min
        padding = (1.0 - attention_mask[:, None, None, :].to(dtype)) * neg
        biases = {GLOBAL: padding}
        if LOCAL in self.cfg.layer_types:
            pos = torch.arange(attention_mask.shape[1], device=attention_mask.device)
            far = (pos[None, :] - pos[:, None]).abs() > self.cfg.window
            biases[LOCAL] = padding.masked_fill(far, neg)
        return biases

    def _rotary(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) per layer type, shaped (positions, 1, rotated) to broadcast over heads.

        Angles in fp32 from the config's constants, computed here rather than kept in a buffer
        that a bf16 or fp16 plan's `.to(dtype)` would round."""
        d = self.cfg.rotated
        dims = torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d
        rotary = {}
        for kind in set(self.cfg.layer_types):
            freqs = positions[:, None].float() * self.cfg.rope_theta[kind] ** -dims
            emb = freqs.repeat_interleave(2, dim=-1) if self.cfg.interleaved else torch.cat((freqs, freqs), dim=-1)
            rotary[kind] = (emb.cos()[:, None, :], emb.sin()[:, None, :])
        return rotary


# Checkpoint tensor name -> our parameter name, per family: (prefixes stripped, heads dropped,
# embedding and final names, per-layer root, per-layer names).
_MODERNBERT = (("model.",), ("head.", "decoder.", "classifier.", "dense."),
               {"embeddings.tok_embeddings.": "word_embeddings.", "embeddings.norm.": "emb_norm.",
                "final_norm.": "final_norm."},
               "layers.",
               {"attn_norm.": "attn_norm.", "attn.Wqkv.": "attn.qkv.", "attn.Wo.": "attn.attn_out.",
                "mlp_norm.": "mlp_norm.", "mlp.Wi.": "mlp_in.", "mlp.Wo.": "mlp_out."})
_NOMIC = (("bert.", "model."), ("pooler.", "cls.", "classifier.", "lm_head."),
          {"embeddings.word_embeddings.": "word_embeddings.",
           "embeddings.token_type_embeddings.": "token_type_embeddings.", "emb_ln.": "emb_norm."},
          "encoder.layers.",
          {"attn.Wqkv.": "attn.qkv.", "attn.out_proj.": "attn.attn_out.", "norm1.": "attn_norm.",
           "mlp.fc11.": "mlp_value.", "mlp.fc12.": "mlp_gate.", "mlp.fc2.": "mlp_out.", "norm2.": "mlp_norm."})
_NAMES = {"modernbert": _MODERNBERT, "nomic_bert": _NOMIC}


def _rename(key: str, family: str) -> str | None:
    prefixes, heads, top, root, per_layer = _NAMES[family]
    for prefix in prefixes:
        key = key.removeprefix(prefix)
    if key.startswith(heads):
        return None  # MLM and classification heads: sentence embeddings pool the hidden states themselves
    for src, dst in top.items():
        if key.startswith(src):
            return dst + key[len(src):]
    if key.startswith(root):
        idx, rest = key[len(root):].split(".", 1)
        for src, dst in per_layer.items():
            if rest.startswith(src):
                return f"layers.{idx}.{dst}{rest[len(src):]}"
    raise UnsupportedModel(f"unexpected tensor {key!r} in a {family} checkpoint")


def _expected(cfg: RotaryEncoderConfig) -> set[str]:
    with torch.device("meta"):
        return set(RotaryEncoder(cfg).state_dict())


def load_rotary_encoder(model_dir: Path) -> RotaryEncoder:
    """Build the encoder from `config.json` + safetensors (one file or shards; no pickle is ever loaded)."""
    model_dir = Path(model_dir)
    cfg = RotaryEncoderConfig.from_json(model_dir / "config.json")
    state = {}
    for key, tensor in load_safetensors(model_dir).items():
        name = _rename(key, cfg.family)
        if name is not None:
            state[name] = tensor.float()
    missing = sorted(_expected(cfg) - set(state))
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {len(missing)} tensors of a {cfg.family} encoder "
                               f"(first: {missing[0]})")
    model = RotaryEncoder(cfg)
    for name, param in model.state_dict().items():
        if state[name].shape != param.shape:
            raise UnsupportedModel(f"{model_dir}: tensor {name} has shape {tuple(state[name].shape)}, the config "
                                   f"implies {tuple(param.shape)}")
    model.load_state_dict(state, strict=True)
    return model.eval()


def check_rotary_checkpoint(model_dir: Path) -> RotaryEncoderConfig:
    """Check without loading tensor data that `model_dir` holds exactly the tensors the encoder needs."""
    from servekit.optimizations.models.weights import tensor_names

    model_dir = Path(model_dir)
    cfg = RotaryEncoderConfig.from_json(model_dir / "config.json")
    names = tensor_names(model_dir, lambda k: _rename(k, cfg.family))
    missing = sorted(_expected(cfg) - names)
    if missing:
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {len(missing)} tensors of a {cfg.family} encoder "
                               f"(first: {missing[0]})")
    return cfg
