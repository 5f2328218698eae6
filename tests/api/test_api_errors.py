"""Every bad input gets OpenAI's error JSON with the right 4xx; only a true internal error answers 500."""

from __future__ import annotations

import json
import logging
import random

import httpx
import openai
import pytest

# Raw bodies carry the JSON content type: clawloop refuses other bodies (415) before reading them.
JSON_TYPE = {"Content-Type": "application/json"}
URL = "/v1/chat/completions"
OK = {"model": "clawloop", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(r: httpx.Response, status: int, param=None, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def with_(**changes):
    body = dict(OK)
    body.update(changes)
    return body


BAD_BODIES = [
    # (body, param, code)
    (with_(messages=None), "messages", "missing_required_parameter"),
    ({"model": "clawloop"}, "messages", "missing_required_parameter"),
    (with_(messages=[]), "messages", "empty_array"),
    (with_(messages="hi"), "messages", "invalid_type"),
    (with_(messages=["hi"]), "messages[0]", "invalid_type"),
    (with_(messages=[{"content": "x"}]), "messages[0].role", "missing_required_parameter"),
    (with_(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "invalid_value"),
    (with_(messages=[{"role": 3, "content": "x"}]), "messages[0].role", "invalid_type"),
    (with_(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter"),
    (with_(messages=[{"role": "user", "content": 12}]), "messages[0].content", "invalid_type"),
    (with_(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages[0].content[0].text",
     "invalid_type"),
    (with_(messages=[{"role": "user", "content": [{"text": "no type"}]}]), "messages[0].content[0].type",
     "invalid_type"),
    (with_(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"function": "f"}]}]),
     "messages[0].tool_calls[0].function", "invalid_type"),
    (with_(n=2), "n", "unsupported_value"),
    (with_(n="1"), "n", "invalid_type"),
    (with_(n=0), "n", "invalid_value"),
    (with_(model=5), "model", "invalid_type"),
    (with_(temperature="hot"), "temperature", "invalid_type"),
    (with_(temperature=2.5), "temperature", "invalid_value"),
    (with_(temperature=True), "temperature", "invalid_type"),
    (with_(top_p=0), "top_p", "invalid_value"),
    (with_(top_p=1.5), "top_p", "invalid_value"),
    (with_(max_tokens=0), "max_tokens", "invalid_value"),
    (with_(max_tokens="5"), "max_tokens", "invalid_type"),
    (with_(max_tokens=1.5), "max_tokens", "invalid_type"),
    (with_(max_completion_tokens=-1), "max_completion_tokens", "invalid_value"),
    (with_(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
    (with_(stop=[1]), "stop[0]", "invalid_type"),
    (with_(stop=""), "stop", "invalid_value"),
    (with_(stop=["\u0001" * 20_000]), "stop", "invalid_value"),  # each new token is checked against its length
    (with_(seed="x"), "seed", "invalid_type"),
    (with_(stream="yes"), "stream", "invalid_type"),
    (with_(stream_options={"include_usage": "yes"}), "stream_options.include_usage", "invalid_type"),
    (with_(logprobs="true"), "logprobs", "invalid_type"),
    (with_(logprobs=True, top_logprobs=50), "top_logprobs", "invalid_value"),
    (with_(top_logprobs=2), "top_logprobs", "invalid_value"),
    (with_(tools={"type": "function"}), "tools", "invalid_type"),
    (with_(tools=[{"type": "function"}]), "tools[0].function", "invalid_type"),
    (with_(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type", "invalid_value"),
    (with_(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name", "invalid_value"),
    (with_(tool_choice="sometimes"), "tool_choice", "invalid_value"),
    (with_(tool_choice="required"), "tool_choice", "invalid_value"),
    (with_(presence_penalty=5), "presence_penalty", "invalid_value"),
    (with_(turn_type="training"), "turn_type", "invalid_value"),
    (with_(session_id=""), "session_id", "invalid_value"),
    (with_(session_id=7), "session_id", "invalid_type"),
    (with_(session_done="maybe"), "session_done", "invalid_value"),
    ([OK], None, "invalid_body"),
    ("just a string", None, "invalid_body"),
]


@pytest.mark.parametrize("body, param, code", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_bodies_get_400_naming_the_field(http, body, param, code):
    assert_error(http.post(URL, json=body), 400, param, code)


def test_bad_bytes_and_headers(http, server):
    assert_error(http.post(URL, content=b"{not json", headers=JSON_TYPE), 400, code="invalid_json")
    assert_error(http.post(URL, content=b"", headers=JSON_TYPE), 400, code="invalid_body")
    assert_error(http.post(URL, content=b"\xff\xfe{}", headers=JSON_TYPE), 400, code="invalid_json")
    assert_error(http.post(URL, content=b"[" * 100_000, headers=JSON_TYPE), 400, code="invalid_json")
    assert_error(http.post(URL, json=OK, headers={"X-Turn-Type": "other"}), 400, "X-Turn-Type")
    assert_error(http.post(URL, json=OK, headers={"X-Session-Done": "perhaps"}), 400, "X-Session-Done")
    assert_error(http.post(URL, json=OK, headers={"X-Session-Id": "x" * 300}), 400, "X-Session-Id")
    assert_error(http.post("/sessions/%20/v1/chat/completions", json=OK), 400, "session_id")
    assert server.store.turns() == []  # nothing half-served was stored


def test_prompt_over_the_context_length(http, server):
    long = with_(messages=[{"role": "user", "content": "lighthouse " * 2500}])
    err = assert_error(http.post(URL, json=long), 400, "messages", "context_length_exceeded")
    assert "2048" in err["message"]
    assert_error(http.post(URL, json=with_(max_tokens=4000)), 400, "max_tokens", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as info:
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="clawloop", messages=long["messages"], stream=True)
    assert info.value.code == "context_length_exceeded"


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404, code="not_found")
    assert_error(http.post("/v2/chat/completions", json=OK), 404, code="not_found")
    assert_error(http.get(URL), 405, code="method_not_allowed")
    assert_error(http.delete("/v1/models"), 405, code="method_not_allowed")
    assert_error(http.get("/v1/sessions/x/end"), 405)


def test_body_too_large_by_header_and_by_actual_size(make_server):
    srv = make_server(max_body_bytes=4096)
    big = with_(messages=[{"role": "user", "content": "x" * 10_000}])
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert_error(c.post(URL, json=big), 413, code="request_too_large")

        def chunks():  # no Content-Length: the limit must hold on what is actually read
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        assert_error(c.post(URL, content=chunks(), headers=JSON_TYPE), 413, code="request_too_large")
        assert c.post(URL, json=OK).status_code == 200


def test_api_key_is_required_when_configured(make_server):
    srv = make_server(api_key="s3cret-key")
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert_error(c.post(URL, json=OK), 401, code="invalid_api_key")
        assert_error(c.post(URL, json=OK, headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
        assert_error(c.post(URL, json=OK, headers={"Authorization": "Basic s3cret-key"}), 401)
        assert_error(c.post(URL, json=OK, headers={"Authorization": "Bearer s3cret-këy".encode()}), 401)
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.get("/v1/status"), 401)
        assert_error(c.post("/v1/sessions/a/end"), 401)
        assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="s3cret-key", max_retries=0)
    assert good.chat.completions.create(model="clawloop", messages=OK["messages"], max_tokens=2).choices
    assert srv.store.turns()[0].session_id  # only the authorised request was served


def test_engine_failure_and_internal_errors_are_500_and_logged(make_server, tiny_model_path, caplog):
    from clawloop.engines.hf import HFEngine

    closed = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=1)
    closed.close_sync()
    srv = make_server(engine=closed)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert_error(c.post(URL, json=OK), 500, code="engine_error")

        def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        srv.service.renderer.render = broken
        with caplog.at_level(logging.ERROR):
            err = assert_error(c.post(URL, json=OK), 500, code="internal_error")
        assert "a bug" not in err["message"] and err["type"] == "server_error"
        assert any("internal error" in r.getMessage() for r in caplog.records)


def _mutations(rng: random.Random):
    """Malformed variants of a valid request: wrong types, odd values, missing and extra pieces."""
    odd = [None, 0, -1, 1.5, 1e308, float("nan"), "", "x" * 2000, [], {}, True, [None], {"a": [1, {"b": None}]},
           "\u0000", "😀", [[]], -(2**70)]
    keys = ["model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed",
            "n", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "session_id",
            "turn_type", "session_done", "user", "logit_bias", "response_format"]
    for _ in range(160):
        body = json.loads(json.dumps(OK))
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(keys)] = rng.choice(odd)
        yield body
    for _ in range(80):
        msg = {"role": rng.choice(["user", "system", "assistant", "tool", "developer", "robot", None, 1]),
               "content": rng.choice(odd + ["fine"])}
        if rng.random() < 0.3:
            msg["tool_calls"] = rng.choice(odd + [[{"function": {"name": "f", "arguments": rng.choice(odd)}}]])
        if rng.random() < 0.2:
            msg["content"] = [rng.choice(odd + [{"type": "text", "text": rng.choice(odd)}, {"type": "image_url"}])]
        yield {"messages": [msg], "max_tokens": 2}


def test_fuzzed_bodies_never_get_a_500(http):
    rng = random.Random(20240607)
    statuses = []
    for body in _mutations(rng):
        r = http.post(URL, content=json.dumps(body, allow_nan=True).encode(), headers=JSON_TYPE)
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            assert_error(r, r.status_code)
        statuses.append(r.status_code)
    raw = [b"", b"null", b"0", b"{", b"}", b'{"messages": [', b"\x00\x01", b'{"messages": "\xff"}', b"[]" * 1000,
           b'{"messages": [{"role": "user", "content": "a"}]}' * 2]
    for blob in raw:
        r = http.post(URL, content=blob, headers=JSON_TYPE)
        assert 400 <= r.status_code < 500
        assert_error(r, r.status_code)
    assert statuses.count(400) > 100 and 200 in statuses  # the fuzz covered both sides
