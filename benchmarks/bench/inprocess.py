"""The report's in-process reference: the winner's plan run back to back inside the bench process.

Served throughput pays for HTTP, TorchServe's frontend, its worker protocol and batching under an
SLA. To say how much of the plan's own speed survives that, the winner's servekit plan is loaded
here (same model-config, same device) and fed the sweep's own payload texts in full batches of
the winner's batch size, through the handler's compute path: tokenize, plan the bucket chunks,
embed, copy to the host. No HTTP, no JSON, no waiting for a batch to fill.
Embedding models only; for others the report says it was not measured.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from servekit.benchmarks.bench.payloads import body_texts


def payload_texts(bodies_path: Path) -> tuple[list[list[str]], float]:
    """The texts of each request body (``payloads.body_texts``) and the mean per body."""
    per_body: list[list[str]] = []
    for line in Path(bodies_path).read_text().splitlines():
        if not line.strip():
            continue
        texts = body_texts(json.loads(line))
        if texts:
            per_body.append(texts)
    if not per_body:
        raise ValueError(f"{bodies_path}: no request body holds a text")
    return per_body, sum(map(len, per_body)) / len(per_body)


def run_batches(runner: Any, texts: Sequence[str], batch_size: int, seconds: float, warmup_s: float = 1.0
                ) -> dict[str, float]:
    """Full batches of `texts` (cycled) through `runner` for `seconds` after `warmup_s`: texts/s."""
    n, k = len(texts), 0

    def one() -> int:
        nonlocal k
        batch = [texts[(k + i) % n] for i in range(batch_size)]
        k += batch_size
        ids, _ = runner.tokenize(batch)
        runner.embed_ids(ids, runner.chunks(ids)).numpy()
        return len(batch)

    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:
        one()
    done, batches, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        done += one()
        batches += 1
    elapsed = time.perf_counter() - t0
    return {"texts_per_s": done / elapsed, "batches": batches, "ms_per_batch": 1000 * elapsed / batches}


def measure(model: str, model_config: dict[str, Any], bodies_path: Path, batch_size: int,
            seconds: float) -> dict[str, Any]:
    """In-process texts/s of `model_config`'s plan, or {"skipped": why}."""
    from servekit.archive import EMBEDDING, minilm_weights
    from servekit.benchmarks.bench.archives import model_folder, model_spec

    if model_spec(model).kind != EMBEDDING:
        return {"skipped": "in-process reference only for embedding models"}
    import torch

    from servekit.optimizations.embed.runner import EmbeddingRunner
    from servekit.optimizations.plan import parse_plan

    per_body, mean_texts = payload_texts(bodies_path)
    t0 = time.perf_counter()
    runner = EmbeddingRunner(model_folder(model) or minilm_weights()[0].parent, parse_plan(model_config.get("servekit")))
    load_s = time.perf_counter() - t0
    label = runner.plan.label()
    if runner.device.type == "cuda":
        torch.set_num_threads(1)  # as in a served GPU worker (handlers/embedding_handler.py)
    try:
        figures = run_batches(runner, [t for texts in per_body for t in texts], batch_size, seconds)
    finally:
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"plan": label, "batch_size": batch_size, "seconds": seconds,
            "load_s": round(load_s, 1), "texts_per_request": mean_texts, **figures}
