"""``POST /v1/admin/forget {"user": "k_…"}``: forget one user while the server runs (admin key).

Under per-user policies (``policy_scope = "per_user"``) nothing but the user's own adapter trained on their
samples, so the running server can forget them without touching anyone else's weights, in this order:

1. their key is closed for the forget's duration (a request of theirs gets 409 ``user_being_forgotten``) and
   their live sessions end (a request in flight finishes first), so no turn of theirs is stored meanwhile;
2. training pauses (after the step in progress) until their records are gone, and the trainer lets go of their
   trainer, optimizer state, gate and adapter weights (``OnlineTrainer.let_go_of_user``); a batch of theirs
   leased meanwhile finds its samples gone afterwards and is skipped, so nothing of theirs trains again;
3. the engine unpublishes their adapter: from the next step boundary their key is answered by the base model, an
   answer already running finishes;
4. ``trainer.forget.forget_user`` on the server's own store: their records go (secure delete, vacuum, log
   truncated), their versions are retired, ``RUN_DIR/users/<owner>/`` and their published adapters are deleted
   and the receipt is written (``RUN_DIR/receipts/``; the dashboard lists it).

Every store call of the server waits while the store is rewritten (seconds for a store of thousands of turns).

The answer is the receipt (ids and counts, never text). Under the shared policy the forget retires versions and
rebuilds the weights from a checkpoint, which needs the server stopped: the route answers 409 and says to run
``clawloop forget``. Afterwards the user's key works again: what they send from then on is new data.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from clawloop.api.auth import require_admin
from clawloop.api.bodies import read_json_object
from clawloop.api.errors import APIError
from clawloop.api.sessions import SessionManager
from clawloop.store import Store, StoreInUse
from clawloop.trainer.forget import forget_user
from clawloop.trainer.per_user import OWNER_NAME


def mount_forget_route(app: FastAPI, store: Store, config: Any, sessions: SessionManager, engine: Any,
                       trainer: Callable[[], Any]) -> None:
    """Add ``POST /v1/admin/forget``; ``trainer()`` returns the embedded ``OnlineTrainer`` or None."""
    lock = asyncio.Lock()

    async def forget(request: Request) -> Any:
        require_admin(request, config)
        user = (await read_json_object(request, config.max_body_bytes)).get("user")
        if not isinstance(user, str) or not OWNER_NAME.match(user):
            raise APIError(400, "'user' must be a user's k_… name (the owner of their turns).",
                           "invalid_request_error", "user", None)
        if config.policy_scope != "per_user":
            raise APIError(409, "This run trains one shared policy: forgetting a user retires every version trained "
                           "on their samples and rebuilds the weights from a checkpoint, which needs the server "
                           f"stopped. Stop it, then run: clawloop forget {config.run_dir} --user {user}",
                           "invalid_request_error", None, "needs_stopped_server")
        online = trainer()
        async with lock:
            try:  # before anything of the user's is ended or let go: a forget that cannot go on changes nothing
                await asyncio.to_thread(store.check_alone, "forget")
            except StoreInUse as exc:
                raise APIError(409, str(exc), "invalid_request_error", None, "store_in_use") from None
            return await forget_now(user, online)

    async def forget_now(user: str, online: Any) -> dict[str, Any]:
        async with sessions.owner_closed(user) as ended, \
                (online.paused() if online is not None else contextlib.nullcontext()):
            if online is not None:
                await online.let_go_of_user(user)
            if engine.adapter_version(user) is not None:
                await engine.remove_adapter(user)
            try:
                receipt = await asyncio.to_thread(forget_user, store, Path(config.run_dir), user)
            except StoreInUse as exc:  # another writer came since the check: the user's policy resumes as at a start
                if online is not None:
                    await online.bring_back_user(user)
                raise APIError(409, str(exc), "invalid_request_error", None, "store_in_use") from None
        return {"object": "clawloop.forget", **receipt, "sessions_ended": ended}

    app.add_api_route("/v1/admin/forget", forget, methods=["POST"])
