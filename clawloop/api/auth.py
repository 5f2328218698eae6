"""Who may call what: user keys, per-user session owners, and the one rule of every admin route.

Keys travel as ``Authorization: Bearer <key>`` and are compared in constant time (``hmac.compare_digest``) against
every configured key (no early exit on the first match, so timing does not tell which key is close).

* **User keys** (``api_key``, ``api_keys``, ``api_keys_file``): with none configured every chat request passes.
  With per-user keys (``api_keys`` or ``api_keys_file`` set), each key is a principal of its own: its *owner*
  is a fingerprint of the key (never the key itself), stored with each turn, and sessions are scoped to it
  (``clawloop.api.sessions``). With only ``api_key`` all clients share one principal (owner ``""``).
* **Admin routes** (``/v1/trainer/*``, rollback and anything else that hands out run data or changes the served
  weights) call ``require_admin`` and nothing else; see its docstring for the rule. A user route whose answer
  has an admin version (``/v1/status``) asks ``is_admin`` instead of refusing.
* **Turn ids** a per-user key is given are masked (``TurnIdMask``): the store numbers all turns in one sequence,
  and a key that saw its own ids grow would learn how much everyone else talks to the server.

The design and the threat model are written up in docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request

from clawloop.api.errors import APIError
from clawloop.config import ConfigError, ServingSettings


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
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                     expected.encode("utf-8"))


def owner_of(key: str) -> str:
    """The durable, non-secret name of a per-user key: a truncated SHA-256 of it."""
    return "k_" + hashlib.sha256(b"clawloop-owner\0" + key.encode("utf-8")).hexdigest()[:24]


def _unauthorised(what: str, missing: bool) -> APIError:
    message = f"Missing {what}: send 'Authorization: Bearer <key>'." if missing else f"Incorrect {what} provided."
    return APIError(401, message, "invalid_request_error", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def require_key(request: Request, expected: str, what: str = "API key") -> None:
    """Raise 401 unless the request carries ``expected`` (no-op when ``expected`` is empty)."""
    if not expected:
        return
    token = bearer_token(request)
    if token is None:
        raise _unauthorised(what, True)
    if not keys_match(token, expected):
        raise _unauthorised(what, False)


def read_keys_file(path: str | Path) -> list[str]:
    """Keys of ``api_keys_file``: one per line, blank lines and ``#`` comments ignored."""
    keys = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def check_keys_file(config: ServingSettings) -> None:
    """Before a server loads anything: ``api_keys_file``, when set, must read and hold at least one key. A file
    that is missing would otherwise fail start-up only after the models have loaded, and an empty one would serve
    everyone without a key (and, under per-user policies, give no user a policy of their own)."""
    path = config.api_keys_file
    if not path:
        return
    try:
        keys = read_keys_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"api_keys_file {path} cannot be read ({getattr(exc, 'strerror', None) or exc}); it "
                          "holds the users' API keys, one per line") from None
    if not keys:
        raise ConfigError(f"api_keys_file {path} holds no key (one per line; blank lines and # comments are "
                          "skipped): a server given a keys file would then answer anyone without a key. Add the "
                          "users' keys, or drop api_keys_file to serve without keys")


@dataclass(frozen=True)
class KeyRing:
    """The user keys of a server and whether they are per-user (each key owns its sessions)."""

    keys: tuple[str, ...]
    per_user: bool

    @classmethod
    def from_config(cls, config: ServingSettings) -> "KeyRing":
        """From the serving settings (a ``Config`` is one): ``api_key``, ``api_keys`` and ``api_keys_file``."""
        extra = [k for k in config.api_keys if k]
        keys_file = config.api_keys_file
        if keys_file:
            extra += read_keys_file(keys_file)
        keys = ([config.api_key] if config.api_key else []) + extra
        return cls(tuple(dict.fromkeys(keys)), per_user=bool(extra))

    def owner(self, request: Request) -> str:
        """The caller's owner name ("" when keys are not per-user); 401 when a key is needed and not given."""
        if not self.keys:
            return ""
        token = bearer_token(request)
        if token is None:
            raise _unauthorised("API key", True)
        hit = None
        for key in self.keys:  # no early exit: every key is compared
            if keys_match(token, key):
                hit = key
        if hit is None:
            raise _unauthorised("API key", False)
        return owner_of(hit) if self.per_user else ""


class TurnIdMask:
    """The turn ids a per-user key is shown: ``turn_<24 hex>``, an HMAC-SHA256 of (owner, the store's id) under a
    secret kept in the run's store (meta ``turn_id_secret``). Stable across restarts and the same wherever the
    turn is named (``turn_id``, ``paired_turn_id``, ``dropped_turn_id``), different per owner, and without the
    secret they say nothing about how many turns other keys stored. The shared namespace (owner ``""``) is shown
    the store's ids, as everyone in it can see everything anyway."""

    SECRET_META_KEY = "turn_id_secret"

    def __init__(self, secret: bytes | None):
        self.secret = secret

    @classmethod
    def of_store(cls, store: Any) -> "TurnIdMask":
        """The mask of the run ``store`` belongs to (its secret is created on first use)."""
        secret = store.get_meta(cls.SECRET_META_KEY)
        if secret is None:
            secret = secrets.token_hex(32)
            store.set_meta(cls.SECRET_META_KEY, secret)
        return cls(bytes.fromhex(secret))

    @classmethod
    def unused(cls) -> "TurnIdMask":
        """For servers without per-user keys, where every owner is ``""``."""
        return cls(None)

    def public(self, owner: str, turn_id: int | None) -> int | str | None:
        if turn_id is None or not owner:
            return turn_id
        if self.secret is None:
            raise RuntimeError("per-user owners need a TurnIdMask made by TurnIdMask.of_store")
        digest = hmac.new(self.secret, f"{owner}\x1f{turn_id}".encode("utf-8"), hashlib.sha256).hexdigest()
        return "turn_" + digest[:24]


def require_user(request: Request) -> str:
    """Check the user key of ``request`` against the app's ``KeyRing``; returns the caller's owner name."""
    ring: KeyRing = request.app.state.keyring
    return ring.owner(request)


# ---------------------------------------------------------------------------------------------- admin


def is_loopback_host(host: str) -> bool:
    """``localhost``, ``*.localhost`` or a loopback IP (brackets and a ``:port`` allowed)."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_origin(request: Request) -> bool:
    """True when the request carries no ``Origin`` (not sent by a browser page) or one equal to its own host."""
    origin = request.headers.get("origin")
    if origin is None:
        return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == request.headers.get("host", "").lower()


def require_admin(request: Request, config: ServingSettings) -> None:
    """The one authorisation rule of every admin route; call it first thing in the route.

    1. ``admin_key`` set: the request must carry it (401 otherwise). Nothing else opens admin routes.
    2. No ``admin_key`` but user keys set: refused (403 ``admin_key_required``) unless ``admin_uses_api_key`` is
       on, in which case any valid user key opens them (401 otherwise).
    3. No key at all: only a request that reaches a server bound to loopback, from a loopback peer, and that is
       same-origin (no foreign ``Origin``/``Sec-Fetch-Site``) passes; anything else is 403.

    Raises ``APIError``; returns nothing when the call may proceed.
    """
    if config.admin_key:
        require_key(request, config.admin_key, "admin key")
        return
    ring: KeyRing = request.app.state.keyring if hasattr(request.app.state, "keyring") \
        else KeyRing.from_config(config)
    if ring.keys:
        if not config.admin_uses_api_key:
            raise APIError(403, "Admin routes need admin_key while user keys are set (or admin_uses_api_key).",
                           "permission_error", None, "admin_key_required")
        ring.owner(request)
        return
    peer = request.client.host if request.client is not None else ""
    if not (is_loopback_host(str(config.host)) and is_loopback_host(peer)):
        raise APIError(403, "Admin routes need an admin key unless the server is bound to loopback and called "
                            "from it.", "permission_error", None, "admin_key_required")
    if not same_origin(request):
        raise APIError(403, "Admin routes refuse cross-origin requests.", "permission_error", None,
                       "cross_origin")


def is_admin(request: Request, config: ServingSettings) -> bool:
    """Whether ``request`` passes ``require_admin``, for a route that answers others too (with less)."""
    try:
        require_admin(request, config)
    except APIError:
        return False
    return True
