"""Weight quantization through torchao's Config API (`quantize_(model, Config())`)."""
from __future__ import annotations

from torch import nn


def quantize(model: nn.Module, method: str) -> nn.Module:
    """Quantize the model's Linear layers in place with torchao; `method` is a plan value."""
    if method == "none":
        return model
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    configs = {
        "int8_weight_only": Int8WeightOnlyConfig,
        "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "int4_weight_only": Int4WeightOnlyConfig,
        "float8_dynamic": Float8DynamicActivationFloat8WeightConfig,
    }
    if method not in configs:
        raise ValueError(f"unknown quantization {method!r}")
    quantize_(model, configs[method]())
    return model
