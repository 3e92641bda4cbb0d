"""The alert rules (the PrometheusRule, written out as a plain rule file) pass `promtool check rules`
and their `promtool test rules` unit tests; every dashboard and adapter query is valid PromQL."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servekit.deploy import dashboards, rules

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "k8s" / "monitoring"
RULE_TESTS = MONITORING / "rules" / "servekit-alerts.test.yml"
ALERTS = {"ServekitLatencyP99AboveSLA", "ServekitHighErrorRate", "ServekitWorkerRestarted",
          "ServekitGPUMemoryNearFull", "ServekitNoReadyWorkers", "ServekitMetricsDown"}


def ensure_prometheus_tools() -> str:
    """Path of promtool, installing Debian's prometheus package (promtool + server) when missing and
    we are root (what `make tools` does)."""
    if shutil.which("promtool") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], env=env, capture_output=True, timeout=600)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found and could not be installed: run `make tools` "
                    "(or `sudo apt-get install prometheus`)")
    return promtool


@pytest.fixture(scope="module")
def promtool() -> str:
    return ensure_prometheus_tools()


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def rule_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PrometheusRule's groups as a plain rule file, through the command the docs give, with
    the unit tests beside it."""
    out = tmp_path_factory.mktemp("rules")
    proc = subprocess.run([sys.executable, "-m", "servekit.deploy.rules", "--out", str(out),
                           "--from", str(MONITORING / "prometheusrule.yaml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    shutil.copy(RULE_TESTS, out / RULE_TESTS.name)
    return out


@pytest.fixture(scope="module")
def rule_file(rule_dir: Path) -> Path:
    return rule_dir / rules.RULE_FILE


def test_promtool_check_rules(promtool, rule_file):
    proc = run([promtool, "check", "rules", str(rule_file)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests_cover_every_alert(promtool, rule_file):
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tested = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if case["exp_alerts"]}
    silent = {case["alertname"] for t in tests["tests"] for case in t["alert_rule_test"] if not case["exp_alerts"]}
    in_file = {r["alert"] for g in yaml.safe_load(rule_file.read_text())["groups"] for r in g["rules"]}
    assert in_file == ALERTS
    assert tested == ALERTS, f"alerts never seen firing in a test: {ALERTS - tested}"
    assert silent == ALERTS, f"alerts never checked silent: {ALERTS - silent}"
    proc = run([promtool, "test", "rules", RULE_TESTS.name], cwd=rule_file.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_test_catches_a_broken_threshold(promtool, tmp_path, rule_file):
    """The unit tests would notice a changed rule: move the SLA to 1 s and they fail."""
    broken = rule_file.read_text().replace("> 0.25", "> 1")
    assert broken != rule_file.read_text()
    (tmp_path / rule_file.name).write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    proc = run([promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path)
    assert proc.returncode != 0 and "ServekitLatencyP99AboveSLA" in proc.stdout + proc.stderr


def test_prometheusrule_carries_the_tested_rules(rule_file):
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(rule_file.read_text())["groups"]
    assert "prometheusrule.yaml" in yaml.safe_load((MONITORING / "kustomization.yaml").read_text())["resources"]
    assert not list(MONITORING.rglob("*.rules.yml")), "the alerts have one copy: prometheusrule.yaml"


def test_rules_command_refuses_a_file_that_is_no_prometheusrule(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "servekit.deploy.rules", "--out", str(tmp_path),
                           "--from", str(MONITORING / "servicemonitor.yaml")], capture_output=True, text=True)
    assert proc.returncode == 1 and "not a PrometheusRule" in proc.stderr
    assert not (tmp_path / rules.RULE_FILE).exists()


def test_every_alert_has_severity_summary_and_description(rule_file):
    for group in yaml.safe_load(rule_file.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def substitute_dashboard_variables(expr: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$namespace", "servekit").replace("$pod", ".*")
            .replace("$model", "minilm").replace("$sla_ms", "250").replace("$ttft_sla_ms", "500"))


def adapter_query(rule: dict, namespace: str = "servekit", pods: str = ".*") -> str:
    """The PromQL prometheus-adapter runs for a pods metric of `rule` (its template filled in)."""
    series = re.search(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~"{pods}"')
            .replace("<<.GroupBy>>", "pod"))


def all_queries() -> dict[str, str]:
    queries = {}
    for file, board in dashboards.dashboards().items():
        for p in board["panels"]:
            for t in p["targets"]:
                queries[f"{file} / {p['title']} / {t['refId']}"] = substitute_dashboard_variables(t["expr"])
    config = yaml.safe_load((MONITORING / "prometheus-adapter" / "config.yaml").read_text())
    for rule in config["rules"]:
        queries[f"adapter {rule['name']['as']}"] = adapter_query(rule)
    return queries


def test_dashboard_and_adapter_queries_are_valid_promql(promtool, tmp_path):
    queries = all_queries()
    assert all("$" not in q and "<<" not in q for q in queries.values()), "an unsubstituted variable is left"
    records = [{"record": f"servekit:check_{i}", "expr": q} for i, q in enumerate(queries.values())]
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": records}]}))
    proc = run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_metrics_doc_covers_every_declared_metric():
    declared = yaml.safe_load((ROOT / "config" / "metrics.yaml").read_text())
    names = {m["name"] for section in ("ts_metrics", "model_metrics")
             for kind in declared[section].values() for m in kind}
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/metrics.md does not describe {missing}"
    config = yaml.safe_load((MONITORING / "prometheus-adapter" / "config.yaml").read_text())
    for rule in config["rules"]:
        assert f"`{rule['name']['as']}`" in doc
    for alert in ALERTS:
        assert f"`{alert}`" in doc
