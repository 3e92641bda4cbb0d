"""The LLM dashboard on live data: TorchServe serves a SmolLM2 archive twice, the CPU plan with
speculative decoding and the shipped CPU plan, a real Prometheus scrapes its metrics port every
second while a few chat completions (streaming and not) go to each, and every panel query of
servekit-llm.json must return data: the speculation panels get theirs from the speculative model.
The questions after the first share a long instruction, so the prefix cache of each model serves
part of their prompts. The archives hold conftest's `tiny_smollm2` (SmolLM2's tokenizer and chat
template with a tiny random model): the panels need the metrics, not SmolLM2's answers.

Skipped, with the reason: GPU-only panels on a machine without a CUDA GPU.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from servekit.archive import build_archive
from servekit.deploy import dashboards
from servekit.resources import model_config
from servekit.torchserve import TorchServe
from test_k8s_pod_live import http, promql, running_prometheus, substitute

pytestmark = pytest.mark.server

MODEL, CONTINUOUS = "smollm2", "smollm2-continuous"
MODELS = (MODEL, CONTINUOUS)
NAMESPACE, POD = "servekit", "servekit-llm-7c9d5f6b8-x2v4p"
# Long enough to fill full 16-token blocks past the chat template's default system prompt, which
# the questions after the first reuse from the prefix cache.
SHARED = "Answer the next question in one short sentence, plainly, without a preamble or your reasoning: "
BOARD = dashboards.dashboards()["servekit-llm.json"]
QUERIES = [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in BOARD["panels"] for t in p["targets"]]


def skip_reason(expr: str) -> str | None:
    """Why a query is not checked here, or None."""
    if "GPU" in expr and not torch.cuda.is_available():
        return "TorchServe emits GPU metrics only on a machine with a CUDA GPU"
    return None


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy(src, dst)


@pytest.fixture(scope="module")
def server(tiny_smollm2: list[Path], tiny_smollm2_spec_store: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    tmp = tmp_path_factory.mktemp("ts-llm-dash")
    build_archive("smollm2", tmp / "continuous", config=model_config("smollm2-cpu"), weights=tiny_smollm2,
                  compress=False)  # shipped: continuous batching
    store = tmp / "store"
    store.mkdir()
    link_or_copy(tiny_smollm2_spec_store / "smollm2.mar", store / f"{MODEL}.mar")
    link_or_copy(tmp / "continuous" / "smollm2.mar", store / f"{CONTINUOUS}.mar")
    with TorchServe(tmp / "ts", store) as ts:
        ts.register(f"{MODEL}.mar", MODEL, batch_size=4, max_batch_delay_ms=50, workers=1, timeout=240)
        ts.register(f"{CONTINUOUS}.mar", CONTINUOUS, workers=1, timeout=240)
        yield ts


def chat(ts: TorchServe, model: str, content: str, stream: bool) -> int:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, "stream": stream}
    status, answer = http("POST", f"{ts.inference_url}/predictions/{model}/1.0/v1/chat/completions",
                          json.dumps(body).encode(), timeout=120)
    if status == 200 and not stream:  # the name it is registered under, not the archive's
        assert json.loads(answer)["model"] == model, answer
    return status


def scraped_ttft_count(url: str, model: str) -> float:
    result = promql(url, f'sum(servekit_llm_ttft_seconds_count{{ModelName="{model}"}})')
    return float(result[0]["value"][1]) if result else 0.0


def wait_scraped(url: str, count: int, timeout: float = 60.0) -> None:
    """Until Prometheus has scraped TTFT observations of `count` requests: on a busy 2-core machine
    its first scrapes can come late, and a fixed sleep then left every sample after the last
    request (zero increase: histogram_quantile over it is NaN)."""
    deadline = time.monotonic() + timeout
    while min(scraped_ttft_count(url, m) for m in MODELS) < count:
        assert time.monotonic() < deadline, f"Prometheus never scraped {count} TTFT observations"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def prometheus(server: TorchServe, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus URL after load: a first request creates the series, a scrape sees them, then
    more requests increase them so that every rate() over the window is defined."""
    target = f"127.0.0.1:{server.ports.metrics}"
    with running_prometheus(tmp_path_factory.mktemp("prometheus-llm"), target,
                            {"namespace": NAMESPACE, "pod": POD}) as url:
        codes = [chat(server, m, "Say hello.", stream=False) for m in MODELS]
        wait_scraped(url, 1)
        questions = ["What is the capital of France?", "Name a colour.", "Count to three.", "What is two plus two?"]
        for i, question in enumerate(questions):
            codes += [chat(server, m, SHARED + question, stream=i % 2 == 0) for m in MODELS]
        assert codes == [200] * len(codes), codes
        wait_scraped(url, 1 + len(questions))  # a scrape after the load
        time.sleep(1.5)  # and one more, for the metrics emitted after the last token
        yield url


@pytest.mark.parametrize("model", MODELS)
def test_prefix_cache_hits_scraped(prometheus: str, model: str) -> None:
    """The questions' shared instruction was served from the prefix cache, and Prometheus saw it."""
    hit = promql(prometheus, f'sum(servekit_llm_prefix_hit_tokens_total{{ModelName="{model}"}})')
    queried = promql(prometheus, f'sum(servekit_llm_prefix_queried_tokens_total{{ModelName="{model}"}})')
    hit_tokens, queried_tokens = (float(r[0]["value"][1]) if r else 0.0 for r in (hit, queried))
    assert 0 < hit_tokens < queried_tokens, (hit, queried)


@pytest.mark.parametrize("title, legend, expr", QUERIES, ids=[f"{t} [{l}]" for t, l, _ in QUERIES])
def test_llm_dashboard_query_returns_data(prometheus: str, title: str, legend: str, expr: str) -> None:
    query = substitute(expr.replace("$model", "|".join(MODELS)))
    result = promql(prometheus, query)  # a valid query on a live Prometheus, skipped or not
    reason = skip_reason(expr)
    if reason:
        pytest.skip(f"{title} / {legend}: {reason}")
    assert result, f"{title} / {legend}: no data for {query}"
    values = [float(r["value"][1]) for r in result]
    assert all(not math.isnan(v) for v in values), f"{title} / {legend}: NaN in {result}"
