"""API-key checks: ``Authorization: Bearer <key>`` compared in constant time (``hmac.compare_digest``).

With no key configured every request passes. The admin key guards operations that change or expose the run
(records, checkpoints); when no admin key is set those fall back to the API key.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from clawloop.api.errors import APIError


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip()


def keys_match(given: str | None, expected: str) -> bool:
    # Both sides as bytes: compare_digest on str only accepts ASCII, and a non-ASCII key must not crash.
    return given is not None and hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def require_key(request: Request, expected: str, what: str = "API key") -> None:
    """Raise 401 unless the request carries ``expected`` (no-op when ``expected`` is empty)."""
    if not expected:
        return
    token = bearer_token(request)
    if token is None:
        raise APIError(401, f"Missing {what}: send 'Authorization: Bearer <key>'.", "invalid_request_error",
                       None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    if not keys_match(token, expected):
        raise APIError(401, f"Incorrect {what} provided.", "invalid_request_error", None, "invalid_api_key",
                       {"WWW-Authenticate": "Bearer"})


def require_admin(request: Request, admin_key: str, api_key: str) -> None:
    require_key(request, admin_key or api_key, "admin key" if admin_key else "API key")
