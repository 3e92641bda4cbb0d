"""Sentence pooling and the modules after it (Dense, Normalize), as sentence-transformers computes
them, written as static-shape tensor code so that they are compiled and captured with the encoder."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from servekit.optimizations.models.sentence_model import DenseSpec, SentenceModel

_ACTIVATIONS = {"Tanh": nn.Tanh, "Identity": nn.Identity, "ReLU": nn.ReLU, "GELU": nn.GELU, "Sigmoid": nn.Sigmoid}


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One pooling mode over right-padded rows (mask: 1 for real tokens), in float32."""
    h = hidden.float()
    m = mask.unsqueeze(-1).to(h.dtype)
    if mode == "cls":
        return h[:, 0]
    if mode == "max":
        return h.masked_fill(m == 0, float("-inf")).max(dim=1).values
    if mode in ("mean", "mean_sqrt_len_tokens"):
        count = m.sum(dim=1).clamp(min=1e-9)
        return (h * m).sum(dim=1) / (count if mode == "mean" else count.sqrt())
    if mode == "weightedmean":
        w = m * torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        return (h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9)
    if mode == "lasttoken":
        # The last attended token of each row: right padding puts it at length - 1.
        last = (mask.sum(dim=1) - 1).clamp(min=0)
        return h[torch.arange(h.shape[0], device=h.device), last]
    raise ValueError(f"unknown pooling mode {mode!r}")


class SentenceHead(nn.Module):
    """Hidden states + mask -> sentence embedding: pooling modes (concatenated), Dense layers, Normalize."""

    def __init__(self, model_dir: Path, spec: SentenceModel) -> None:
        super().__init__()
        self.modes = spec.pooling
        self.steps = nn.ModuleList()
        for step in spec.head:
            if step == "normalize":
                self.steps.append(_Normalize())
            else:
                self.steps.append(_dense(Path(model_dir), step))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.cat([pool(hidden, mask, mode) for mode in self.modes], dim=-1)
        for step in self.steps:
            x = step(x)
        return x.float()


class _Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x.float(), p=2, dim=-1)


class _Dense(nn.Module):
    def __init__(self, spec: DenseSpec) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = _ACTIVATIONS[spec.activation.rsplit(".", 1)[1]]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x.to(self.linear.weight.dtype)))


def _dense(model_dir: Path, spec: DenseSpec) -> _Dense:
    layer = _Dense(spec)
    state = load_file(str(model_dir / spec.path / "model.safetensors"))
    layer.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return layer
