"""From a benchmark's recommendation to a kustomize overlay.

    python -m servekit.deploy.overlay recommendation.json --out k8s/overlays/minilm-h100
    kubectl apply -k k8s/overlays/minilm-h100

The recommendation is the auto-benchmark's choice for one model on one GPU type:

    {"model": "minilm", "workers": 1, "batch_size": 16, "max_batch_delay_ms": 5,
     "per_pod_capacity_rps": 850.0, "target_rps": 2000.0, "warmup_seconds": 95.0}

The overlay builds on k8s/overlays/gpu (or --base) and changes only what the benchmark measured:
- config.properties: the `model_snapshot` line (workers, batchSize, maxBatchDelay) the pod loads at start;
- the startup probe: twice the measured warm-up plus a minute, so a slower node or a cold compile
  cache does not kill a pod that is still capturing graphs;
- the HorizontalPodAutoscaler: minReplicas carries target_rps with every pod at `headroom` of its
  measured capacity; the requests-per-second target is that same fraction of the capacity; the
  in-flight target is one full batch per worker (workers x batch_size).
The Deployment gets no `replicas`: the HPA owns the count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

import yaml

from servekit.resources import resolve

# Project-relative: the folder in the current directory (a checkout, or `servekit init`'s copy),
# else the packaged manifests.
BASE_CONFIG = "k8s/base/config.properties"
GPU_OVERLAY = "k8s/overlays/gpu"
REQUIRED = {"model": str, "workers": int, "batch_size": int, "max_batch_delay_ms": (int, float),
            "per_pod_capacity_rps": (int, float), "target_rps": (int, float), "warmup_seconds": (int, float)}
PROBE_PERIOD_S = 10
# JVM start, registration and the first worker's process start before the warm-up itself.
STARTUP_OVERHEAD_S = 60


def check(rec: dict) -> dict:
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"recommendation lacks {', '.join(missing)} (needs {', '.join(REQUIRED)})")
    for key, kind in REQUIRED.items():
        if isinstance(rec[key], bool) or not isinstance(rec[key], kind):
            raise ValueError(f"recommendation[{key!r}] must be {getattr(kind, '__name__', 'a number')}, "
                             f"got {rec[key]!r}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", rec["model"]):
        raise ValueError(f"recommendation['model'] is not a TorchServe model name: {rec['model']!r}")
    for key in ("workers", "batch_size", "per_pod_capacity_rps", "target_rps"):
        if rec[key] <= 0:
            raise ValueError(f"recommendation[{key!r}] must be > 0, got {rec[key]!r}")
    for key in ("max_batch_delay_ms", "warmup_seconds"):
        if rec[key] < 0:
            raise ValueError(f"recommendation[{key!r}] must be >= 0, got {rec[key]!r}")
    return rec


def quantity(value: float) -> str:
    """A Kubernetes quantity string (milli-units when not whole)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def sizing(rec: dict, headroom: float = 0.7, burst: float = 2.0) -> dict:
    """Replica bounds and HPA targets for a recommendation (see the module docstring)."""
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    per_pod = rec["per_pod_capacity_rps"] * headroom
    min_replicas = max(1, math.ceil(rec["target_rps"] / per_pod - 1e-9))
    max_replicas = max(min_replicas + 1, math.ceil(min_replicas * burst))
    startup_s = 2 * rec["warmup_seconds"] + STARTUP_OVERHEAD_S
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "rps_target": quantity(per_pod), "inflight_target": quantity(rec["workers"] * rec["batch_size"]),
            "startup_failure_threshold": max(6, math.ceil(startup_s / PROBE_PERIOD_S))}


SNAPSHOT_KEY = "model_snapshot="


def snapshot_line(rec: dict, base_config: Path) -> str:
    """The `model_snapshot` line for `rec`: TorchServe registers it at start with these workers and
    batch settings (they win over the archive's model-config); the timeouts stay the base's."""
    current = {}
    for line in base_config.read_text().splitlines():
        if line.startswith(SNAPSHOT_KEY):
            current = json.loads(line.split("=", 1)[1]).get("models", {})
    old = next(iter(current.get(rec["model"], {}).values()), {})
    spec = {"defaultVersion": True, "marName": f"{rec['model']}.mar", "minWorkers": rec["workers"],
            "maxWorkers": rec["workers"], "batchSize": rec["batch_size"],
            "maxBatchDelay": int(round(rec["max_batch_delay_ms"])),
            "responseTimeout": old.get("responseTimeout", 120), "startupTimeout": old.get("startupTimeout", 300)}
    return SNAPSHOT_KEY + json.dumps({"name": "servekit", "modelCount": 1, "models": {rec["model"]: {"1.0": spec}}})


def config_properties(rec: dict, base_config: Path | str = BASE_CONFIG) -> str:
    base_config = resolve(base_config)
    lines = base_config.read_text().splitlines()
    index = [i for i, line in enumerate(lines) if line.startswith(SNAPSHOT_KEY)]
    if len(index) != 1:
        raise ValueError(f"{base_config} must have exactly one `{SNAPSHOT_KEY}` line, found {len(index)}")
    lines[index[0]] = snapshot_line(rec, base_config)
    return "\n".join(lines) + "\n"


def write_overlay(recommendation: dict, out_dir: Path, base: Path | str = GPU_OVERLAY,
                  base_config: Path | str = BASE_CONFIG, headroom: float = 0.7, burst: float = 2.0) -> Path:
    """Write a kustomize overlay for `recommendation` into `out_dir`; returns the kustomization path.

    `base` is the overlay or base it builds on (a folder with a kustomization), `base_config` the
    config.properties whose `model_snapshot` line is replaced. `headroom` is the fraction of the measured
    per-pod capacity a pod is planned to run at; `burst` the ratio maxReplicas / minReplicas.
    """
    rec = check(dict(recommendation))
    base = resolve(base)
    size = sizing(rec, headroom, burst)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    probe = ["python", "-m", "servekit.probe", "ready", "--model", rec["model"],
             "--config", "/etc/servekit/config.properties"]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "servekit"},
        "spec": {"template": {"spec": {"containers": [{
            "name": "torchserve",
            "startupProbe": {"exec": {"command": probe + ["--warm-up"]}, "periodSeconds": PROBE_PERIOD_S,
                             "failureThreshold": size["startup_failure_threshold"]},
            "readinessProbe": {"exec": {"command": probe}},
        }]}}},
    }
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "servekit"},
        "spec": {
            "minReplicas": size["min_replicas"], "maxReplicas": size["max_replicas"],
            "metrics": [
                {"type": "Pods", "pods": {"metric": {"name": "servekit_pod_inflight_requests"},
                                          "target": {"type": "AverageValue",
                                                     "averageValue": size["inflight_target"]}}},
                {"type": "Pods", "pods": {"metric": {"name": "servekit_pod_requests_per_second"},
                                          "target": {"type": "AverageValue",
                                                     "averageValue": size["rps_target"]}}},
            ],
        },
    }
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(Path(base).resolve(), out_dir.resolve())],
        "configMapGenerator": [{"name": "servekit-config", "behavior": "merge",
                                "files": ["config.properties"]}],
        "patches": [{"path": "deployment-benchmark.yaml"}, {"path": "hpa-benchmark.yaml"}],
    }
    header = (f"# Written by `python -m servekit.deploy.overlay` from the benchmark recommendation:\n"
              f"# {json.dumps(rec, sort_keys=True)}\n"
              f"# minReplicas {size['min_replicas']} = ceil(target_rps / (per_pod_capacity_rps x {headroom})), "
              f"maxReplicas {size['max_replicas']}; startupProbe {size['startup_failure_threshold']} x "
              f"{PROBE_PERIOD_S} s >= 2 x warm-up + {STARTUP_OVERHEAD_S} s.\n")
    (out_dir / "config.properties").write_text(config_properties(rec, base_config))
    (out_dir / "deployment-benchmark.yaml").write_text(yaml.safe_dump(deployment, sort_keys=False))
    (out_dir / "hpa-benchmark.yaml").write_text(yaml.safe_dump(hpa, sort_keys=False))
    path = out_dir / "kustomization.yaml"
    path.write_text(header + yaml.safe_dump(kustomization, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servekit.deploy.overlay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recommendation", type=Path,
                        help="JSON file: the recommendation, or an object holding it under 'recommendation'")
    parser.add_argument("--out", type=Path, required=True, help="overlay folder to write")
    parser.add_argument("--base", type=Path, default=Path(GPU_OVERLAY), help="overlay to build on (default k8s/overlays/gpu)")
    parser.add_argument("--headroom", type=float, default=0.7,
                        help="fraction of the measured per-pod capacity to plan for (default 0.7)")
    parser.add_argument("--burst", type=float, default=2.0, help="maxReplicas / minReplicas (default 2)")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.recommendation.read_text())
        rec = data.get("recommendation", data) if isinstance(data, dict) else data
        if not isinstance(rec, dict):
            raise ValueError("the JSON file holds no recommendation object")
        path = write_overlay(rec, args.out, args.base, headroom=args.headroom, burst=args.burst)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}; apply with: kubectl apply -k {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
