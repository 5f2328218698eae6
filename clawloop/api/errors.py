"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with a fitting HTTP status.

Every client mistake is an ``APIError`` with a 4xx status, raised anywhere in the request path and turned into
JSON by one handler. Routing errors (unknown path 404, wrong method 405) and anything Starlette raises are
reshaped the same way. Only a true internal error answers 500, and it is logged with its traceback; the body
then says nothing about the internals.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("clawloop.api")


class APIError(Exception):
    """A request clawloop will not serve, with the status and OpenAI error fields to answer with."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


# Status -> (type, code) for errors raised by the framework rather than by clawloop.
_FRAMEWORK_ERRORS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_, code = _FRAMEWORK_ERRORS.get(exc.status_code, ("invalid_request_error", None))
        if exc.status_code == 404:
            message = f"Unknown path: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        if exc.status_code >= 500:
            type_ = "server_error"
        return JSONResponse(error_body(message, type_, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"Invalid request: {first.get('msg', 'malformed input')}",
                                       "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left while its body was being read: its doing, not a server fault (no 500 in the log and the
        # metrics for anyone who drops a connection half-way).
        log.info("client left during its request body on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("The client closed the request before its body was read.",
                                       "invalid_request_error", None, "client_closed_request"), status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("The server had an internal error while handling the request.",
                                       "server_error", None, "internal_error"), status_code=500)
