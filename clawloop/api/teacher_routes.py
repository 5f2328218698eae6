"""The teacher's side door: a trainer in its own process (``torchrun``) has the server's teacher score the ids its
old-policy pass computed, so it trains on exact teacher values as the in-process trainer does.

Route: ``POST /v1/trainer/teacher {requests: [...]}`` → ``{scores: [...]}``, one ``TeacherScores`` per request in
order, both in the codec of ``clawloop.wire`` (``request_to_json`` / ``scores_to_json``: the turn's messages,
tools and ids, the hint candidates, the temperature and the student ids as base64 safetensors; the answer's
tensors the same way, bit-for-bit as the engine computed them). All requests of one call go to the teacher as
one ``engine.score`` call, awaited on the server's event loop, where the teacher's engine lives.

Answers: 400 for a malformed request (named field; nothing is scored), 404 ``teacher_unavailable`` when this
server has no teacher (the method trains no OPD branch), 503 ``teacher_failed`` when the engine fails (the caller
may retry). Auth: ``clawloop.api.auth.require_admin`` first, as every trainer route: the route runs the model
on caller-given text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from clawloop.api.auth import require_admin
from clawloop.api.bodies import ADMIN_BODY_BYTES, read_json_object
from clawloop.api.errors import APIError
from clawloop.teacher import Teacher
from clawloop.wire import request_from_json, scores_to_json

log = logging.getLogger("clawloop.api")

MAX_REQUESTS = 256
"""Most samples one call may ask for (a micro-batch is far smaller)."""


def mount_teacher_routes(app: FastAPI, teacher: Callable[[], Teacher | None], config: Any) -> None:
    """Add ``/v1/trainer/teacher`` to ``app``; ``teacher()`` gives the server's teacher (None: none)."""

    async def score(request: Request) -> Any:
        require_admin(request, config)
        raw = (await read_json_object(request, ADMIN_BODY_BYTES)).get("requests")
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_REQUESTS:
            raise APIError(400, f"'requests' must be a list of 1 to {MAX_REQUESTS} teacher requests.",
                           "invalid_request_error", "requests", "invalid_value")
        try:
            asked = [request_from_json(d) for d in raw]
        except (KeyError, ValueError, TypeError) as exc:
            raise APIError(400, f"A teacher request is malformed ({type(exc).__name__}: {exc}).",
                           "invalid_request_error", "requests", "invalid_value") from None
        current = teacher()
        if current is None:
            raise APIError(404, "This server has no teacher (its method trains no OPD branch).",
                           "invalid_request_error", None, "teacher_unavailable")
        try:
            scores = await current.score(asked)
        except ValueError as exc:  # ids that do not fit the response or the model
            raise APIError(400, f"The teacher refused a request: {exc}", "invalid_request_error", "requests",
                           "invalid_value") from None
        except Exception as exc:  # noqa: BLE001 - engine down, out of memory: the trainer may try again
            log.warning("teacher route: scoring %d requests failed: %s: %s", len(asked), type(exc).__name__, exc)
            raise APIError(503, "The teacher could not score the requests; try again.", "server_error", None,
                           "teacher_failed") from None
        return {"scores": [scores_to_json(s) for s in scores]}

    app.add_api_route("/v1/trainer/teacher", score, methods=["POST"])
