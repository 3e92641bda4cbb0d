"""The alert rules as a plain Prometheus rule file, taken from the PrometheusRule.

`k8s/monitoring/prometheusrule.yaml` is the one copy of servekit's alerts (the Prometheus Operator
loads it). promtool reads plain rule files, so this writes its `spec.groups` out as one:

    python -m servekit.deploy.rules --out /tmp/rules            # writes servekit-alerts.rules.yml
    cp k8s/monitoring/rules/servekit-alerts.test.yml /tmp/rules/
    promtool test rules /tmp/rules/servekit-alerts.test.yml
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from servekit.resources import resolve

PROMETHEUS_RULE = "k8s/monitoring/prometheusrule.yaml"
RULE_FILE = "servekit-alerts.rules.yml"  # the name the promtool unit tests load


def rule_groups(prometheus_rule: Path | str = PROMETHEUS_RULE) -> list[dict[str, Any]]:
    """`spec.groups` of a PrometheusRule manifest; ValueError when it is not one."""
    path = resolve(prometheus_rule)
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("kind") != "PrometheusRule" or not isinstance(
            (doc.get("spec") or {}).get("groups"), list):
        raise ValueError(f"{path}: not a PrometheusRule with spec.groups")
    return doc["spec"]["groups"]


def write_rule_file(out_dir: Path, prometheus_rule: Path | str = PROMETHEUS_RULE) -> Path:
    """Write the plain rule file into `out_dir`; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RULE_FILE
    header = f"# Generated from {PROMETHEUS_RULE} by `python -m servekit.deploy.rules`: edit that file.\n"
    path.write_text(header + yaml.safe_dump({"groups": rule_groups(prometheus_rule)}, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servekit.deploy.rules", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help=f"folder to write {RULE_FILE} into")
    p.add_argument("--from", dest="source", default=PROMETHEUS_RULE,
                   help=f"PrometheusRule manifest (default: {PROMETHEUS_RULE})")
    args = p.parse_args(argv)
    try:
        print(write_rule_file(args.out, args.source))
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
