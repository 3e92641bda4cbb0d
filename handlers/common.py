"""Request decoding and error shaping shared by servekit's handlers (no `ts` import here)."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, TypeVar

import orjson

log = logging.getLogger(__name__)
T = TypeVar("T")

# Bodies nested deeper than this are refused before any recursion can hurt the worker.
MAX_JSON_DEPTH = 32
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class RequestError(Exception):
    """A problem with one request: becomes that request's own 4xx JSON answer."""

    status: int
    type: str
    message: str
    code: str | None = None

    def body(self) -> str:
        return error_json(self.status, self.type, self.message, self.code)


# Longest error message sent: an error body stays small (and reaches the client before TorchServe
# closes the connection) whatever the request held.
MAX_MESSAGE_CHARS = 600
# Longest request value quoted in a message.
MAX_SHOWN_CHARS = 200


def error_json(status: int, err_type: str, message: str, code: str | None = None) -> str:
    """OpenAI-style error body: {"error": {"message", "type", "code"}}, its message cut to
    MAX_MESSAGE_CHARS (saying so)."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]}... (message truncated: {len(message)} characters)"
    code = code or str(status)
    return json.dumps({"error": {"message": message, "type": err_type, "code": code[:MAX_SHOWN_CHARS]}})


def clip(text: str) -> str:
    """Request text for an error message, cut to MAX_SHOWN_CHARS, saying so."""
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}... (truncated: {len(text)} characters)"


def shown(value: Any) -> str:
    """A request value quoted in an error message (its repr), cut to MAX_SHOWN_CHARS, saying so."""
    return clip(repr(value))


PHRASES = {400: "Bad Request", 404: "Not Found", 413: "Payload Too Large", 415: "Unsupported Media Type",
           422: "Unprocessable Entity", 500: "Internal Server Error", 503: "Service Unavailable",
           507: "Insufficient Storage"}


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping early once past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _reject_constant(name: str) -> Any:
    raise RequestError(400, "invalid_request_error", f"invalid JSON number {name}: NaN and Infinity are not allowed",
                       "invalid_json")


def decode_body(request: dict[str, Any]) -> Any:
    """The request's body as a Python value: parsed JSON, or text.

    Every handler's worker hands bodies over as bytes (`worker_io.install_buffered_reads`), so that
    they are parsed here once, duplicate keys refused; a body already parsed (TorchServe's own
    decoding, as in tests with a mock context) is checked the same way, without that check. A text or
    bytes body that starts with `{` or `[` is parsed as JSON whatever its content type (what
    `requests.post(url, data=json.dumps(...))` sends is text/plain): a text to embed that starts
    with one of them goes in a JSON body instead.
    """
    body = request.get("body")
    if body is None:
        body = request.get("data")
    text = None  # the JSON text of the body, when it is parsed here
    # Every other body reaches the handler as 'body'; TorchServe turns form-encoded and multipart bodies
    # into named fields, and curl -d '{"text": ...}' (form-encoded: no JSON content type) into none.
    if body is None and request and "body" not in request and "data" not in request:
        raise RequestError(415, "invalid_request_error", f"form fields are not supported (got field "
                           f"'{str(next(iter(request)))[:40]}'): send a JSON body with Content-Type: "
                           "application/json, or a text/plain body", "unsupported_media_type")
    if not request:
        raise RequestError(400, "invalid_request_error", "empty request body (a form-encoded body, as curl -d sends "
                           "without -H 'Content-Type: application/json', arrives empty)", "empty_body")
    if body is None or (isinstance(body, (str, bytes, bytearray)) and len(body) == 0):
        # TorchServe does not pass the HTTP method: a GET or DELETE on a POST route looks like this.
        raise RequestError(400, "invalid_request_error", "empty request body: this route takes a POST with a "
                           "JSON body", "empty_body")
    if isinstance(body, (bytes, bytearray)):
        if bytes(body[:2]) == GZIP_MAGIC:
            raise RequestError(415, "invalid_request_error", "body is gzip-compressed: Content-Encoding is not "
                               "supported here, send the body uncompressed", "unsupported_content_encoding")
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(400, "invalid_request_error", f"body is not valid UTF-8 (byte {e.start})",
                               "invalid_utf8") from None
    if isinstance(body, str):
        # A UTF-8 byte order mark is no content (TorchServe's own JSON parsing fails on it and hands
        # the body over as bytes): what follows is read as if it had none.
        body = body.removeprefix("\ufeff")
        start = body.lstrip()[:2]
        if start in ("//", "/*"):
            raise RequestError(400, "invalid_request_error", "body starts with a comment ('//' or '/*'): JSON has no "
                               "comments; send a text that starts with one in a JSON body", "invalid_json")
        if start[:1] in ("{", "["):
            text, body = body, _parse_json(body)
    if isinstance(body, (dict, list)):
        if _depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise RequestError(400, "invalid_request_error", f"JSON body is nested deeper than {MAX_JSON_DEPTH} levels",
                               "json_too_deep")
        colons, wide_floats = _check_values(body)
        # "\\" first: a one-character search is a memchr, the escape's a slower substring search.
        if text is not None and (wide_floats or colons != text.count(":") or ("\\" in text and "\\u003" in text)):
            body = _parse_json_exactly(text)
    elif isinstance(body, str):  # a text body handed over already decoded: the same Unicode check
        _check_values(body)
    return body


def _parse_json(text: str) -> Any:
    """A JSON body parsed by orjson (several times faster than json), or, where orjson refuses it, by
    `_parse_json_exactly` (json's own messages, as before, and its NaN, lone surrogates and huge
    integers, refused later with their own messages).

    orjson keeps the last of duplicate keys and reads integers beyond 64 bits as floats; the caller
    re-parses exactly where its cheap check (`_check_values`' counts) cannot rule either out.
    """
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return _parse_json_exactly(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise RequestError(400, "invalid_request_error", f"duplicate key {shown(key)} in a JSON object: each "
                               "key may appear once (JSON parsers disagree on which value wins)", "duplicate_key")
        seen.add(key)
    return dict(pairs)


def _parse_json_exactly(text: str) -> Any:
    """json's parse of a body, refusing duplicate keys (the slow path: object_pairs_hook builds every
    object in Python)."""
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise RequestError(400, "invalid_request_error", "JSON body is nested too deeply", "json_too_deep") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, "invalid_request_error", f"malformed JSON: {e.msg} at line {e.lineno} "
                           f"column {e.colno} (a body starting with '{{' or '[' is read as JSON; send a text that "
                           "starts with one in a JSON body)", "invalid_json") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits (Python's int parsing limit)
        raise RequestError(400, "invalid_request_error", f"invalid JSON value: {e}", "invalid_number") from None


def without_nulls(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI treats a field set to null as absent: so do we (SDK objects dumped with model_dump()
    carry many)."""
    return {k: v for k, v in body.items() if v is not None}


def int_field(body: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int | None:
    """An integer field in [lo, hi] (absent or null: `default`): the one range check of every
    integer a request carries, so that no out-of-range number reaches a tokenizer or the sampler."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise RequestError(400, "invalid_request_error", f"'{key}' must be an integer, got {type(v).__name__}",
                           "invalid_type")
    if not lo <= v <= hi:
        raise RequestError(400, "invalid_request_error",
                           f"'{key}' must be between {lo} and {hi}, got {shown_number(v)}",
                           "invalid_value")
    return v


def shown_number(v: int | float) -> str:
    """A number for an error message: a huge integer by its first digits and length."""
    return str(v) if isinstance(v, float) or abs(v) < 10**12 else f"{str(v)[:8]}... ({len(str(abs(v)))} digits)"


def is_int(v: Any) -> bool:
    """An integer in a JSON body (not a boolean, which Python counts as one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_token_ids(ids: list[Any], where: str, vocab_size: int) -> None:
    """A 400 naming the first item of ``ids`` (field ``where``) that is no token id of the vocabulary."""
    for k, t in enumerate(ids):
        if not is_int(t):
            raise RequestError(400, "invalid_request_error",
                               f"'{where}[{k}]' must be a token id (integer), got {type(t).__name__}", "invalid_type")
        if not 0 <= t < vocab_size:
            raise RequestError(400, "invalid_request_error", f"'{where}[{k}]' is token id {shown_number(t)}, outside "
                               f"this model's vocabulary (0 to {vocab_size - 1})", "invalid_value")


def number_field(body: dict[str, Any], key: str, default: float, lo: float, hi: float,
                 lo_open: bool = False) -> float:
    """A number field in [lo, hi] (or (lo, hi]); absent or null: `default`."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise RequestError(400, "invalid_request_error", f"'{key}' must be a number, got {type(v).__name__}",
                           "invalid_type")
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(400, "invalid_request_error",
                           f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {shown_number(v)}",
                           "invalid_value")
    return float(v)


MODELS_ROUTE = "v1/models"


def is_models_route(route: str) -> bool:
    return route == MODELS_ROUTE or route.startswith(MODELS_ROUTE + "/")


# TorchServe 0.12 under continuous batching: a worker with no request in flight waits for the next
# one while holding the model's queue lock (Model.pollInferJob), and a worker with requests running
# needs that lock before each next call of its handler. With two workers, an idle one holds up the
# other's running requests until some new request arrives (on a CPU server a 4-token answer waited
# 350 s, until the next request came). So a continuous-batching model gets one worker.
CONTINUOUS_ONE_WORKER = (
    "TorchServe 0.12's continuous batching serves one worker per model: an idle worker waits for the next "
    "request while holding the model's queue lock, which a busy worker needs before each call, so with a "
    "second worker running requests stall until another request arrives. Run more rows with a larger "
    "batchSize, or more replicas (pods) of the one-worker server")


# Sent by servekit.torchserve.warm_up_inference with the streamed chats it sends an LLM when a
# server starts: the request metrics leave those out, as they do the models API's requests.
WARM_UP_HEADER = "X-Servekit-Warm-Up"


def is_warm_up(context: Any, idx: int) -> bool:
    """Whether request ``idx`` carries ``WARM_UP_HEADER`` (any case: HTTP clients differ in how they
    write header names, and TorchServe passes them on as they came)."""
    try:
        headers = context.get_all_request_header(idx) or {}
    except (KeyError, IndexError, AttributeError):
        return False
    wanted = WARM_UP_HEADER.lower()
    return any(_text(k).lower() == wanted for k in headers)


def models_requests(context: Any, answered: Iterable[int]) -> int:
    """How many of the requests ``parse_each`` answered (``answered``: their indices) went to the
    models API. The request metrics leave them out: the inference warm-up sends them by the hundred
    when a server starts (``servekit.torchserve.warm_up_inference``), and counted they would show a
    burst of traffic and of sub-millisecond latencies at each start."""
    return sum(is_models_route(url_path(context, i)) for i in answered)


def models_answer(route: str, model_name: str, created: int, card_fields: dict[str, Any] | None = None) -> str | None:
    """The OpenAI models API for the one model this worker serves: `v1/models` lists it,
    `v1/models/<id>` retrieves it (404 for another id). None for every other route. Any method
    (TorchServe does not pass it; the SDK sends GET). ``card_fields``: the card's fields beyond
    OpenAI's (an LLM's ``max_model_len``, as vLLM's cards have it)."""
    if not is_models_route(route):
        return None
    card = {"id": model_name, "object": "model", "created": created, "owned_by": "servekit", **(card_fields or {})}
    if route == MODELS_ROUTE:
        return json.dumps({"object": "list", "data": [card]})
    wanted = route[len(MODELS_ROUTE) + 1:]
    if wanted != model_name:
        raise RequestError(404, "invalid_request_error", f"the model '{wanted}' does not exist here; this endpoint "
                           f"serves '{model_name}'", "model_not_found")
    return json.dumps(card)


def parse_each(data: list[dict[str, Any]], context: Any, metrics: Any, model_name: str, created: int,
               parse: Callable[[dict[str, Any], str], T],
               skip: Collection[int] = (), card_fields: dict[str, Any] | None = None
               ) -> tuple[dict[int, T], dict[int, str]]:
    """Each request of a batch on its own: the models API answered here, the others parsed by
    `parse(raw, route)`. Returns the valid requests and the answers given already (models API, each
    failed request's own 4xx: whatever went wrong, never its batch-mates' failure). Indices in
    `skip` are left alone (continuous batching: requests already running, sent without a body)."""
    requests: dict[int, T] = {}
    answers: dict[int, str] = {}
    for i, raw in enumerate(data):
        if i in skip:
            continue
        route = url_path(context, i)
        try:
            models = models_answer(route, model_name, created, card_fields)
            if models is not None:
                answers[i] = models
                context.set_response_content_type(i, "application/json")
                continue
            requests[i] = parse(_json_scalar(raw, context, i), route)
        except RequestError as e:
            answers[i] = fail_request(context, i, metrics, e)
        except Exception as e:  # a request no check foresaw: still its own 400
            log.exception("request %d of the batch failed parsing", i)
            answers[i] = fail_request(context, i, metrics, RequestError(
                400, "invalid_request_error", f"invalid request ({type(e).__name__}: {str(e)[:200]})",
                "invalid_request"))
    return requests, answers


# Floats this large may be integers that orjson could not hold (it reads those beyond 64 bits as floats).
WIDE_FLOAT = float(2**63)


def _json_scalar(raw: dict[str, Any], context: Any, idx: int) -> dict[str, Any]:
    """Request `idx` with a body sent as application/json that is a JSON scalar (`null`, `42`,
    `"text"`) decoded, as TorchServe's worker decoded every such body before it handed bodies over as
    bytes (`worker_io`); objects and arrays stay bytes for `decode_body` (only they can repeat a key),
    and so does a body that is no JSON (TorchServe forwarded those as bytes too)."""
    body = raw.get("body")
    if not isinstance(body, (bytes, bytearray)) or bytes(body[:64]).lstrip()[:1] in (b"{", b"["):
        return raw
    try:
        declared = context.get_request_header(idx, "body")
    except (KeyError, IndexError, AttributeError):
        return raw
    if not isinstance(declared, dict) or declared.get("content-type") != "application/json":
        return raw
    try:
        value = json.loads(bytes(body).decode("utf-8"))
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError included): decode_body gives the 400
        return raw
    return raw if isinstance(value, (dict, list)) else {**raw, "body": value}


def _check_values(value: Any) -> tuple[int, bool]:
    """Refuse values no field of ours may carry, before any reaches a tokenizer or the model.

    TorchServe's own json.loads accepts NaN/Infinity, and a JSON "\\ud800" escape decodes to an
    unpaired surrogate that tokenizers reject with an exception that would fail the whole batch.

    Returns what the same walk counts for `decode_body`'s duplicate-key check: the keys of every
    object plus the colons inside every string, and whether a float of 2**63 or more was seen. In
    JSON text a colon is either a key's separator or inside a string, so a text whose colons
    outnumber that count lost a key to a duplicate (or spelled a colon as an escape, \\u003a).
    """
    colons = 0
    wide_floats = False
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                raise RequestError(400, "invalid_request_error", "NaN and Infinity are not allowed in the body",
                                   "invalid_number")
            wide_floats = wide_floats or abs(v) >= WIDE_FLOAT
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(400, "invalid_request_error", f"body is not valid Unicode: unpaired surrogate "
                                   f"at character {e.start} of {v[:40]!r}", "invalid_unicode") from None
            colons += v.count(":")
        elif isinstance(v, dict):
            colons += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return colons, wide_floats


def fail_request(context: Any, idx: int, metrics: Any, err: RequestError) -> str:
    """Give request `idx` of the batch its own error answer (status + JSON body) and count it.

    `context` is TorchServe's Context, `metrics` the handler's HandlerMetrics.
    """
    context.set_response_status(err.status, PHRASES.get(err.status, "Error"), idx=idx)
    context.set_response_content_type(idx, "application/json")
    metrics.emit("servekit_request_errors_total", "counter", 1, ErrorType=err.code or err.type)
    return err.body()


def device_error(e: Exception, oom_advice: str, work: str) -> RequestError:
    """A request's error for an exception its inference raised on the device: 507 for out of memory
    (the device's cache freed, `oom_advice` telling the client what to send instead), else 500
    naming the exception's type (`work`: what failed, e.g. "inference")."""
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return RequestError(507, "server_error", f"out of memory; {oom_advice}", "out_of_memory")
    return RequestError(500, "server_error", f"{work} failed: {type(e).__name__}", "inference_error")


def registered_batch_size(context: Any) -> int:
    """The batch size TorchServe registered the model with (the register call's or the archive
    model-config's `batchSize`, whichever TorchServe used): the worker gets it as a system property.
    The archive's own `batchSize` is not it: the auto-benchmark strips it and registers its own."""
    value = context.system_properties.get("batch_size")
    return int(value) if value else int((context.model_yaml_config or {}).get("batchSize", 1))


def url_path(context: Any, idx: int) -> str:
    """The path after /predictions/<model>/<version>/ (TorchServe's `url_path` header), '' if none."""
    try:
        value = context.get_request_header(idx, "url_path")
    except (KeyError, IndexError, AttributeError):
        value = None
    return _text(value or "").strip("/")


def _text(value: Any) -> str:
    """A header name or value as TorchServe hands it over (bytes from the frontend, str in tests)."""
    return bytes(value).decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
