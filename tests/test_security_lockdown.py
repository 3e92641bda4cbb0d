"""Lock-down: loopback addresses, no remote archives, token authorization, no unpickling, no management
port on the Kubernetes Service, pinned TorchServe. docs/security.md explains each point."""
from __future__ import annotations

import http.server
import ipaddress
import json
import pickle
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import psutil
import pytest
import requests
import yaml

import servekit.torchserve as server
from servekit.torchserve import TorchServe, free_port, read_properties
from servekit.archive import minilm_weights

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config" / "config.properties"
ADDRESS_KEYS = ("inference_address", "management_address", "metrics_address",
                "grpc_inference_address", "grpc_management_address")


def _host(address: str) -> str:
    return urllib.parse.urlsplit(address).hostname if "://" in address else address.split(":")[0]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # Java reports IPv4 sockets as ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


# -- config/config.properties -------------------------------------------------------------------------
def test_config_binds_every_address_to_loopback():
    props = read_properties(CONFIG)
    missing = [k for k in ADDRESS_KEYS if k not in props]
    assert not missing, f"{CONFIG.name} leaves {missing} to TorchServe's defaults"
    for key, value in props.items():
        if key.endswith("_address"):
            assert _is_loopback(_host(value)), f"{key}={value} is not loopback"


def test_config_refuses_remote_archives_and_environment_overrides():
    props = read_properties(CONFIG)
    pattern = re.compile(props["allowed_urls"])
    for url in ("http://example.com/m.mar", "https://127.0.0.1/m.mar", "file:///etc/passwd", "s3://b/m.mar"):
        assert not pattern.search(url), f"allowed_urls={props['allowed_urls']} admits {url}"
    assert props["enable_envvars_config"] == "false"
    assert props["install_py_dep_per_model"] == "false"


@pytest.mark.server
def test_live_server_listens_on_loopback_only(minilm_server):
    launcher = psutil.Process(minilm_server.proc.pid)
    listening = []
    for p in [launcher] + launcher.children(recursive=True):
        try:
            connections = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a short-lived child (TorchServe's metric collector) exited meanwhile
            continue
        listening += [(p.pid, c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    ports = {port for _, _, port in listening}
    assert {minilm_server.ports.inference, minilm_server.ports.management, minilm_server.ports.metrics} <= ports
    assert all(_is_loopback(ip) for _, ip, _ in listening), listening


# -- remote archives --------------------------------------------------------------------------------
class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        _Recorder.hits.append(self.path)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.server
def test_registering_an_archive_from_a_url_is_refused(minilm_server):
    """allowed_urls admits no URL: TorchServe refuses before fetching anything (nothing reaches our server)."""
    httpd = http.server.HTTPServer(("127.0.0.1", free_port()), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        for url in (f"{base}/evil.mar", f"{base}/evil.mar?x=minilm.mar", "https://example.com/evil.mar"):
            r = requests.post(f"{minilm_server.management_url}/models", params={"url": url}, timeout=60)
            assert r.status_code == 404, (url, r.status_code, r.text)
            assert "does not match any allowed URL" in r.json()["message"], r.text
        r = requests.post(f"{minilm_server.management_url}/models", params={"url": "../../etc/passwd"}, timeout=60)
        assert r.status_code == 404 and "Relative path is not allowed" in r.json()["message"], r.text
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert _Recorder.hits == [], f"TorchServe fetched {_Recorder.hits}"


# -- nothing runs from outside the model store -------------------------------------------------------
def test_config_keeps_the_model_api_off():
    """TorchServe registers any absolute folder through POST /models: the shipped config turns that API off."""
    assert read_properties(CONFIG)["enable_model_api"] == "false"


@pytest.mark.parametrize("mar", ["/tmp/x/evildir", "/tmp/x/evil.mar", "../evil.mar", "sub/evil.mar", "evil",
                                 "file:///tmp/x/evil.mar", "https://example.com/evil.mar", ".evil.mar",
                                 "evil..mar", "evil.mar?x=1", "C:\\x\\evil.mar", "a" * 300])
def test_client_registers_only_archive_names_of_the_store(mar):
    """The client refuses before any HTTP call: its management URL is a closed port, so a call would
    raise ServerError (unreachable) instead of the ValueError naming the rule."""
    client = server.ManagementClient(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="not a plain .mar file name in the model store") as e:
        client.register(server.Registration(mar, "evil"))
    assert len(str(e.value)) < 400, "the refused name is echoed without bound"


def _evil_folder(root: Path) -> tuple[Path, Path]:
    """A folder TorchServe takes for an extracted archive, whose handler writes a marker file at import."""
    folder, marker = root / "evildir", root / "handler-ran"
    (folder / "MAR-INF").mkdir(parents=True)
    (folder / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
        {"runtime": "python", "model": {"modelName": "evil", "handler": "evil_handler.py", "modelVersion": "1.0"}}))
    (folder / "evil_handler.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n"
        "def handle(data, context):\n    return data\n")
    return folder, marker


def _register_folder(ts: TorchServe, folder: Path) -> requests.Response:
    return requests.post(f"{ts.management_url}/models", timeout=120, params={
        "url": str(folder), "model_name": "evil", "initial_workers": "1", "synchronous": "true"})


@pytest.mark.server
def test_a_folder_outside_the_store_never_runs_on_the_shipped_config(model_store, tmp_path):
    """POST /models?url=/abs/folder against a server started with config/config.properties as shipped
    (the models load at start): refused with 405, and the folder's handler never ran."""
    folder, marker = _evil_folder(tmp_path / "outside")
    with TorchServe(tmp_path / "run", model_store, models="minilm=minilm.mar") as ts:  # the API left off
        r = _register_folder(ts, folder)
        assert r.status_code == 405, (r.status_code, r.text[:300])
        assert ts.api.describe("evil") is None
        assert requests.delete(f"{ts.management_url}/models/minilm", timeout=30).status_code == 405
        ts.wait_ready("minilm", timeout=300)  # what the server is for still loads and scales
        assert ts.api.scale("minilm", 1, timeout=120) >= 0
    assert not marker.exists(), "the handler of a folder outside the model store ran"


def test_harness_servers_turn_the_model_api_on_only_to_register_at_run_time(tmp_path):
    """A harness server given its models at start keeps the shipped config's API off; one started
    empty (it can only get a model by registering) or asked for it turns it on."""
    def api(**kwargs) -> str:
        ts = TorchServe(tmp_path / str(len(list(tmp_path.iterdir()))), tmp_path, **kwargs)
        ts.run_dir.mkdir()
        return read_properties(ts._write_config())["enable_model_api"]

    assert api(models="minilm=minilm.mar") == "false"
    assert api() == "true"
    assert api(models="minilm=minilm.mar", model_api=True) == "true"
    assert api(model_api=False) == "false"


@pytest.mark.server
def test_with_the_model_api_on_torchserve_itself_runs_the_folder(minilm_server, tmp_path):
    """What remains where the model API is on (the harness's servers): TorchServe 0.12 registers the folder
    and runs its handler; only servekit's client refuses the name. The marker proves the folder above is a
    real exploit, so the shipped-config test fails on a server that admits it."""
    folder, marker = _evil_folder(tmp_path / "outside")
    with pytest.raises(ValueError):
        minilm_server.api.register(server.Registration(str(folder), "evil"))
    assert not marker.exists()
    try:
        r = _register_folder(minilm_server, folder)
        assert r.status_code == 200, (r.status_code, r.text[:300])
        assert marker.read_text() == "ran"
    finally:
        minilm_server.unregister("evil")


# -- token authorization ----------------------------------------------------------------------------
@pytest.mark.server
def test_token_authorization_when_enabled(model_store, tmp_path):
    """With disable_token_authorization=false (TorchServe's default): no or a wrong key -> 400
    InvalidKeyException (TorchServe 0.12 answers 400, not 401), the right key -> 200. Inference and
    management have separate keys; /ping needs the inference key; /metrics needs none."""
    run = tmp_path / "run"
    key_file = run / "key_file.json"

    def keys() -> dict:
        try:
            return json.loads(key_file.read_text())
        except (OSError, ValueError):
            return {}

    send = server.http_json  # the real call, before the patch below

    def http_json_with_key(method: str, url: str, timeout: float = 30.0):
        # The adapter polls /ping and the management API without a key; add TorchServe's key here.
        k = keys()
        if not k:
            raise OSError("key file not written yet")
        which = "management" if url.startswith(ts.management_url) else "inference"
        return send(method, url, timeout, headers={"Authorization": f"Bearer {k[which]['key']}"})

    ts = TorchServe(run, model_store, extra_props={"disable_token_authorization": "false"})
    with mock.patch.object(server, "http_json", http_json_with_key):
        ts.start()
    try:
        k = keys()
        assert set(k) >= {"management", "inference", "API"}
        mk, ik = k["management"]["key"], k["inference"]["key"]
        bearer = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731
        cases = [
            ("GET", f"{ts.management_url}/models", {}, 400),
            ("GET", f"{ts.management_url}/models", bearer("wrong"), 400),
            ("GET", f"{ts.management_url}/models", bearer(ik), 400),
            ("GET", f"{ts.management_url}/models", bearer(mk), 200),
            ("POST", f"{ts.management_url}/models?url=http://example.com/x.mar", {}, 400),
            ("GET", f"{ts.inference_url}/ping", {}, 400),
            ("GET", f"{ts.inference_url}/ping", bearer(ik), 200),
            ("POST", f"{ts.inference_url}/predictions/minilm", {}, 400),
            ("POST", f"{ts.inference_url}/predictions/minilm", bearer(mk), 400),
            ("POST", f"{ts.inference_url}/predictions/minilm", bearer(ik), 404),  # past auth: no such model
            ("GET", f"{ts.metrics_url}/metrics", {}, 200),
        ]
        got = []
        for method, url, headers, want in cases:
            r = requests.request(method, url, headers=headers, data=b"x", timeout=30)
            got.append((method, url.split("/", 3)[-1], headers != {}, r.status_code, want))
            if want == 400:
                assert r.json()["type"] == "InvalidKeyException", r.text
        assert [g[3] for g in got] == [g[4] for g in got], got
    finally:
        ts.stop()


# -- no unpickling ------------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates `path`: the shape of a malicious pickle, made harmless."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _weights_dir(tmp_path: Path, safetensors: str = "real") -> tuple[Path, Path]:
    d = tmp_path / "model"
    d.mkdir()
    src = minilm_weights()[0].parent
    for name in ("config.json", "tokenizer.json"):
        shutil.copy2(src / name, d / name)
    marker = tmp_path / "UNPICKLED"
    evil = pickle.dumps({"weights": _Payload(marker)})
    if safetensors == "real":
        shutil.copy2(src / "model.safetensors", d / "model.safetensors")
    elif safetensors == "pickle":
        (d / "model.safetensors").write_bytes(evil)
    (d / "pytorch_model.bin").write_bytes(evil)
    (d / "model.pt").write_bytes(evil)
    return d, marker


_UNPICKLED: list[str] = []
_WATCH = threading.Event()


def _audit(event: str, args: tuple) -> None:
    # Every unpickler (C or Python, whoever imported it) raises this event to resolve a global.
    if event == "pickle.find_class" and _WATCH.is_set():
        _UNPICKLED.append(f"{args[0]}.{args[1]}")


sys.addaudithook(_audit)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fails the test if anything was unpickled, or if pickle.load(s)/torch.load were called at all."""
    import torch

    def boom(*a, **k):
        raise AssertionError("the loader tried to unpickle")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, boom)
    _UNPICKLED.clear()
    _WATCH.set()
    try:
        yield
    finally:
        _WATCH.clear()
    assert not _UNPICKLED, f"globals resolved by an unpickler: {_UNPICKLED}"


def test_loader_ignores_pickles_beside_the_safetensors(tmp_path, no_unpickling):
    from servekit.optimizations.models.encoder import load_encoder

    d, marker = _weights_dir(tmp_path, "real")
    model = load_encoder(d)
    assert sum(p.numel() for p in model.parameters()) > 20_000_000
    assert not marker.exists()


def test_loader_refuses_a_pickle_named_model_safetensors(tmp_path, no_unpickling):
    from servekit.optimizations.models.encoder import load_encoder

    d, marker = _weights_dir(tmp_path, "pickle")
    with pytest.raises(Exception) as info:
        load_encoder(d)
    assert "header" in str(info.value).lower() or "safetensor" in type(info.value).__name__.lower(), info.value
    assert not isinstance(info.value, AssertionError)  # failed in safetensors, not by trying to unpickle
    assert not marker.exists()


def test_loader_without_safetensors_fails_instead_of_reading_the_pickle(tmp_path, no_unpickling):
    from servekit.optimizations.models.encoder import load_encoder

    d, marker = _weights_dir(tmp_path, "absent")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_encoder(d)
    assert not marker.exists()


def test_the_handler_loader_refuses_a_smuggled_pickle(tmp_path, no_unpickling):
    """The whole load path of the handler (EmbeddingRunner) with the pickle as model.safetensors."""
    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import Plan

    d, marker = _weights_dir(tmp_path, "pickle")
    with pytest.raises(Exception) as info:
        EmbeddingRunner(d, Plan(device="cpu", warmup=False), golden_texts=["x"])
    assert not isinstance(info.value, AssertionError), info.value
    assert not marker.exists()


@pytest.mark.server
def test_built_archive_holds_no_pickle(model_store):
    with zipfile.ZipFile(model_store / "minilm.mar") as z:
        names = z.namelist()
        assert "model.safetensors" in names
        pickled = [n for n in names if n.rsplit(".", 1)[-1] in ("bin", "pt", "pth", "pkl", "pickle", "ckpt")
                   or n.endswith("data.pkl")]
        assert not pickled, pickled
        packaged = ("servekit/handlers/", "servekit/optimizations/")
        assert not [n for n in names if n.endswith(".py") and not n.startswith(packaged)
                    and n not in ("servekit/__init__.py", "embedding_handler.py")], names


# -- Kubernetes ---------------------------------------------------------------------------------------
def _render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    path = ROOT / "k8s" / overlay
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations")
    if not (path / "kustomization.yaml").exists():
        pytest.skip(f"k8s/{overlay} has no kustomization.yaml yet")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        pytest.skip(f"kubectl kustomize k8s/{overlay} failed: {out.stderr.strip()[:300]}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("overlay", ["base", "overlays/cpu", "overlays/gpu"])
def test_management_api_is_never_on_the_kubernetes_service(overlay):
    docs = _render(overlay)
    services = [d for d in docs if d["kind"] == "Service"]
    assert services, "no Service rendered"
    for svc in services:
        for port in svc["spec"]["ports"]:
            assert port["port"] not in (8081, 7070, 7071) and port.get("targetPort") not in (8081, "management"), port
            assert "manage" not in port.get("name", ""), port
    for dep in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for port in c.get("ports", []):
                assert port["containerPort"] not in (8081, 7070, 7071), (c["name"], port)
            assert not c.get("hostNetwork")
        assert not dep["spec"]["template"]["spec"].get("hostNetwork")
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and "config.properties" in d.get("data", {})):
        props = dict(line.split("=", 1) for line in cm["data"]["config.properties"].splitlines()
                     if "=" in line and not line.lstrip().startswith("#"))
        for key in ("management_address", "grpc_inference_address", "grpc_management_address"):
            assert _is_loopback(_host(props[key])), f"{cm['metadata']['name']}: {key}={props[key]}"
        assert props["allowed_urls"] == "^$"
        assert props["enable_envvars_config"] == "false"


# -- dependency pins ----------------------------------------------------------------------------------
def test_torchserve_is_pinned_past_the_known_advisories():
    """TorchServe 0.12.0: past CVE-2023-43654 (SSRF, fixed 0.8.2) and CVE-2024-35198/35199 (fixed 0.11.0)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torchserve==0.12.0"' in pyproject and '"torch-model-archiver==0.12.0"' in pyproject
    assert version("torchserve") == "0.12.0"
    assert tuple(int(x) for x in version("safetensors").split(".")[:2]) >= (0, 4)
