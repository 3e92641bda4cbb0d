"""Property-based fuzzing of the request parsers (no server): they raise RequestError and nothing else,
their errors are well-formed 4xx JSON, and whatever they accept the tokenizer can take."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from servekit.handlers.common import MAX_JSON_DEPTH, RequestError, decode_body, url_path
from servekit.handlers.embedding_requests import OPENAI_ROUTE, parse_embedding_request

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DIM, MAX_TEXTS, MAX_CHARS = 384, 8, 200

# Any Unicode text, lone surrogates included (a JSON "\ud800" escape decodes to one).
texts = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=60)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.sampled_from(["text", "input", "model", "encoding_format",
                                                              "dimensions", "user", "x"]) | texts, inner, max_size=5),
                           max_leaves=30)
# Bodies shaped like the real thing, with a fuzzed value in one place.
likely_bodies = st.one_of(
    st.fixed_dictionaries({"text": json_values}),
    st.fixed_dictionaries({"input": json_values}),
    st.fixed_dictionaries({"input": st.lists(texts, max_size=10)},
                          optional={"model": json_values, "encoding_format": json_values, "dimensions": json_values,
                                    "user": json_values}),
    st.lists(texts, max_size=10),
    json_values,
)
raw_bytes = st.binary(max_size=300) | texts.map(lambda t: t.encode("utf-8", "surrogatepass"))
routes = st.sampled_from(["", OPENAI_ROUTE, "v1/chat/completions", "v1/embeddings/", "../v1/embeddings"]) | texts


def _as_request(body: object) -> dict:
    """What TorchServe's worker hands the handler: parsed JSON, text or bytes under 'body'."""
    return {"body": body}


def check_error(e: RequestError) -> None:
    assert 400 <= e.status < 500, e
    parsed = json.loads(e.body())
    assert set(parsed) == {"error"} and parsed["error"]["message"] and parsed["error"]["type"]
    assert isinstance(parsed["error"]["code"], str)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    from servekit.archive import minilm_weights

    return Tokenizer.from_file(str(minilm_weights()[0].parent / "tokenizer.json"))


def parse(request: dict, route: str):
    return parse_embedding_request(request, route, DIM, MAX_TEXTS, MAX_CHARS)


def check_accepted(req, tokenizer) -> None:
    assert isinstance(req.texts, list) and 1 <= len(req.texts) <= MAX_TEXTS
    for t in req.texts:
        assert isinstance(t, str) and t.strip() and len(t) <= MAX_CHARS
        t.encode("utf-8")  # no lone surrogates reach the tokenizer
    assert req.encoding_format in ("float", "base64")
    tokenizer.encode_batch(req.texts)  # what the handler does with the whole batch


@FUZZ
@given(body=likely_bodies, route=routes)
@example(body="\ud800", route="")  # a text body already decoded, holding an unpaired surrogate
def test_parser_on_parsed_json_only_raises_request_error(body, route, tokenizer):
    try:
        req = parse(_as_request(body), route)
    except RequestError as e:
        check_error(e)
    else:
        check_accepted(req, tokenizer)


@FUZZ
@given(body=raw_bytes, route=routes, as_bytearray=st.booleans())
def test_parser_on_raw_bytes_only_raises_request_error(body, route, as_bytearray, tokenizer):
    try:
        req = parse(_as_request(bytearray(body) if as_bytearray else body), route)
    except RequestError as e:
        check_error(e)
    else:
        check_accepted(req, tokenizer)


@FUZZ
@given(body=likely_bodies)
def test_serialized_and_parsed_bodies_get_the_same_answer(body):
    """TorchServe hands JSON over parsed, or as bytes when it could not parse it: same verdict either way."""
    try:
        raw = json.dumps(body, allow_nan=True).encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates cannot be UTF-8 encoded; json.dumps escapes them, so this is unreachable
    outcomes = []
    for request in (_as_request(body), _as_request(raw)):
        try:
            r = parse(request, OPENAI_ROUTE)
            outcomes.append(("ok", r.texts, r.encoding_format))
        except RequestError as e:
            outcomes.append(("error", e.status))
    if isinstance(body, (dict, list)):
        assert outcomes[0] == outcomes[1]


@FUZZ
@given(request=st.dictionaries(texts, json_values | raw_bytes, max_size=4))
def test_decode_body_on_any_request_dict(request):
    try:
        value = decode_body(request)
    except RequestError as e:
        check_error(e)
    else:
        json.dumps(value)  # a plain JSON value or text
        assert not (isinstance(value, float) and not math.isfinite(value))


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(min_value=1, max_value=200_000), opener=st.sampled_from(["[", '{"a":']),
       as_bytes=st.booleans())
def test_deep_nesting_is_a_request_error_not_a_crash(depth, opener, as_bytes):
    closer = "]" if opener == "[" else "}"
    raw = (opener * depth + "1" + closer * depth).encode()
    if as_bytes:
        request = _as_request(raw)
    else:
        try:
            request = _as_request(json.loads(raw))
        except RecursionError:  # TorchServe forwards the bytes when its own json.loads gives up
            request = _as_request(raw)
    try:
        decode_body(request)
    except RequestError as e:
        check_error(e)
        assert depth + 1 > MAX_JSON_DEPTH  # the innermost scalar counts as a level
    else:
        assert depth + 1 <= MAX_JSON_DEPTH


class FuzzContext:
    def __init__(self, value=None, exc: type[BaseException] | None = None) -> None:
        self.value, self.exc = value, exc

    def get_request_header(self, idx, key):
        if self.exc:
            raise self.exc()
        return self.value


@FUZZ
@given(value=st.none() | texts | st.binary(max_size=40),
       exc=st.sampled_from([None, KeyError, IndexError, AttributeError]))
def test_url_path_never_raises(value, exc):
    path = url_path(FuzzContext(value, exc), 0)
    assert isinstance(path, str) and not path.startswith("/") and not path.endswith("/")
