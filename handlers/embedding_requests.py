"""Parsing and validation of embedding requests (OpenAI-compatible and plain), without `ts`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servekit.handlers.common import RequestError, decode_body, int_field, without_nulls

OPENAI_ROUTE = "v1/embeddings"
OPENAI_KEYS = {"input", "model", "encoding_format", "dimensions", "user"}


@dataclass
class EmbeddingRequest:
    texts: list[str]
    openai: bool
    encoding_format: str = "float"
    model: str | None = None


def _bad(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, "invalid_request_error", message, code)


def _texts(value: Any, field: str, max_texts: int, max_chars: int) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list):
        raise _bad(f"'{field}' must be a string or a list of strings, got {type(value).__name__}", "invalid_type")
    if not texts:
        raise _bad(f"'{field}' is an empty list", "empty_input")
    if len(texts) > max_texts:
        raise RequestError(413, "invalid_request_error",
                           f"'{field}' has {len(texts)} texts; at most {max_texts} per request", "too_many_inputs")
    for i, t in enumerate(texts):
        where = field if isinstance(value, str) else f"{field}[{i}]"
        if not isinstance(t, str):
            hint = " (token arrays are not supported)" if isinstance(t, (int, list)) else ""
            raise _bad(f"'{where}' must be a string, got {type(t).__name__}{hint}", "invalid_type")
        if not t.strip():
            raise _bad(f"'{field}' contains an empty string at index {i}", "empty_input")
        if len(t) > max_chars:
            raise RequestError(413, "invalid_request_error",
                               f"'{field}[{i}]' has {len(t)} characters; the limit is {max_chars}", "input_too_long")
    return texts


def parse_embedding_request(request: dict[str, Any], route: str, dim: int, max_texts: int,
                            max_chars: int) -> EmbeddingRequest:
    """One TorchServe request -> texts to embed, or a RequestError for that request alone."""
    if route not in ("", OPENAI_ROUTE):
        raise RequestError(404, "not_found_error", f"unknown route '{route}'; use /v1/embeddings or no suffix",
                           "unknown_route")
    body = decode_body(request)
    if route == OPENAI_ROUTE:
        if not isinstance(body, dict):
            raise _bad(f"body must be a JSON object with 'input', got {type(body).__name__}", "invalid_type")
        body = without_nulls(body)
        unknown = sorted(set(body) - OPENAI_KEYS)
        if unknown:
            raise _bad(f"unknown field '{unknown[0]}'", "unknown_field")
        if "input" not in body:
            raise _bad("missing required field 'input'", "missing_field")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _bad(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "invalid_value")
        dims = int_field(body, "dimensions", 1, 2**31 - 1)
        if dims is not None and dims != dim:
            raise _bad(f"'dimensions' must be {dim} for this model, got {dims}", "invalid_value")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "invalid_type")
        return EmbeddingRequest(_texts(body["input"], "input", max_texts, max_chars), True, fmt, model)
    if isinstance(body, dict):
        unknown = sorted(set(body) - {"text"})
        if "text" not in body:
            raise _bad("missing required field 'text'", "missing_field")
        if unknown:
            raise _bad(f"unknown field '{unknown[0]}'", "unknown_field")
        return EmbeddingRequest(_texts(body["text"], "text", max_texts, max_chars), False)
    return EmbeddingRequest(_texts(body, "text", max_texts, max_chars), False)
