"""Requests the HTTP parser refuses get a 400 in OpenAI's error shape, not the server stack's plain text."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

BODY = b'{"model": "clawloop", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"

MALFORMED = {
    "content-length not a number": HEAD + b"Content-Length: abc\r\n\r\n" + BODY,
    "two different content-lengths": HEAD + b"Content-Length: %d\r\nContent-Length: 3\r\n\r\n" % len(BODY) + BODY,
    "NUL in a header": HEAD + b"X-Session-Id: a\x00b\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    "bad chunk size": HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n",
    "garbage request line": b"GET\x01 / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "header without a colon": b"GET /healthz HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n",
}


def exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        chunks = []
        while chunk := sock.recv(65536):  # the server closes the connection after a framing error
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_framing_is_an_openai_shaped_400(shared_server, case):
    reply = exchange(shared_server.port, MALFORMED[case])
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 400"), reply[:200]
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_http"
    assert error["message"].startswith("Malformed HTTP request")
    # The server goes on serving.
    assert httpx.get(shared_server.base_url + "/healthz", timeout=30).status_code == 200


def test_a_client_leaving_during_its_body_is_not_a_server_error(make_server, caplog):
    """Anyone can drop a connection half-way through a body: that is the client's doing (499), not a 500 in the
    log and the metrics."""
    import logging
    import time

    server = make_server()
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    metrics = ""
    while 'status="499"' not in metrics and time.monotonic() < deadline:
        time.sleep(0.2)
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'clawloop_http_requests_total{method="POST",route="/v1/chat/completions",status="499"} 1' in metrics
    assert 'status="500"' not in metrics
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
