"""Reading a request's JSON body within a size bound: one helper for every route (413 beyond the bound, 400 when
the body is empty, not JSON, outside the parser's limits, or not the object a route expects)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from clawloop.api import safejson
from clawloop.api.errors import APIError, bad_request

ADMIN_BODY_BYTES = 256 * 1024 * 1024
"""Bound on the trainer's own requests (a committed step carries its teacher scores; a teacher call up to 256
samples' ids): far above what they send, far below what would exhaust the server's memory."""


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """The decoded JSON body; 413 beyond ``max_bytes`` (declared or actually read), 400 when not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_n = int(declared)
        except ValueError:
            raise bad_request("Invalid Content-Length header.", None, "invalid_body") from None
        if declared_n > max_bytes:
            raise APIError(413, f"Request body too large: {declared_n} bytes (limit {max_bytes}).",
                           code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"Request body too large (limit {max_bytes} bytes).", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.", None, "invalid_body")
    try:
        return safejson.loads(raw)
    except safejson.JSONLimitError as exc:
        raise bad_request(f"The request body is outside the limits: {exc}.", exc.path or None, "invalid_json") \
            from None
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"The request body is not valid JSON: {str(exc)[:200]}", None, "invalid_json") from None


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """``read_json_body``, and 400 unless it is a JSON object."""
    body = await read_json_body(request, max_bytes)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_body")
    return body
