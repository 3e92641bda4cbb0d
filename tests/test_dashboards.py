"""Grafana dashboards: the committed JSON is what benchmarks/dashboards.py builds, the panels cover
what an operator needs, and `python -m servekit.deploy.dashboards push` works against a stand-in Grafana
API and fails clearly (no traceback) on a bad URL or token. Panel queries return data from a real
Prometheus in test_k8s_pod_live.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servekit.deploy import dashboards
from servekit.torchserve import free_port
from http_double import HttpDouble, JsonHandler

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "glsa_test_token"


def test_committed_json_is_what_build_writes(tmp_path):
    written = dashboards.build(tmp_path)
    committed = sorted(dashboards.DASHBOARD_DIR.glob("*.json"))
    assert [p.name for p in committed] == sorted(p.name for p in written)
    for path in written:
        assert (dashboards.DASHBOARD_DIR / path.name).read_text() == path.read_text(), \
            f"{path.name} is stale: run python -m servekit.deploy.dashboards build"


@pytest.mark.parametrize("name", sorted(dashboards.dashboards()))
def test_dashboard_structure(name):
    board = json.loads((dashboards.DASHBOARD_DIR / name).read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    names = [v["name"] for v in board["templating"]["list"]]
    assert {"datasource", "namespace", "model", "pod"} <= set(names)
    ids, cells = set(), set()
    for p in board["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cell & cells, f"panel {p['title']!r} overlaps another"
        cells |= cell
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_serving_dashboard_covers_the_operators_questions():
    board = dashboards.dashboards()["servekit-serving.json"]
    text = json.dumps(board)
    for metric in ("servekit_request_latency_seconds_bucket", "ts_inference_requests_total", "Requests5XX",
                   "servekit_request_errors_total", "ts_queue_latency_microseconds", "servekit_batch_fill_ratio",
                   "servekit_padding_ratio", "GPUUtilization", "GPUMemoryUtilization", "servekit_plan_info"):
        assert metric in text, metric
    latency = board["panels"][0]
    assert [t["legendFormat"] for t in latency["targets"]] == ["p50", "p90", "p99", "SLA"]
    assert "$sla_ms" in latency["targets"][3]["expr"]


def test_serving_dashboard_shows_rerank_load_in_pairs_not_requests():
    """A rerank request holds many pairs: the serving dashboard divides texts (pairs) by requests and
    device time by pairs, per model, so a reranker and an embedding model can be read side by side."""
    panels = {p["title"]: p for p in dashboards.dashboards()["servekit-serving.json"]["panels"]}
    per_request = panels["Rerank / score / classify: texts (pairs) per request and tokens per text"]["targets"]
    assert [t["expr"].split(" / ")[0].split("(rate(")[1].split("{")[0] for t in per_request] == \
        ["servekit_texts_total", "servekit_tokens_total"]
    assert [t["expr"].split(" / ")[1].split("(rate(")[1].split("{")[0] for t in per_request] == \
        ["servekit_requests_total", "servekit_texts_total"]
    (per_pair,) = panels["Rerank / score / classify: device time per text (pair)"]["targets"]
    assert "servekit_inference_seconds_sum" in per_pair["expr"].split(" / ")[0]
    assert "servekit_texts_total" in per_pair["expr"].split(" / ")[1]
    assert all("by (ModelName)" in t["expr"] for t in [*per_request, per_pair])


def test_llm_dashboard_covers_ttft_itl_tokens_and_speculation():
    text = json.dumps(dashboards.dashboards()["servekit-llm.json"])
    for metric in ("servekit_llm_ttft_seconds_bucket", "servekit_llm_itl_seconds_bucket",
                   "servekit_llm_completion_tokens_total", "servekit_spec_accepted_total",
                   "servekit_spec_proposed_total"):
        assert metric in text, metric


class FakeGrafana(HttpDouble):
    """The few endpoints of Grafana's HTTP API that push uses, with bearer-token auth."""

    def __init__(self, html: bool = False) -> None:
        self.folders: list[dict] = []
        self.saved: list[dict] = []
        outer = self

        class Handler(JsonHandler):
            def authorized(self) -> bool:
                if html:
                    self.reply(200, "<html>not grafana</html>", "text/html")
                    return False
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.reply(401, {"message": "invalid API key"})
                    return False
                return True

            def do_GET(self):
                if not self.authorized():
                    return
                if self.path.startswith("/api/frontend/settings"):
                    return self.reply(200, {"buildInfo": {"version": "11.3.0", "commit": "x"}})
                if self.path.startswith("/api/folders"):
                    return self.reply(200, outer.folders)
                self.reply(404, {"message": "Not found"})

            def do_POST(self):
                if not self.authorized():
                    return
                body = self.json_body()
                if self.path == "/api/folders":
                    folder = {"uid": "f-" + body["title"], "title": body["title"]}
                    outer.folders.append(folder)
                    return self.reply(200, folder)
                if self.path == "/api/dashboards/db":
                    outer.saved.append(body)
                    uid = body["dashboard"]["uid"]
                    return self.reply(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x"})
                self.reply(404, {"message": "Not found"})

        super().__init__(Handler)


@pytest.fixture
def grafana():
    fake = FakeGrafana()
    yield fake
    fake.close()


def push(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servekit.deploy.dashboards", "push", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_push_creates_the_folder_and_every_dashboard(grafana):
    proc = push("--url", grafana.url, "--token", TOKEN)
    assert proc.returncode == 0, proc.stderr
    assert grafana.folders == [{"uid": "f-servekit", "title": "servekit"}]
    assert sorted(b["dashboard"]["uid"] for b in grafana.saved) == ["servekit-llm", "servekit-serving"]
    assert all(b["folderUid"] == "f-servekit" and b["overwrite"] and b["dashboard"]["id"] is None
               for b in grafana.saved)
    assert proc.stdout.count("pushed ") == 2
    # A second push reuses the folder and overwrites.
    assert push("--url", grafana.url, "--token", TOKEN).returncode == 0
    assert len(grafana.folders) == 1 and len(grafana.saved) == 4


def test_push_rejects_a_bad_token(grafana):
    proc = push("--url", grafana.url, "--token", "wrong")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "rejected the token (401" in proc.stderr
    assert "Traceback" not in proc.stderr and not grafana.saved


@pytest.mark.parametrize("url, message", [
    ("grafana.example.com", "--url must be an http(s) URL"),
    ("ftp://grafana.example.com", "--url must be an http(s) URL"),
    ("http://127.0.0.1:{closed}", "cannot reach Grafana at"),
])
def test_push_to_a_bad_url_fails_clearly(url, message):
    proc = push("--url", url.format(closed=free_port()), "--token", TOKEN, "--timeout", "5")
    assert proc.returncode == 1, proc.stdout
    assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_push_to_something_else_than_grafana_fails_clearly():
    fake = FakeGrafana(html=True)
    try:
        proc = push("--url", fake.url, "--token", TOKEN)
    finally:
        fake.close()
    assert proc.returncode == 1 and "check --url" in proc.stderr and "Traceback" not in proc.stderr


def test_push_without_token_fails_clearly(grafana, monkeypatch):
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    proc = push("--url", grafana.url)
    assert proc.returncode == 1 and "--token is empty" in proc.stderr
