"""Requests the HTTP parser refuses (bad framing) answered in OpenAI's error shape, like every other refusal.

A malformed request line or header block, a bad or duplicate ``Content-Length``, a NUL in a header or a bad chunk
size never reaches the app: uvicorn's parser rejects it and, by default, answers a plain-text 400. An OpenAI client
then shows the user an unparsable body. ``OpenAIShapedFraming`` is uvicorn's own protocol (h11 or httptools,
whichever it would pick) with only that answer changed: a JSON 400 ``invalid_request_error`` with code
``malformed_http``. The connection still closes, as it must: after a framing error the parser cannot know where
the next request would start.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from clawloop.api.errors import error_body

MALFORMED_HTTP = "malformed_http"


def framing_error_response(message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole HTTP/1.1 400 response, bytes on the wire (the parser's state is past use, so it is written raw)."""
    body = json.dumps(error_body(f"Malformed HTTP request: {message}", "invalid_request_error", None,
                                 MALFORMED_HTTP)).encode("utf-8")
    head = [b"HTTP/1.1 400 Bad Request"]
    head += [name + b": " + value for name, value in default_headers]
    head += [b"content-type: application/json", b"content-length: " + str(len(body)).encode("ascii"),
             b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class OpenAIShapedFraming(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol, answering a framing error in OpenAI's shape (see the module docstring)."""

    def send_400_response(self, msg: str) -> None:
        self.transport.write(framing_error_response(msg, list(self.server_state.default_headers)))
        self.transport.close()
