"""The benchmark YAML: shipped files validate, mistakes fail with the key's path."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from benchmarks.bench.schema import SchemaError, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted((ROOT / "benchmarks" / "sweeps").glob("*.yaml"))

BASE = {
    "name": "t",
    "target": {"local": {}},
    "variants": [{"name": "stock", "model": "minilm-stock", "baseline": True,
                  "sweep": {"workers": [1], "batch_size": [1]}},
                 {"name": "fast", "model": "minilm", "plan": {"precision": "fp32"}}],
    "sweep": {"workers": [1, 2], "batch_size": [1, 8]},
    "payloads": {"body": {"text": "hi"}},
    "sla": {"p99_ms": 50},
}


def with_(path: str, value, base=BASE) -> dict:
    raw = copy.deepcopy(base)
    node = raw
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
    node[keys[-1]] = value
    return raw


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_shipped_sweeps_validate(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.variants and cfg.sla.p99_ms > 0
    assert cfg.baseline is not None, "every shipped sweep compares against a stock baseline"


def test_defaults_and_variant_axes() -> None:
    cfg = parse_config(BASE)
    assert cfg.load.mode == "open" and cfg.load.arrival == "poisson" and cfg.load.search.start is None
    assert cfg.measurement.tolerance == 0.10 and cfg.measurement.stable_windows == 3
    stock, fast = cfg.variants
    assert stock.axes.workers == (1,) and stock.axes.batch_size == (1,)
    assert fast.axes.workers == (1, 2) and fast.axes.batch_size == (1, 8)
    assert cfg.baseline is stock


@pytest.mark.parametrize("path, value, message", [
    ("sweep.batch_size", [1, 8, 0], "sweep.batch_size[2]: expected a positive integer, got 0"),
    ("sweep.workers", [1, "two"], "sweep.workers[1]: expected a positive integer"),
    ("sweep.max_batch_delay_ms", [-1], "sweep.max_batch_delay_ms[0]: expected a non-negative integer"),
    ("sweep.batch_sizes", [1], "sweep.batch_sizes: unknown key"),
    ("sla.p99_ms", -5, "sla.p99_ms: expected a positive number"),
    ("sla.max_error_rate", 1.5, "sla.max_error_rate: expected a number in [0, 1)"),
    ("sla.p50_ms", 80, "sla.p50_ms: 80.0 is above sla.p99_ms"),
    ("load.mode", "burst", "load.mode: 'burst' is not one of open, closed"),
    ("load.levels", [10, 5], "load.levels: values must be strictly increasing"),
    ("load.search", {"growth": 1.0}, "load.search.growth: expected a number > 1"),
    ("load.search", {"precison": 0.1}, "load.search.precison: unknown key"),
    ("measurement.max_trials", 2, "measurement.max_trials: 2 is fewer than stable_windows"),
    ("measurement.tolerance", 0, "measurement.tolerance: expected a number in (0, 1)"),
    ("variants.1.plan", {"precision": "fp12"}, "variants[1].plan.precision: 'fp12' is not one of"),
    ("variants.1.model", "nope", "variants[1].model: unknown archive model 'nope'"),
    ("variants.1.name", "stock", "variants[1].name: duplicate variant name 'stock'"),
    ("variants.1.name", "bad name", "variants[1].name: 'bad name' must be"),
    ("variants.1.overrides", {"batchSize": 4}, "variants[1].overrides.batchSize: set by the sweep"),
    ("variants.1.baseline", True, "variants: at most one variant may be `baseline: true`"),
    ("variants.0.sweep", {"workers": [0]}, "variants[0].sweep.workers[0]: expected a positive integer"),
    ("target", {"local": {}, "remote": {"inference_url": "http://x:1", "management_url": "http://x:2"}},
     "target: give exactly one of"),
    ("target", {"remote": {"inference_url": "localhost:8080", "management_url": "http://x:2"}},
     "target.remote.inference_url: expected an http(s):// URL"),
    ("target", {"remote": {"inference_url": "http://x:1", "management_url": "http://x:2"}},
     "variants[0].model: a remote target needs `target.remote.model_store`"),
    ("payloads", {"body": {}, "file": "x.jsonl"}, "payloads: give exactly one of"),
    ("payloads", {"file": "no/such/file.jsonl"}, "payloads.file: "),
    ("colour", "blue", "colour: unknown key"),
])
def test_errors_name_the_key(path: str, value, message: str) -> None:
    with pytest.raises(SchemaError) as e:
        parse_config(with_(path, value))
    assert message in str(e.value)


def test_missing_required_keys() -> None:
    raw = copy.deepcopy(BASE)
    del raw["sla"]
    with pytest.raises(SchemaError, match="sla: required"):
        parse_config(raw)
    with pytest.raises(SchemaError, match=r"sla.p99_ms: required"):
        parse_config(with_("sla", {"p50_ms": 10}))


def test_closed_loop_levels_are_integers() -> None:
    with pytest.raises(SchemaError, match=r"load.levels\[1\]: expected a positive integer"):
        parse_config(with_("load", {"mode": "closed", "levels": [1, 2.5]}))
    cfg = parse_config(with_("load", {"mode": "closed", "levels": [1, 4], "search": False}))
    assert cfg.load.levels == (1, 4) and not cfg.load.search.enabled


def test_invalid_yaml_file(tmp_path: Path) -> None:
    p = tmp_path / "b.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(SchemaError, match="not valid YAML"):
        load_config(p)
    p.write_text(yaml.safe_dump(with_("sweep.batch_size", [1, 8, 0])))
    from benchmarks.bench.runner import main
    assert main([str(p), "--check"]) == 2
