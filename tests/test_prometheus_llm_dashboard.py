"""The LLM dashboard on live data: TorchServe serves the SmolLM2 archive (CPU plan with speculative
decoding) with the LLM handler, a real Prometheus scrapes its metrics port every second while a few
chat completions (streaming and not) are served, and every panel query of servekit-llm.json must
return data.

Skipped, with the reason: GPU-only panels on a machine without a CUDA GPU.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from servekit.deploy import dashboards
from servekit.torchserve import TorchServe
from test_k8s_pod_live import http, promql, running_prometheus, substitute

pytestmark = pytest.mark.server

MODEL = "smollm2"
NAMESPACE, POD = "servekit", "servekit-llm-7c9d5f6b8-x2v4p"
BOARD = dashboards.dashboards()["servekit-llm.json"]
QUERIES = [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in BOARD["panels"] for t in p["targets"]]


def skip_reason(expr: str) -> str | None:
    """Why a query is not checked here, or None."""
    if "GPU" in expr and not torch.cuda.is_available():
        return "TorchServe emits GPU metrics only on a machine with a CUDA GPU"
    return None


@pytest.fixture(scope="module")
def server(smollm2_spec_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    with TorchServe(tmp_path_factory.mktemp("ts-llm-dash"), smollm2_spec_store) as ts:
        ts.register(f"{MODEL}.mar", MODEL, batch_size=4, max_batch_delay_ms=50, workers=1, timeout=240)
        yield ts


def chat(ts: TorchServe, content: str, stream: bool) -> int:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, "stream": stream}
    status, _ = http("POST", f"{ts.inference_url}/predictions/{MODEL}/1.0/v1/chat/completions",
                     json.dumps(body).encode(), timeout=120)
    return status


def scraped_ttft_count(url: str) -> float:
    result = promql(url, f'sum(servekit_llm_ttft_seconds_count{{ModelName="{MODEL}"}})')
    return float(result[0]["value"][1]) if result else 0.0


def wait_scraped(url: str, count: int, timeout: float = 60.0) -> None:
    """Until Prometheus has scraped TTFT observations of `count` requests: on a busy 2-core machine
    its first scrapes can come late, and a fixed sleep then left every sample after the last
    request (zero increase: histogram_quantile over it is NaN)."""
    deadline = time.monotonic() + timeout
    while scraped_ttft_count(url) < count:
        assert time.monotonic() < deadline, f"Prometheus never scraped {count} TTFT observations"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def prometheus(server: TorchServe, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus URL after load: a first request creates the series, a scrape sees them, then
    more requests increase them so that every rate() over the window is defined."""
    target = f"127.0.0.1:{server.ports.metrics}"
    with running_prometheus(tmp_path_factory.mktemp("prometheus-llm"), target,
                            {"namespace": NAMESPACE, "pod": POD}) as url:
        codes = [chat(server, "Say hello.", stream=False)]
        wait_scraped(url, 1)
        questions = ["What is the capital of France?", "Name a colour.", "Count to three.", "What is two plus two?"]
        for i, question in enumerate(questions):
            codes.append(chat(server, question, stream=i % 2 == 0))
        assert codes == [200] * len(codes), codes
        wait_scraped(url, 1 + len(questions))  # a scrape after the load
        time.sleep(1.5)  # and one more, for the metrics emitted after the last token
        yield url


@pytest.mark.parametrize("title, legend, expr", QUERIES, ids=[f"{t} [{l}]" for t, l, _ in QUERIES])
def test_llm_dashboard_query_returns_data(prometheus: str, title: str, legend: str, expr: str) -> None:
    query = substitute(expr.replace("$model", MODEL))
    result = promql(prometheus, query)  # a valid query on a live Prometheus, skipped or not
    reason = skip_reason(expr)
    if reason:
        pytest.skip(f"{title} / {legend}: {reason}")
    assert result, f"{title} / {legend}: no data for {query}"
    values = [float(r["value"][1]) for r in result]
    assert all(not math.isnan(v) for v in values), f"{title} / {legend}: NaN in {result}"
