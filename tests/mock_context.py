"""A TorchServe context for handler unit tests without a server (as TorchServe's own
`ts/torch_handler/unit_tests/test_utils/mock_context.py` does): TorchServe's real `Context`,
`RequestProcessor` and metrics cache, filled the way its Python worker fills them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ts.context import Context, RequestProcessor
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

from servekit.resources import config_dir


def mock_context(model_dir: Path, model_yaml_config: dict[str, Any], batch_size: int,
                 model_name: str = "model") -> Context:
    """The context of a worker that TorchServe registered with `batch_size` (the register call's,
    which may differ from the model-config's `batchSize`)."""
    metrics = MetricsCacheYamlImpl(str(config_dir() / "metrics.yaml"))
    metrics.initialize_cache()
    manifest = {"model": {"modelName": model_name, "modelVersion": "1.0"}}
    return Context(model_name, str(model_dir), manifest, batch_size, None, "0.12.0", metrics=metrics,
                   model_yaml_config=model_yaml_config)


def _headers(request: tuple) -> dict[str, str]:
    """A request's headers as TorchServe passes them: its url_path, and any HTTP headers given as a
    third item of the request's tuple."""
    path = request[0]
    return {**({"url_path": path} if path else {}), **(request[2] if len(request) > 2 else {})}


def batch(context: Context, requests: list[tuple]) -> list[dict[str, Any]]:
    """Set up `context` for a batch of (url_path, body[, headers]) requests and return the handler's
    `data`: a JSON body arrives parsed (as with Content-Type: application/json), bytes as a bytearray."""
    context.request_ids = {i: f"req-{i}" for i in range(len(requests))}
    context.request_processor = [RequestProcessor(_headers(r)) for r in requests]
    return [{"body": bytearray(r[1]) if isinstance(r[1], bytes) else r[1]} for r in requests]


def status(context: Context, idx: int) -> int:
    return context.get_response_status(idx)[0]


def serve(handle: Any, context: Context, requests: list[tuple], max_calls: int = 100_000
          ) -> list[tuple[int, str, str | None]]:
    """TorchServe 0.12's continuous batching, as its frontend drives a handler: the requests are
    admitted in one call (with their bodies), then sent again without a body while the handler's
    `context.stopping_criteria` says they are unfinished, or while it leaves them out of its reply
    (out of `context.request_ids`: nothing is sent for them). Returns each request's (status, whole
    answer: every part concatenated, content type)."""
    pending, parts, out = list(range(len(requests))), {i: [] for i in range(len(requests))}, {}
    data = batch(context, requests)
    for _ in range(max_calls):
        if not pending:
            return [out[i] for i in range(len(requests))]
        context.request_ids = {j: f"req-{i}" for j, i in enumerate(pending)}
        context.request_processor = [RequestProcessor(_headers(requests[i])) for i in pending]
        answers = handle([data[i] for i in pending], context)
        for i in pending:
            data[i] = {}  # seen: later calls carry its headers only
        left = []
        for j, i in enumerate(pending):
            if j not in context.request_ids:  # held back: no reply this call
                left.append(i)
                continue
            parts[i].append(answers[j])
            if context.stopping_criteria[j](None) is False:
                left.append(i)
            else:
                out[i] = (status(context, j), "".join(parts[i]), context.get_response_content_type(j))
        pending = left
    raise AssertionError(f"requests {pending} unfinished after {max_calls} calls")
