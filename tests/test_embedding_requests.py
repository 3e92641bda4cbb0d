"""Request parsing for the embedding handler: every shape we accept and every error we give."""
import json

import pytest

from servekit.handlers.common import RequestError
from servekit.handlers.embedding_requests import parse_embedding_request


def parse(body, route="", max_texts=4, max_chars=50):
    return parse_embedding_request({"body": body}, route, 384, max_texts, max_chars)


def test_plain_shapes():
    assert parse({"text": "hi"}).texts == ["hi"]
    assert parse({"text": ["a", "b"]}).texts == ["a", "b"]
    assert parse(["a", "b"]).texts == ["a", "b"]
    assert parse("just text").texts == ["just text"]
    assert parse(bytearray(b"raw bytes")).texts == ["raw bytes"]
    assert parse(b'{"text": "from bytes"}').texts == ["from bytes"]
    assert not parse({"text": "hi"}).openai


def test_openai_shape():
    r = parse({"input": ["a", "b"], "model": "m", "encoding_format": "base64"}, route="v1/embeddings")
    assert (r.texts, r.openai, r.encoding_format, r.model) == (["a", "b"], True, "base64", "m")
    assert parse({"input": "one", "dimensions": 384}, route="v1/embeddings").texts == ["one"]


@pytest.mark.parametrize("body,route,status,code", [
    ({"input": []}, "v1/embeddings", 400, "empty_input"),
    ({"input": [""]}, "v1/embeddings", 400, "empty_input"),
    ({"input": "  "}, "v1/embeddings", 400, "empty_input"),
    ({"input": [1, 2]}, "v1/embeddings", 400, "invalid_type"),
    ({"input": {"a": 1}}, "v1/embeddings", 400, "invalid_type"),
    ({"model": "x"}, "v1/embeddings", 400, "missing_field"),
    ({"input": "a", "foo": 1}, "v1/embeddings", 400, "unknown_field"),
    ({"input": "a", "encoding_format": "hex"}, "v1/embeddings", 400, "invalid_value"),
    ({"input": "a", "dimensions": 385}, "v1/embeddings", 400, "invalid_value"),
    ({"input": "a", "dimensions": 0}, "v1/embeddings", 400, "invalid_value"),
    (["a"], "v1/embeddings", 400, "invalid_type"),
    ({"input": ["a"] * 5}, "v1/embeddings", 413, "too_many_inputs"),
    ({"input": "x" * 51}, "v1/embeddings", 413, "input_too_long"),
    ({"txt": "a"}, "", 400, "missing_field"),
    ({"text": "a", "extra": 1}, "", 400, "unknown_field"),
    ({"text": None}, "", 400, "invalid_type"),
    (b"\xff\xfe\x00garbage", "", 400, "invalid_utf8"),
    (b'{"text": "unterminated', "", 400, "invalid_json"),
    (b'{"text": NaN}', "", 400, "invalid_json"),
    ({"text": "a", "n": float("nan")}, "", 400, "invalid_number"),
    ({"text": "a"}, "v2/other", 404, "unknown_route"),
    (b"[" * 100 + b"]" * 100, "", 400, "json_too_deep"),
])
def test_errors(body, route, status, code):
    with pytest.raises(RequestError) as e:
        parse(body, route)
    assert (e.value.status, e.value.code) == (status, code)
    assert e.value.message


def test_missing_body():
    with pytest.raises(RequestError) as e:
        parse_embedding_request({}, "", 384, 4, 50)
    assert e.value.code == "empty_body"


@pytest.mark.parametrize("body,key", [
    (b'{"input": ["a cat"], "model": "m", "input": ["a dog"]}', "input"),
    (b'{"input": [{"x": 1, "x": 2}]}', "x"),                    # nested, however deep
    (b'{"input": "a", "inp\\u0075t": "b"}', "input"),          # the same key spelled with an escape
    (b'{"input": "a", "input": "\\u003a"}', "input"),           # a colon spelled as an escape hides no key
    (b'{"input": "ten: 10:30", "model": "m", "model": "n"}', "model"),
    ("\ufeff{\"input\": \"a\", \"input\": \"b\"}", "input"),     # text body with a byte order mark
])
def test_duplicate_keys_get_a_400_naming_the_key(body, key):
    """The worker hands bodies over unparsed (servekit.handlers.worker_io), so that a duplicate key
    is refused instead of TorchServe's json.loads silently keeping its last value."""
    with pytest.raises(RequestError) as e:
        parse(body, "v1/embeddings")
    assert (e.value.status, e.value.code) == (400, "duplicate_key")
    assert f"duplicate key '{key}'" in e.value.message


def test_bodies_without_duplicates_parse_as_json_does():
    """orjson parses; colons in texts, escapes and integers beyond 64 bits read exactly as json's."""
    from servekit.handlers.common import decode_body

    for body in (b'{"input": ["time: 10:30", "a:b:c"], "model": "m"}', b'{"input": "\\u003a \\u00e9"}',
                 b'{"a": {"b": [1, 2.5, true, null, "x"]}, "c": 123456789012345678901234567890}',
                 b'{"x": -18446744073709551617, "y": 1e300}', b'[{"k": 1}, {"k": 2}]'):
        assert decode_body({"body": bytearray(body)}) == json.loads(body)
    big = decode_body({"body": b'{"n": 123456789012345678901234567890}'})["n"]
    assert isinstance(big, int) and big == 123456789012345678901234567890


@pytest.mark.parametrize("route,kind,body,key", [
    ("v1/rerank", "rerank", b'{"query": "q", "documents": ["d"], "query": "r"}', "query"),
    ("rerank", "rerank", b'{"query": "q", "texts": ["a"], "texts": ["b"]}', "texts"),
    ("v1/score", "rerank", b'{"text_1": "a", "text_2": "b", "text_2": "c"}', "text_2"),
    ("v1/classify", "classify", b'{"input": ["a"], "model": "x", "model": "y"}', "model"),
    ("predict", "classify", b'{"inputs": "a", "inputs": "b"}', "inputs"),
])
def test_score_routes_refuse_duplicate_keys(route, kind, body, key):
    from servekit.handlers.score_requests import parse_score_request

    with pytest.raises(RequestError) as e:
        parse_score_request({"body": bytearray(body)}, route, kind, max_texts=10, max_chars=100)
    assert (e.value.status, e.value.code) == (400, "duplicate_key") and f"'{key}'" in e.value.message
