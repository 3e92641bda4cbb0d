"""Grafana dashboards for servekit: built from the panel definitions below, pushed with grafana-client.

    python -m servekit.deploy.dashboards build            # rewrite k8s/monitoring/dashboards/*.json
    python -m servekit.deploy.dashboards push --url https://grafana.example.com --token "$GRAFANA_TOKEN"

In a cluster whose Grafana runs the dashboard sidecar (kube-prometheus-stack does), the same JSON
files are shipped as ConfigMaps labelled grafana_dashboard: "1" by `kubectl apply -k k8s/monitoring`
and no push is needed. Every metric used here is described in docs/metrics.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

from servekit.resources import k8s_dir

DASHBOARD_DIR = k8s_dir() / "monitoring" / "dashboards"

# Label filters. TorchServe's own per-model counters label the model `model_name`, the handler's
# metrics `ModelName`; host-level metrics (Requests2XX, QueueTime, GPU*, ...) have no model label.
TS = 'namespace=~"$namespace", pod=~"$pod", model_name=~"$model"'
MODEL = 'namespace=~"$namespace", pod=~"$pod", ModelName=~"$model"'
HOST = 'namespace=~"$namespace", pod=~"$pod"'
RATE = "[$__rate_interval]"


def quantile(q: float, histogram: str, labels: str = MODEL) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{labels}}}{RATE})))"


def mean(histogram: str, labels: str = MODEL) -> str:
    return (f"sum(rate({histogram}_sum{{{labels}}}{RATE})) / "
            f"sum(rate({histogram}_count{{{labels}}}{RATE}))")


def target(expr: str, legend: str, instant: bool = False) -> dict:
    t = {"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": expr,
         "legendFormat": legend, "refId": ""}
    if instant:
        t.update(instant=True, range=False, format="table")
    return t


def panel(title: str, targets: list[dict], unit: str = "short", kind: str = "timeseries",
          description: str = "", max_value: float | None = None) -> dict:
    p = {"type": kind, "title": title, "description": description,
         "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {},
         "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]}
    if max_value is not None:
        p["fieldConfig"]["defaults"]["max"] = max_value
    if kind == "timeseries":
        p["options"] = {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["mean", "max"]},
                        "tooltip": {"mode": "multi"}}
    return p


def sla_override(p: dict) -> dict:
    """Draw the SLA series as a dashed red line."""
    p["fieldConfig"]["overrides"].append({
        "matcher": {"id": "byName", "options": "SLA"},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                       {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                       {"id": "custom.fillOpacity", "value": 0}]})
    return p


def serving_panels() -> list[dict]:
    latency = sla_override(panel(
        "Request latency in the handler (p50 / p90 / p99) vs SLA",
        [target(quantile(0.5, "servekit_request_latency_seconds"), "p50"),
         target(quantile(0.9, "servekit_request_latency_seconds"), "p90"),
         target(quantile(0.99, "servekit_request_latency_seconds"), "p99"),
         target("vector($sla_ms / 1000)", "SLA")],
        unit="s",
        description="servekit_request_latency_seconds: from the handler receiving the batch to the "
                    "answers, per request. Queueing in TorchServe is in the panel beside."))
    return [
        latency,
        panel("Mean latency in TorchServe (total and queue)",
              [target(f"sum(rate(ts_inference_latency_microseconds{{{TS}}}{RATE})) / "
                      f"sum(rate(ts_inference_requests_total{{{TS}}}{RATE})) / 1e6", "total"),
               target(f"sum(rate(ts_queue_latency_microseconds{{{TS}}}{RATE})) / "
                      f"sum(rate(ts_inference_requests_total{{{TS}}}{RATE})) / 1e6", "queue")],
              unit="s", description="TorchServe's summed-microsecond counters divided by the request "
                                    "count: the mean, queueing included."),
        panel("Throughput",
              [target(f"sum by (model_name) (rate(ts_inference_requests_total{{{TS}}}{RATE}))",
                      "{{model_name}} requests/s"),
               target(f"sum(rate(servekit_texts_total{{{MODEL}}}{RATE}))", "texts/s")],
              unit="reqps"),
        panel("Responses by status class",
              [target(f"sum(rate(Requests2XX{{{HOST}}}{RATE}))", "2xx"),
               target(f"sum(rate(Requests4XX{{{HOST}}}{RATE}))", "4xx"),
               target(f"sum(rate(Requests5XX{{{HOST}}}{RATE}))", "5xx")],
              unit="reqps", description="TorchServe's Requests2XX/4XX/5XX counters (all models of the "
                                        "pod). A class with no response yet has no series."),
        panel("Handler errors by type",
              [target(f"sum by (ErrorType) (rate(servekit_request_errors_total{{{MODEL}}}{RATE}))",
                      "{{ErrorType}}")],
              unit="reqps", description="Requests the handler answered with an error, by type."),
        panel("In-flight and queued requests per pod (Little's law)",
              [target(f"sum by (pod) (rate(ts_inference_latency_microseconds{{{TS}}}{RATE})) / 1e6",
                      "{{pod}} in flight"),
               target(f"sum by (pod) (rate(ts_queue_latency_microseconds{{{TS}}}{RATE})) / 1e6",
                      "{{pod}} queued")],
              description="Mean number of requests inside each pod (in flight) and waiting for a "
                          "worker (queued): what the HorizontalPodAutoscaler scales on."),
        panel("Queue time (last request, per pod)",
              [target(f"max by (pod) (QueueTime{{{HOST}}})", "{{pod}}")], unit="ms"),
        panel("Batch fill (requests per batch / batchSize)",
              [target(mean("servekit_batch_fill_ratio"), "mean"),
               target(quantile(0.5, "servekit_batch_fill_ratio"), "p50"),
               target(f"sum(rate(servekit_texts_total{{{MODEL}}}{RATE})) / "
                      f"sum(rate(servekit_batches_total{{{MODEL}}}{RATE}))", "texts per batch")],
              unit="percentunit"),
        panel("Padding (padded tokens / tokens computed)",
              [target(mean("servekit_padding_ratio"), "mean per batch"),
               target(f"sum(rate(servekit_padded_tokens_total{{{MODEL}}}{RATE})) / "
                      f"(sum(rate(servekit_tokens_total{{{MODEL}}}{RATE})) + "
                      f"sum(rate(servekit_padded_tokens_total{{{MODEL}}}{RATE})))", "overall")],
              unit="percentunit", max_value=1),
        panel("Tokenizer segment cache (share of segments answered from it)",
              [target(f"1 - sum(rate(servekit_tokenizer_segment_misses_total{{{MODEL}}}{RATE})) / "
                      f"sum(rate(servekit_tokenizer_segments_total{{{MODEL}}}{RATE}))", "hit ratio")],
              unit="percentunit", max_value=1,
              description="Text segments whose token ids came from the cache (tokenizer_cache); the "
                          "rest went through the tokenizer. No series while the cache is off."),
        panel("Time per stage (mean per batch)",
              [target(mean("servekit_preprocess_seconds"), "preprocess"),
               target(mean("servekit_inference_seconds"), "inference"),
               target(mean("servekit_postprocess_seconds"), "postprocess")],
              unit="s"),
        panel("GPU utilization", [target(f"max by (pod, DeviceId) (GPUUtilization{{{HOST}}})",
                                         "{{pod}} GPU {{DeviceId}}")],
              unit="percent", max_value=100,
              description="TorchServe's system metrics (every minute, only on GPU nodes)."),
        panel("GPU memory", [target(f"max by (pod, DeviceId) (GPUMemoryUtilization{{{HOST}}})",
                                    "{{pod}} GPU {{DeviceId}}")],
              unit="percent", max_value=100),
        panel("Effective optimization plan",
              [target(f"max by (pod, ModelName, Plan) (servekit_plan_info{{{MODEL}}})", "", instant=True)],
              kind="table", description="The plan the handler applied at load (precision, compile, "
                                        "CUDA graphs, ...), one row per pod and model."),
        panel("Recompiles since load",
              [target(f"max by (pod) (servekit_recompiles{{{MODEL}}})", "{{pod}}")]),
        panel("Worker load time (last load of each worker)",
              [target(f"max by (pod, WorkerName) (WorkerLoadTime{{{HOST}}})", "{{pod}} {{WorkerName}}")],
              unit="ms", description="Changes when a worker restarts (the ServekitWorkerRestarted alert)."),
        panel("Host CPU and memory",
              [target(f"max by (pod) (CPUUtilization{{{HOST}}})", "{{pod}} CPU %"),
               target(f"max by (pod) (MemoryUtilization{{{HOST}}})", "{{pod}} memory %")],
              unit="percent"),
        # Rerank, score and classify models count (query, document) pairs or single texts as texts:
        # a rerank request carries many, so requests/s alone says little about their load.
        panel("Rerank / score / classify: texts (pairs) per request and tokens per text",
              [target(f"sum by (ModelName) (rate(servekit_texts_total{{{MODEL}}}{RATE})) / "
                      f"sum by (ModelName) (rate(servekit_requests_total{{{MODEL}}}{RATE}))",
                      "{{ModelName}} texts per request"),
               target(f"sum by (ModelName) (rate(servekit_tokens_total{{{MODEL}}}{RATE})) / "
                      f"sum by (ModelName) (rate(servekit_texts_total{{{MODEL}}}{RATE}))",
                      "{{ModelName}} tokens per text")],
              description="servekit_texts_total counts what the model ran on: texts for an embedding "
                          "model or classifier, (query, document) pairs for a reranker. Tokens per text "
                          "shows how long the documents are (a reranker cuts pairs at its max length)."),
        panel("Rerank / score / classify: device time per text (pair)",
              [target(f"sum by (ModelName) (rate(servekit_inference_seconds_sum{{{MODEL}}}{RATE})) / "
                      f"sum by (ModelName) (rate(servekit_texts_total{{{MODEL}}}{RATE}))", "{{ModelName}}")],
              unit="s", description="Inference time of the batches divided by the texts or pairs they "
                                    "held: the model's cost per pair, apart from the requests' sizes."),
    ]


def llm_panels() -> list[dict]:
    acceptance = (f"sum by (Position) (rate(servekit_spec_accepted_total{{{MODEL}}}{RATE})) / "
                  f"sum by (Position) (rate(servekit_spec_proposed_total{{{MODEL}}}{RATE}))")
    return [
        sla_override(panel("Time to first token (p50 / p99)",
                           [target(quantile(0.5, "servekit_llm_ttft_seconds"), "p50"),
                            target(quantile(0.99, "servekit_llm_ttft_seconds"), "p99"),
                            target("vector($ttft_sla_ms / 1000)", "SLA")], unit="s")),
        panel("Inter-token latency (p50 / p99)",
              [target(quantile(0.5, "servekit_llm_itl_seconds"), "p50"),
               target(quantile(0.99, "servekit_llm_itl_seconds"), "p99")], unit="s"),
        panel("Tokens per second",
              [target(f"sum(rate(servekit_llm_completion_tokens_total{{{MODEL}}}{RATE}))", "generated"),
               target(f"sum(rate(servekit_llm_prompt_tokens_total{{{MODEL}}}{RATE}))", "prompt")],
              unit="short"),
        panel("Continuous batching: running and waiting requests per pod",
              [target(f"max by (pod) (servekit_llm_running_seqs{{{MODEL}}})", "running {{pod}}"),
               target(f"max by (pod) (servekit_llm_waiting_seqs{{{MODEL}}})", "waiting {{pod}}")]),
        panel("Continuous batching: KV cache in use per pod",
              [target(f"max by (pod) (servekit_llm_kv_cache_usage{{{MODEL}}})", "{{pod}}")],
              unit="percentunit", max_value=1),
        panel("Prefix cache: hit rate and blocks in use per pod",
              [target(f"sum by (pod) (rate(servekit_llm_prefix_hit_tokens_total{{{MODEL}}}{RATE})) / "
                      f"sum by (pod) (rate(servekit_llm_prefix_queried_tokens_total{{{MODEL}}}{RATE}))",
                      "hit rate {{pod}}"),
               target(f"max by (pod) (servekit_llm_prefix_cache_usage{{{MODEL}}})", "cache usage {{pod}}")],
              unit="percentunit", max_value=1,
              description="Hit rate: share of the prompt tokens looked up whose K/V the prefix cache served. "
                          "Cache usage: share of the KV cache's full blocks holding reusable prefixes."),
        panel("Speculative decoding: acceptance rate by draft position",
              [target(acceptance, "position {{Position}}")], unit="percentunit", max_value=1),
        panel("Speculative decoding: draft tokens proposed and accepted",
              [target(f"sum(rate(servekit_spec_proposed_total{{{MODEL}}}{RATE}))", "proposed/s"),
               target(f"sum(rate(servekit_spec_accepted_total{{{MODEL}}}{RATE}))", "accepted/s")]),
        panel("Requests per second", [target(
            f"sum by (model_name) (rate(ts_inference_requests_total{{{TS}}}{RATE}))", "{{model_name}}")],
              unit="reqps"),
    ]


def variables(extra: list[dict]) -> list[dict]:
    def query(name: str, expr: str) -> dict:
        return {"name": name, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": expr, "refId": name}, "definition": expr, "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*",
                "current": {"text": "All", "value": "$__all"}}
    return [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source",
         "current": {}},
        query("namespace", "label_values(ts_inference_requests_total, namespace)"),
        query("model", 'label_values(ts_inference_requests_total{namespace=~"$namespace"}, model_name)'),
        query("pod", 'label_values(ts_inference_requests_total{namespace=~"$namespace"}, pod)'),
        *extra,
    ]


def textbox(name: str, label: str, value: str) -> dict:
    return {"name": name, "type": "textbox", "label": label, "query": value,
            "current": {"text": value, "value": value}}


def dashboard(uid: str, title: str, panels: list[dict], extra_vars: list[dict]) -> dict:
    for i, p in enumerate(panels):
        p["id"] = i + 1
        p["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}
    return {"uid": uid, "title": title, "tags": ["servekit", "torchserve"], "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "browser",
            "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables(extra_vars)}, "annotations": {"list": []},
            "panels": panels}


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON model."""
    return {
        "servekit-serving.json": dashboard(
            "servekit-serving", "servekit / serving", serving_panels(),
            [textbox("sla_ms", "p99 SLA (ms)", "250")]),
        "servekit-llm.json": dashboard(
            "servekit-llm", "servekit / LLM", llm_panels(),
            [textbox("ttft_sla_ms", "TTFT SLA (ms)", "500")]),
    }


def render(board: dict) -> str:
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def build(out_dir: Path = DASHBOARD_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, board in dashboards().items():
        path = out_dir / name
        path.write_text(render(board))
        written.append(path)
    return written


class PushError(Exception):
    """A push that failed for a reason the user can fix; the message says which."""


def push(url: str, token: str, folder: str = "servekit", files: list[Path] | None = None,
         timeout: float = 10.0) -> list[str]:
    """Create or overwrite every dashboard in Grafana's `folder`; returns the dashboards' URLs."""
    import niquests
    from grafana_client import GrafanaApi
    from grafana_client.client import (GrafanaClientError, GrafanaException,
                                       GrafanaUnauthorizedError)

    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PushError(f"--url must be an http(s) URL such as https://grafana.example.com, got {url!r}")
    if not token:
        raise PushError("--token is empty: create a Grafana service account token with the Editor "
                        "role and pass it (or set GRAFANA_TOKEN)")
    boards = [json.loads(p.read_text()) for p in (files or sorted(DASHBOARD_DIR.glob("*.json")))]
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout)

    def call(what: str, fn, *args):
        try:
            return fn(*args)
        except GrafanaUnauthorizedError:
            raise PushError(f"Grafana at {url} rejected the token (401 Unauthorized) while trying to "
                            f"{what}: check --token") from None
        except GrafanaClientError as e:
            if e.status_code == 404:
                raise PushError(f"{url} has no Grafana API to {what} (404 Not Found): check --url") from None
            if e.status_code == 403:
                raise PushError(f"the token may not {what} (403 Forbidden): it needs the Editor role "
                                f"on folder {folder!r}") from None
            raise PushError(f"Grafana at {url} refused to {what}: {e.message}") from None
        except GrafanaException as e:
            raise PushError(f"Grafana at {url} failed to {what}: {e.message}") from None
        except niquests.exceptions.RequestException as e:
            cause = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(e))
            reason = cause.group(1).strip() if cause else type(e).__name__
            raise PushError(f"cannot reach Grafana at {url} ({reason}): check --url") from None
        except (ValueError, AttributeError, TypeError) as e:  # a 2xx answer that is not Grafana JSON
            raise PushError(f"{url} answered something that is not Grafana's API ({e}): check --url") from None

    # /api/frontend/settings: answers only a Grafana, and only with a valid token.
    build = call("read its version", api.health.check)
    if not isinstance(build, dict) or "version" not in build:
        raise PushError(f"{url} does not look like Grafana (no buildInfo in /api/frontend/settings): check --url")
    existing = call("list folders", api.folder.get_all_folders)
    match = [f for f in existing if f.get("title") == folder]
    folder_uid = match[0]["uid"] if match else call("create a folder", api.folder.create_folder, folder)["uid"]
    urls = []
    for board in boards:
        board = dict(board, id=None)
        answer = call(f"save dashboard {board['title']!r}", api.dashboard.update_dashboard,
                      {"dashboard": board, "folderUid": folder_uid, "overwrite": True,
                       "message": "python -m servekit.deploy.dashboards push"})
        urls.append(url.rstrip("/") + answer.get("url", f"/d/{board['uid']}"))
    return urls


def main(argv: list[str] | None = None) -> int:
    import os

    parser = argparse.ArgumentParser(prog="python -m servekit.deploy.dashboards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the dashboards' JSON files")
    b.add_argument("--out", type=Path, default=DASHBOARD_DIR)
    p = sub.add_parser("push", help="create or overwrite the dashboards in a Grafana")
    p.add_argument("--url", required=True, help="Grafana's base URL, e.g. https://grafana.example.com")
    p.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN", ""),
                   help="service account token with the Editor role (default: $GRAFANA_TOKEN)")
    p.add_argument("--folder", default="servekit", help="Grafana folder (created if missing)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    p.add_argument("files", nargs="*", type=Path, help="dashboard JSON files (default: all of ours)")
    args = parser.parse_args(argv)
    if args.command == "build":
        for path in build(args.out):
            print(f"wrote {path}")
        return 0
    try:
        for board_url in push(args.url, args.token, args.folder, args.files or None, args.timeout):
            print(f"pushed {board_url}")
    except PushError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
