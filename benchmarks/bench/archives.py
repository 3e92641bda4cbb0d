"""The archive specs a sweep can name (the bundled models plus the benchmark's own stock baseline
and sleep test handler) and building of variant archives: one base model + model-config/plan overrides (+ speculator heads)
-> one `.mar`."""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import yaml

from servekit.archive import OTHER, SPECS, ArchiveSpec, build_archive, handler_file, minilm_weights, plan_parser
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
    """The model-config a variant archive is built with (base config + overrides + plan overrides)."""
    if model not in BENCH_SPECS:
        raise ValueError(f"unknown archive model {model!r}; known: {', '.join(sorted(BENCH_SPECS))}")
    path = Path(config) if config else BENCH_SPECS[model].config
    base = yaml.safe_load(path.read_text()) or {}
    merged = deep_merge(base, overrides)
    if plan:
        merged["servekit"] = deep_merge(merged.get("servekit") or {}, plan)
    return merged


def model_plan_parser(model: str) -> Callable[[Any, str], Any] | None:
    """The validator of the `servekit:` section that `model`'s handler reads, None for none."""
    return plan_parser(BENCH_SPECS[model].kind)


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
                  spec=BENCH_SPECS[model])
    stamp.write_text(digest)
    return mar
