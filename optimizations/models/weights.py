"""Safetensors checkpoints as Hugging Face writes them: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Pickled checkpoints (`pytorch_model.bin`) are never read."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: the index and its shards, or the single file. FileNotFoundError names
    what is missing (a pickle-only checkpoint included)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise FileNotFoundError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir / missing[0]}: shard listed in {INDEX} is missing")
        return [index] + [model_dir / s for s in shards]
    single = model_dir / SINGLE
    if not single.is_file():
        pickles = [p.name for p in model_dir.glob("*.bin")]
        hint = f" (found {pickles[0]}: pickled weights are never loaded; convert them to safetensors)" if pickles else ""
        raise FileNotFoundError(f"{single}: no weights (neither {SINGLE} nor {INDEX}){hint}")
    return [single]


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `model_dir`, by name."""
    state: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        if f.name != INDEX:
            state.update(load_file(str(f)))
    return state


def tensor_names(model_dir: Path, rename: Callable[[str], str | None]) -> set[str]:
    """The checkpoint's tensor names as `rename` maps them (None drops one), read from the files'
    headers without loading tensor data; UnsupportedModel names a file that is not safetensors."""
    from safetensors import safe_open

    from servekit.optimizations.models.errors import UnsupportedModel

    names: set[str] = set()
    for f in safetensors_files(model_dir):
        if f.name == INDEX:
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                names.update(filter(None, map(rename, st.keys())))
        except UnsupportedModel:
            raise
        except Exception as e:
            raise UnsupportedModel(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return names


def embedding(num: int, dim: int) -> torch.nn.Embedding:
    """``nn.Embedding(num, dim)``, without its random init when built on the meta device (a model
    whose checkpoint is loaded next): there, the init's ``normal_`` goes through torch's reference
    implementations, whose first call imports torch's compiler stack (~2 s of CPU at every worker's
    start on the 2-core machine)."""
    if torch.get_default_device().type == "meta":
        return torch.nn.Embedding.from_pretrained(torch.empty(num, dim), freeze=False)
    return torch.nn.Embedding(num, dim)
