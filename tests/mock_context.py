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


def batch(context: Context, requests: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Set up `context` for a batch of (url_path, body) requests and return the handler's `data`:
    a JSON body arrives parsed (as with Content-Type: application/json), bytes as a bytearray."""
    context.request_ids = {i: f"req-{i}" for i in range(len(requests))}
    context.request_processor = [RequestProcessor({"url_path": path} if path else {}) for path, _ in requests]
    return [{"body": bytearray(body) if isinstance(body, bytes) else body} for _, body in requests]


def status(context: Context, idx: int) -> int:
    return context.get_response_status(idx)[0]
