"""Parsing and validation of rerank, score and classify requests (without `ts`).

Routes (after /predictions/<model>/<version>/):
  v1/rerank    Cohere / Jina / vLLM: {query, documents: [str | {text}], top_n?, return_documents?}
  rerank       TEI: {query, texts: [str], return_text?, raw_scores?, truncate?}
  v1/score     vLLM: {text_1: str | [str], text_2: str | [str]}: 1:1, 1:N, N:N
  v1/classify  vLLM: {input: str | [str]}, and `raw_scores` (logits instead of probabilities)
  predict      TEI: {inputs: str | [str], raw_scores?, truncate?}
  (none)       rerank shape for a reranker, predict shape for a classifier
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servekit.handlers.common import RequestError, decode_body, int_field, without_nulls

RERANK_ROUTES = {"v1/rerank": "rerank", "rerank": "tei_rerank", "v1/score": "score"}
CLASSIFY_ROUTES = {"v1/classify": "classify", "predict": "predict"}
KEYS = {"rerank": {"model", "query", "documents", "top_n", "return_documents"},
        "tei_rerank": {"model", "query", "texts", "return_text", "raw_scores", "truncate"},
        "score": {"model", "text_1", "text_2"},
        "classify": {"model", "input", "raw_scores"},
        "predict": {"model", "inputs", "raw_scores", "truncate"}}


@dataclass
class ScoreRequest:
    """One request: the inputs to run (text pairs, or single texts) and how to answer it."""
    shape: str                                  # a value of RERANK_ROUTES / CLASSIFY_ROUTES
    inputs: list[tuple[str, str]] | list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False
    raw_scores: bool = False
    truncate: bool = True                       # False: an input over the limit is refused (TEI's truncate)
    single: bool = False                        # one text given as a string (predict / score answer shapes)


def _bad(message: str, code: str = "invalid_request") -> RequestError:
    return RequestError(400, "invalid_request_error", message, code)


def _text(value: Any, where: str, max_chars: int, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise _bad(f"'{where}' must be a string, got {type(value).__name__}", "invalid_type")
    if not allow_empty and not value.strip():
        raise _bad(f"'{where}' is empty", "empty_input")
    if len(value) > max_chars:
        raise RequestError(413, "invalid_request_error", f"'{where}' has {len(value)} characters; the limit is "
                           f"{max_chars}", "input_too_long")
    return value


def _text_list(value: Any, field: str, max_texts: int, max_chars: int, objects: bool = False) -> list[str]:
    """A non-empty list of texts within the limits; `objects`: items may be {"text": str} too."""
    if not isinstance(value, list):
        raise _bad(f"'{field}' must be a list, got {type(value).__name__}", "invalid_type")
    if not value:
        raise _bad(f"'{field}' is an empty list", "empty_input")
    if len(value) > max_texts:
        raise RequestError(413, "invalid_request_error", f"'{field}' has {len(value)} items; at most {max_texts} "
                           "per request", "too_many_inputs")
    out = []
    for i, item in enumerate(value):
        if objects and isinstance(item, dict):
            if set(item) != {"text"}:
                raise _bad(f"'{field}[{i}]' must be a string or an object with only 'text', got keys "
                           f"{sorted(item)[:4]}", "invalid_type")
            item, where = item["text"], f"{field}[{i}].text"
        else:
            where = f"{field}[{i}]"
        out.append(_text(item, where, max_chars))
    return out


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be true or false, got {type(v).__name__}", "invalid_type")
    return v


def shape_of(route: str, kind: str) -> str:
    """The request shape a route takes for a model of `kind` (rerank or classify); 404 for others."""
    if route == "":
        return "rerank" if kind == "rerank" else "predict"
    if route in CLASSIFY_ROUTES:
        return CLASSIFY_ROUTES[route]
    if route in RERANK_ROUTES:
        if kind != "rerank":
            raise RequestError(400, "invalid_request_error", f"/{route} needs a cross-encoder (one label, a relevance "
                               "score); this model is a classifier: use /v1/classify or /predict", "wrong_model_kind")
        return RERANK_ROUTES[route]
    known = ", ".join(f"/{r}" for r in (*RERANK_ROUTES, *CLASSIFY_ROUTES))
    raise RequestError(404, "not_found_error", f"unknown route '{route[:80]}'; this model serves {known}",
                       "unknown_route")


def parse_score_request(request: dict[str, Any], route: str, kind: str, max_texts: int, max_chars: int
                        ) -> ScoreRequest:
    """One TorchServe request -> a ScoreRequest, or a RequestError for that request alone.
    `max_texts`: documents (pairs, texts) per request; `max_chars`: characters per text."""
    shape = shape_of(route, kind)
    body = decode_body(request)
    if not isinstance(body, dict):
        raise _bad(f"body must be a JSON object, got {type(body).__name__}", "invalid_type")
    body = without_nulls(body)
    unknown = sorted(set(body) - KEYS[shape])
    if unknown:
        raise _bad(f"unknown field '{unknown[0][:80]}' (this route takes {', '.join(sorted(KEYS[shape]))})",
                   "unknown_field")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "invalid_type")
    if shape in ("rerank", "tei_rerank"):
        field = "documents" if shape == "rerank" else "texts"
        for key in ("query", field):
            if key not in body:
                raise _bad(f"missing required field '{key}'", "missing_field")
        query = _text(body["query"], "query", max_chars, allow_empty=False)
        docs = _text_list(body[field], field, max_texts, max_chars, objects=shape == "rerank")
        if shape == "rerank":
            return ScoreRequest(shape, [(query, d) for d in docs], model, int_field(body, "top_n", 1, max_texts),
                                _bool(body, "return_documents", False))
        return ScoreRequest(shape, [(query, d) for d in docs], model, return_documents=_bool(body, "return_text", False),
                            raw_scores=_bool(body, "raw_scores", False), truncate=_bool(body, "truncate", True))
    if shape == "score":
        for key in ("text_1", "text_2"):
            if key not in body:
                raise _bad(f"missing required field '{key}'", "missing_field")
        one, two = body["text_1"], body["text_2"]
        firsts = [_text(one, "text_1", max_chars)] if isinstance(one, str) else _text_list(one, "text_1", max_texts, max_chars)
        seconds = [_text(two, "text_2", max_chars)] if isinstance(two, str) else _text_list(two, "text_2", max_texts, max_chars)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)  # one to many
        elif len(firsts) != len(seconds):
            raise _bad(f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one text_1, or as many "
                       "as text_2 (pairs in order)", "invalid_value")
        return ScoreRequest(shape, list(zip(firsts, seconds)), model)
    field = "input" if shape == "classify" else "inputs"
    if field not in body:
        raise _bad(f"missing required field '{field}'", "missing_field")
    value = body[field]
    single = isinstance(value, str)
    texts = [_text(value, field, max_chars)] if single else _text_list(value, field, max_texts, max_chars)
    return ScoreRequest(shape, texts, model, raw_scores=_bool(body, "raw_scores", False),
                        truncate=_bool(body, "truncate", True) if shape == "predict" else True, single=single)
