"""Request parsing for the embedding handler: every shape we accept and every error we give."""
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
