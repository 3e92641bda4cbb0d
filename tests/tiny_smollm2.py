"""A tiny random Llama in SmolLM2-135M-Instruct's format, for the live LLM tests that assert protocol
and engine behaviour rather than SmolLM2's answers.

The folder holds the same files as `smollm2_archive_files(torch.bfloat16)`: SmolLM2's own tokenizer,
chat template and generation config (copied), and a config.json + model.safetensors of the same
architecture with SmolLM2's vocabulary and special ids but 2 layers of width 64 and random weights
(a fixed seed: the same bytes every run). Served with SmolLM2's CPU plan, a step costs a fraction
of the real model's, so the tests' greedy texts, streams, joins and cancellations take seconds.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

# Width and depth only: everything else (vocabulary, bos/eos/pad ids, RoPE base, tied embeddings,
# context) stays SmolLM2's.
TINY_SHAPE = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128)
WEIGHTS, CONFIG = "model.safetensors", "config.json"


def write_tiny_smollm2(out: Path, seed: int = 0) -> list[Path]:
    """Write the tiny checkpoint into the folder `out`; returns its files in the order
    `smollm2_archive_files` lists SmolLM2's (what `build_archive(weights=...)` takes)."""
    import json

    from safetensors.torch import save_file

    from servekit.optimizations.models.gguf_weights import smollm2_archive_files
    from servekit.optimizations.models.llama import init_random, load_config, ours_to_hf

    real = smollm2_archive_files(torch.bfloat16)
    config = dataclasses.replace(load_config(real[0].parent), **TINY_SHAPE)
    model = init_random(config, seed=seed, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    # Hugging Face names, the tied output projection stored once (as the embedding), as SmolLM2's.
    save_file({ours_to_hf(k, config): v.contiguous() for k, v in model.state_dict().items() if k != "output.weight"},
              str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config.to_hf(torch.bfloat16), indent=2) + "\n")
    for f in real:
        if f.name not in (WEIGHTS, CONFIG):
            shutil.copy2(f, out / f.name)
    return [out / f.name for f in real]


def tiny_smollm2_files(folder: Path) -> list[Path]:
    """The files of a folder `write_tiny_smollm2` wrote, in its order."""
    from servekit.optimizations.models.gguf_weights import ARCHIVE_FILES

    return [folder / name for name in ARCHIVE_FILES if (folder / name).exists()]
