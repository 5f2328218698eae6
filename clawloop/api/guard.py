"""Two ASGI middlewares around the whole app: the browser guard and the last-resort error catcher.

``BrowserGuard`` refuses what only a web page in a user's browser would send, before any route runs
(docs/security.md explains the policy):

* a ``Host`` that is not a loopback name while the server is bound to loopback (DNS rebinding: a foreign
  domain resolved to 127.0.0.1), or not in ``allowed_hosts`` when that is set: 403 ``forbidden_host``;
* a foreign ``Origin`` (neither a loopback page, nor the server's own origin, nor in ``allowed_origins``), the
  opaque origin ``null``, or ``Sec-Fetch-Site: cross-site`` without an Origin: 403 ``forbidden_origin``;
* a request body whose ``Content-Type`` is not JSON (``text/plain`` and form posts are what a page can send
  cross-site without a CORS preflight): 415 ``unsupported_media_type``.

``CatchAll`` turns any exception that escapes the routes into an OpenAI-shaped 500 (or a 503 when the run
directory's disk or database refuses writes) *as a response*: Starlette's own last-resort handler re-raises
after answering, which makes the server close the keep-alive connection, so pooled client requests behind it
fail with resets. A stream whose headers are already out reports the same error in its last event
(``clawloop.api.app``), built by the same functions here, so the two kinds of request fail alike.
"""

from __future__ import annotations

import errno
import json
import logging
import sqlite3
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clawloop.api.auth import is_loopback_host
from clawloop.api.errors import error_body
from clawloop.config import ServingSettings

log = logging.getLogger("clawloop.api")

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


def is_json_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def storage_unavailable_body() -> dict[str, Any]:
    """The error of a request that needed a write the run directory refused (503 when it can still be a status)."""
    return error_body("The server cannot write its run directory right now (disk full or unavailable); nothing "
                      "was stored for this request. Retry later.", "server_error", None, "storage_unavailable")


def storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the run directory cannot be written (disk full, read-only, I/O error, locked db)."""
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        return True
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return any(s in text for s in ("disk is full", "disk i/o", "readonly", "locked", "unable to open"))
    return False


class BrowserGuard:
    """Refuse foreign Host/Origin and non-JSON bodies (see the module docstring)."""

    def __init__(self, app: ASGIApp, config: ServingSettings):
        self.app = app
        self.bound_to_loopback = is_loopback_host(str(config.host))
        self.allowed_hosts = {h.strip().lower() for h in config.allowed_hosts if h.strip()}
        self.allowed_origins = {o.strip().lower().rstrip("/") for o in config.allowed_origins if o.strip()}

    def host_ok(self, host: str | None) -> bool:
        if host is None or "*" in self.allowed_hosts or is_loopback_host(host):
            return True
        if host.strip().lower() in self.allowed_hosts or _host_name(host) in self.allowed_hosts:
            return True
        return not self.bound_to_loopback and not self.allowed_hosts

    def origin_ok(self, origin: str | None, fetch_site: str | None, host: str | None) -> bool:
        if "*" in self.allowed_origins:
            return True
        if origin is None:
            return fetch_site != "cross-site"
        origin = origin.strip().lower().rstrip("/")
        if origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed frames, file:) and other opaque origins
        return is_loopback_host(parts.netloc) or (host is not None and parts.netloc == host.strip().lower())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        host = headers.get("host")
        if not self.host_ok(host):
            await send_json(send, 403, error_body(
                f"Host {host!r} is not served here (add it to allowed_hosts to serve it).", "permission_error",
                None, "forbidden_host"))
            return
        if not self.origin_ok(headers.get("origin"), headers.get("sec-fetch-site"), host):
            await send_json(send, 403, error_body(
                "Cross-origin requests from web pages are refused (add the origin to allowed_origins to allow "
                "it).", "permission_error", None, "forbidden_origin"))
            return
        has_body = headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers
        if scope.get("method") in BODY_METHODS and has_body and not is_json_type(headers.get("content-type", "")):
            await send_json(send, 415, error_body(
                "Request bodies must be JSON: send 'Content-Type: application/json'.", "invalid_request_error",
                None, "unsupported_media_type"))
            return
        await self.app(scope, receive, send)


class CatchAll:
    """Answer an escaped exception with a JSON 500/503 and keep the connection (see the module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:  # noqa: BLE001 - this is the last resort
            if started:  # the answer is on its way; nothing sensible can be sent any more
                log.error("error after the response started on %s", scope.get("path"), exc_info=exc)
                return
            if storage_failure(exc):
                log.error("storage failure on %s %s: %s", scope.get("method"), scope.get("path"), exc)
                await send_json(send, 503, storage_unavailable_body(), [(b"retry-after", b"5")])
                return
            log.error("internal error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await send_json(send, 500, error_body("The server had an internal error while handling the request.",
                                                  "server_error", None, "internal_error"))
