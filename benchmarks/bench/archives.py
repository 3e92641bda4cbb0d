"""The models a sweep can name (the bundled ones, the benchmark's own stock baseline and sleep test
handler, or any model folder that `servekit archive PATH` takes) and building of variant archives:
one base model + model-config/plan overrides (+ speculator heads) -> one `.mar`."""
from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import yaml

from servekit.archive import (KIND_HANDLERS, OTHER, SPECS, ArchiveSpec, build_archive, default_device, handler_file,
                              minilm_weights, plan_parser)
from servekit.resources import package_dir


def stock_minilm_weights() -> list[Path]:
    """Everything transformers' AutoModel/AutoTokenizer need from the all-MiniLM-L6-v2 folder."""
    d = minilm_weights()[0].parent
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
             "special_tokens_map.json"]
    return [d / n for n in names if (d / n).exists()]


BENCH_SPECS: dict[str, ArchiveSpec] = {
    **SPECS,
    "minilm-stock": ArchiveSpec(OTHER, handler_file("servekit.benchmarks.stock_handler"),
                                package_dir("servekit.benchmarks.bench") / "stock-minilm.yaml", stock_minilm_weights),
    "sleep": ArchiveSpec(OTHER, handler_file("servekit.benchmarks.test_handlers.sleep_handler"),
                         package_dir("servekit.benchmarks.test_handlers") / "sleep.yaml", lambda: []),
}


@functools.lru_cache(maxsize=None)
def _folder_model(path: str) -> tuple[ArchiveSpec, dict[str, Any]]:
    """A model folder's archive spec and the model-config `servekit archive PATH` would generate
    for this machine's device (ValueError / FileNotFoundError naming what cannot be served)."""
    from servekit.model_source import generated_config, model_source

    source = model_source(Path(path))
    _, cfg = generated_config(source, default_device(), path)
    # `config` is never read: variants are built from their merged model-config.
    return ArchiveSpec(source.kind, handler_file(KIND_HANDLERS[source.kind]), Path(path), lambda: source.files), cfg


def model_spec(model: str) -> ArchiveSpec:
    """The archive spec of a sweep's `model`: a bundled name, or a model folder's path."""
    return BENCH_SPECS[model] if model in BENCH_SPECS else _folder_model(model)[0]


def model_folder(model: str) -> Path | None:
    """The folder of a `model` given as a path (None for a bundled name)."""
    return None if model in BENCH_SPECS else Path(model)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# Keys the benchmark sets per point through the management API. TorchServe 0.12 lets a
# model-config's batchSize/maxBatchDelay/minWorkers/maxWorkers win over the register call's
# parameters, so variant archives are built without them.
FRONTEND_SWEPT = ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers")


def variant_config(model: str, config: Path | None, overrides: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The model-config a variant archive is built with (base config + overrides + plan overrides);
    the base of a model folder without `config` is the one `servekit archive PATH` generates."""
    if config:
        base = yaml.safe_load(Path(config).read_text()) or {}
    elif model in BENCH_SPECS:
        base = yaml.safe_load(BENCH_SPECS[model].config.read_text()) or {}
    else:
        base = _folder_model(model)[1]
    merged = deep_merge(base, overrides)
    if plan:
        merged["servekit"] = deep_merge(merged.get("servekit") or {}, plan)
    return merged


def model_plan_parser(model: str) -> Callable[[Any, str], Any] | None:
    """The validator of the `servekit:` section that `model`'s handler reads, None for none."""
    return plan_parser(model_spec(model).kind)


def speculator_stamp(speculator: Path) -> list[Any]:
    """What identifies a heads folder's content for the rebuild check: retrained heads rebuild."""
    files = sorted(f for f in Path(speculator).iterdir() if f.is_file())
    return [str(speculator)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def build_variant(model: str, name: str, cfg: dict[str, Any], out_dir: Path, work_dir: Path,
                  speculator: Path | None = None) -> Path:
    """Build `<out_dir>/<name>.mar` from `cfg` (and speculator heads) unless an identical build is there."""
    for key in FRONTEND_SWEPT:
        cfg.pop(key, None)
    text = yaml.safe_dump(cfg, sort_keys=False)
    key: list[Any] = [model, text] + ([speculator_stamp(speculator)] if speculator is not None else [])
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    work_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = work_dir / f"{name}.yaml"
    cfg_path.write_text(text)
    mar = Path(out_dir) / f"{name}.mar"
    stamp = Path(out_dir) / f".{name}.mar.sha"
    if mar.exists() and stamp.exists() and stamp.read_text() == digest:
        return mar
    # A benchmark's own archive: uncompressed builds and unpacks in seconds.
    build_archive(model, Path(out_dir), config=cfg_path, archive_name=name, speculator=speculator, compress=False,
                  spec=model_spec(model))
    stamp.write_text(digest)
    return mar
