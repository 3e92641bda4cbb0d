"""Scaffolding shared by the auto-benchmark's end-to-end tests: the session's TorchServe as a remote
target, and one `servekit bench` run of a sweep written to YAML."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from servekit.benchmarks.bench.runner import main
from servekit.torchserve import TorchServe


def remote_target(ts: TorchServe, model_store: Path) -> dict[str, Any]:
    """The sweep's `target:` for a live TorchServe given by URLs (register/scale/unregister through them)."""
    return {"remote": {"inference_url": ts.inference_url, "management_url": ts.management_url,
                       "metrics_url": ts.metrics_url, "model_store": str(model_store)},
            "ready_timeout_s": 180}


def run_sweep(sweep: dict[str, Any], tmp_path: Path) -> tuple[int, Path, dict[str, Any]]:
    """Write `sweep` as YAML, run it; returns the exit code, the run folder and its results.json."""
    path = tmp_path / f"{sweep['name']}.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "run"
    rc = main([str(path), "--out", str(out)])
    return rc, out, json.loads((out / "results.json").read_text())
