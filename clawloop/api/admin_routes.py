"""Admin routes for the run's published versions (admin key, the same check as the trainer routes):

* ``POST /v1/admin/rollback {"version": N}`` (per-user policies: ``{"version": N, "user": "k_…"}``, a version of
  that user's own or 0, the base model) — serve kept version ``N`` again, at once: the embedded trainer loads
  its weights (and its optimizer state when kept), the engine swaps them in between requests under the version
  number ``N`` (the same weights, so the same number), and training continues from them. Requests are answered
  throughout; the swap waits only for a training step in progress. 404 when the version is not kept; 409 when
  this process has no embedded trainer (its weights come from elsewhere), when the version never committed (a
  crash came between its publication and its step's commit: ``uncommitted``) or when its files are damaged
  (``version_damaged``; nothing is loaded, the served weights stay as they are).
* ``GET /v1/admin/versions`` — the version history: every version with its step, time, status and gate
  verdict, the gate's counters and the recent gate/rollback/requeue events.

See docs/publication-gate.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from clawloop.api.auth import require_admin
from clawloop.api.bodies import read_json_object
from clawloop.api.errors import APIError
from clawloop.store import Store
from clawloop.trainer.loop import TrainerStopped
from clawloop.trainer.per_user import OWNER_NAME, user_dir
from clawloop.trainer.versions import DamagedVersion

log = logging.getLogger(__name__)

RECENT_EVENTS = 50


def mount_admin_routes(app: FastAPI, store: Store, config: Any, trainer: Callable[[], Any]) -> None:
    """Add the ``/v1/admin/*`` version routes; ``trainer()`` returns the embedded ``OnlineTrainer`` or None."""

    async def rollback(request: Request) -> Any:
        require_admin(request, config)
        body = await read_json_object(request, config.max_body_bytes)
        version, user = body.get("version"), body.get("user")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2 ** 63:
            raise APIError(400, "'version' must be an integer >= 0.", "invalid_request_error", "version", None)
        online = trainer()
        if online is None or (online.core is None and online.policies is None):
            raise APIError(409, "Rollback needs the embedded trainer of this run (this server has none).",
                           "invalid_request_error", None, "no_trainer")
        if online.policies is not None:
            if not isinstance(user, str) or not OWNER_NAME.match(user):
                raise APIError(400, "Every user has a policy of their own here (policy_scope per_user): 'user' "
                               "names whose to roll back (their k_… name).", "invalid_request_error", "user", None)
            if not user_dir(config.run_dir, user).is_dir():
                raise APIError(404, f"User {user} has no policy of their own in this run (nothing of theirs has "
                               "trained).", "invalid_request_error", "user", "user_not_found")
            owned = {int(v["version"]) for v in await asyncio.to_thread(store.versions, owner=user)}
            if version != 0 and version not in owned:
                raise APIError(404, f"Version {version} is not one of user {user}'s versions.",
                               "invalid_request_error", "version", "version_not_found")
        elif user is not None:
            raise APIError(400, "'user' is for per-user policies; this run trains one shared policy.",
                           "invalid_request_error", "user", None)
        if await asyncio.to_thread(store.version_status, version) == "uncommitted":
            raise APIError(409, f"Version {version} cannot be served again: the process stopped after publishing "
                           "it and before committing its step, so its samples were trained again after the restart "
                           "(status uncommitted). The served version is unchanged.", "invalid_request_error",
                           "version", "version_uncommitted")
        try:
            return {"object": "clawloop.rollback", **await online.rollback(version, user)}
        except FileNotFoundError as exc:
            if user is not None and not user_dir(config.run_dir, user).is_dir():  # forgotten while it waited
                raise APIError(404, f"User {user} has no policy of their own in this run.", "invalid_request_error",
                               "user", "user_not_found") from None
            raise APIError(404, str(exc), "invalid_request_error", "version", "version_not_found") from None
        except TrainerStopped as exc:
            raise APIError(503, f"{exc}; roll back once the server runs again.", "server_error", None,
                           "trainer_stopping") from None
        except DamagedVersion as exc:
            log.error("rollback to version %d refused: %s", version, exc)
            raise APIError(409, f"Version {version} cannot be served again: its folder is damaged ({exc.problem}). "
                           "The served version is unchanged.", "invalid_request_error", "version",
                           "version_damaged") from None
        except ValueError as exc:
            raise APIError(409, str(exc), "invalid_request_error", "version", None) from None

    async def versions(request: Request) -> Any:
        require_admin(request, config)
        rows, events = await asyncio.gather(asyncio.to_thread(store.versions), asyncio.to_thread(store.events))
        online = trainer()
        return {
            "object": "clawloop.versions",
            "serving": online.serving_versions() if online is not None else None,
            "gate": online.gate_status() if online is not None else {},
            "versions": [{k: v for k, v in r.items() if k != "evidence"} | _verdict(r["evidence"]) for r in rows],
            "events": [{k: v for k, v in e.items() if k != "detail"} | _verdict(e["detail"])
                       for e in events[-RECENT_EVENTS:]],
        }

    app.add_api_route("/v1/admin/rollback", rollback, methods=["POST"])
    app.add_api_route("/v1/admin/versions", versions, methods=["GET"])


def _verdict(evidence: dict[str, Any]) -> dict[str, Any]:
    """The short form of a gate verdict (the probe answers stay in the store and the version folder)."""
    keep = ("accepted", "reasons", "guard_pass", "kl", "kl_measured", "gate", "steps", "restored_version",
            "from_version", "rolled_back", "optimizer")
    return {k: evidence[k] for k in keep if k in evidence}
