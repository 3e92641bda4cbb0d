"""Parsing and validation of embedding requests (OpenAI-compatible and plain), without `ts`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection

from servekit.handlers.common import RequestError, check_token_ids, decode_body, int_field, is_int, shown, without_nulls

OPENAI_ROUTE = "v1/embeddings"
OPENAI_KEYS = {"input", "model", "encoding_format", "dimensions", "user", "prompt_name"}
PLAIN_KEYS = {"text", "prompt_name"}


@dataclass
class EmbeddingRequest:
    texts: list[str]
    openai: bool
    encoding_format: str = "float"
    model: str | None = None
    # OpenAI token-array inputs: a text's tokens without special tokens, used instead of `texts`.
    token_ids: list[list[int]] | None = None
    prompt_name: str | None = None
    dimensions: int | None = None  # keep the first `dimensions` coordinates

    @property
    def n_inputs(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else len(self.texts)


def _bad(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, "invalid_request_error", message, code)


def _count(field: str, n: int, max_texts: int) -> None:
    if n > max_texts:
        raise RequestError(413, "invalid_request_error",
                           f"'{field}' has {n} inputs; at most {max_texts} per request", "too_many_inputs")


def _texts(value: Any, field: str, max_texts: int, max_chars: int) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list):
        raise _bad(f"'{field}' must be a string or a list of strings, got {type(value).__name__}", "invalid_type")
    if not texts:
        raise _bad(f"'{field}' is an empty list", "empty_input")
    _count(field, len(texts), max_texts)
    for i, t in enumerate(texts):
        where = field if isinstance(value, str) else f"{field}[{i}]"
        if not isinstance(t, str):
            raise _bad(f"'{where}' must be a string, got {type(t).__name__}", "invalid_type")
        if not t.strip():
            raise _bad(f"'{field}' contains an empty string at index {i}", "empty_input")
        if len(t) > max_chars:
            raise RequestError(413, "invalid_request_error",
                               f"'{field}[{i}]' has {len(t)} characters; the limit is {max_chars}", "input_too_long")
    return texts


def _token_arrays(value: list, max_texts: int, vocab_size: int) -> list[list[int]]:
    """OpenAI's token inputs: one array of token ids, or a list of them; every id in the vocabulary."""
    arrays = [value] if is_int(value[0]) else value
    _count("input", len(arrays), max_texts)
    for i, ids in enumerate(arrays):
        where = "input" if arrays is not value else f"input[{i}]"
        if not isinstance(ids, list):
            raise _bad(f"'{where}' must be a list of token ids, got {type(ids).__name__} (strings and token "
                       "arrays cannot be mixed)", "invalid_type")
        if not ids:
            raise _bad(f"'{where}' is an empty token array", "empty_input")
        check_token_ids(ids, where, vocab_size)
    return arrays


def _prompt_name(body: dict[str, Any], prompts: Collection[str]) -> str | None:
    name = body.get("prompt_name")
    if name is None:
        return None
    if not isinstance(name, str):
        raise _bad(f"'prompt_name' must be a string, got {type(name).__name__}", "invalid_type")
    if name not in prompts:
        known = f"this model's prompts: {', '.join(sorted(prompts))}" if prompts else "this model has no prompts"
        raise _bad(f"unknown prompt_name {shown(name)}; {known}", "invalid_value")
    return name


def parse_embedding_request(request: dict[str, Any], route: str, dim: int, max_texts: int, max_chars: int,
                            vocab_size: int = 0, prompts: Collection[str] = ()) -> EmbeddingRequest:
    """One TorchServe request -> texts (or token ids) to embed, or a RequestError for that request alone.

    `vocab_size`: token ids accepted are 0 .. vocab_size - 1 (0: token inputs refused).
    `prompts`: the model's prompt names, which `prompt_name` may pick.
    """
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
            raise _bad(f"unknown field {shown(unknown[0])}", "unknown_field")
        if "input" not in body:
            raise _bad("missing required field 'input'", "missing_field")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _bad(f"'encoding_format' must be 'float' or 'base64', got {shown(fmt)}", "invalid_value")
        dims = int_field(body, "dimensions", 1, dim)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "invalid_type")
        prompt = _prompt_name(body, prompts)
        value = body["input"]
        if isinstance(value, list) and value and (is_int(value[0]) or isinstance(value[0], list)):
            if not vocab_size:
                raise _bad("token-id inputs are not accepted here", "invalid_type")
            if prompt is not None:
                raise _bad("'prompt_name' applies to text inputs, not to token ids", "invalid_value")
            return EmbeddingRequest([], True, fmt, model, _token_arrays(value, max_texts, vocab_size), None, dims)
        return EmbeddingRequest(_texts(value, "input", max_texts, max_chars), True, fmt, model,
                                prompt_name=prompt, dimensions=dims)
    if isinstance(body, dict):
        unknown = sorted(set(body) - PLAIN_KEYS)
        if "text" not in body:
            raise _bad("missing required field 'text'", "missing_field")
        if unknown:
            raise _bad(f"unknown field {shown(unknown[0])}", "unknown_field")
        return EmbeddingRequest(_texts(body["text"], "text", max_texts, max_chars), False,
                                prompt_name=_prompt_name(without_nulls(body), prompts))
    return EmbeddingRequest(_texts(body, "text", max_texts, max_chars), False)
