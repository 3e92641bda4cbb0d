"""The device and dtype a plan runs on: one resolution for every model kind."""
from __future__ import annotations

import torch

from servekit.optimizations.plan import PlanError

# Plan precision -> torch dtype (quantized plans keep their activations in these too).
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def pick_device(requested: str) -> torch.device:
    """The device for a plan's `device` key (auto, cpu, cuda); PlanError when CUDA is asked for
    and absent."""
    cuda = torch.cuda.is_available()
    if requested == "auto":
        return torch.device("cuda" if cuda else "cpu")
    if requested == "cuda" and not cuda:
        raise PlanError("servekit.device: cuda requested but no CUDA device is available")
    return torch.device(requested)


def capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability of `device`, None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None
