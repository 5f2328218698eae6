"""The dashboard's HTTP routes: the page, its shipped assets and read-only JSON views of a run.

    GET /dashboard/                         the page (static HTML: holds no run data)
    GET /dashboard/static/...               its scripts, styles and vendored libraries (no CDN, works offline)
    GET /dashboard/api/overview             version, steps, samples waiting, turns, judge, gate, throughput
    GET /dashboard/api/sessions             sessions, newest first
    GET /dashboard/api/sessions/{id}        one session's turns: answer, next state, votes, hints, fate
                                            (``?owner=NAME``: that key's session; none: the keyless one)
    GET /dashboard/api/samples/latest       the newest sample with teacher targets, token by token (null: none)
    GET /dashboard/api/samples/{turn_id}    one sample token by token
    GET /dashboard/api/training             per-step metric series and the demo's evaluations
    GET /dashboard/api/versions             published versions, gate decisions and rollbacks

Every ``/dashboard/api`` route calls ``require_admin`` first (the run's conversations are admin data); only GET
routes exist, so nothing can be changed through them. The page and its assets are open: they hold no data.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from starlette.staticfiles import StaticFiles

from clawloop.api.auth import require_admin
from clawloop.api.errors import APIError
from clawloop.dashboard.readmodel import RunView

STATIC_DIR = Path(__file__).parent / "static"
PREFIX = "/dashboard"
NO_STORE = {"Cache-Control": "no-store"}
MAX_TURN_ID = 2**63 - 1
"""The largest row id SQLite stores; a larger number in a sample's address names no turn."""


def install(app: FastAPI, view: RunView, config: Any) -> None:
    """Add the dashboard routes to ``app`` (the app keeps its middlewares: BrowserGuard still sees every request)."""

    async def fetch(method: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(method, *args)
        except FileNotFoundError as exc:
            raise APIError(503, f"The run has no records yet: {exc}", "server_error", None, "no_records") from None

    async def read(request: Request, method: Any, *args: Any) -> JSONResponse:
        require_admin(request, config)
        result = await fetch(method, *args)
        if result is None:
            raise APIError(404, "Not found in this run.", "invalid_request_error", None, "not_found")
        return JSONResponse(result, headers=NO_STORE)

    async def page() -> Any:
        return FileResponse(STATIC_DIR / "index.html", headers=NO_STORE)

    async def bare() -> Any:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    async def overview(request: Request) -> Any:
        return await read(request, view.overview)

    async def sessions(request: Request) -> Any:
        return await read(request, view.sessions)

    async def session(request: Request, session_id: str) -> Any:
        return await read(request, view.session, session_id, request.query_params.get("owner", ""))

    async def latest_sample(request: Request) -> Any:
        require_admin(request, config)
        turn_id = await fetch(view.latest_sample_turn)
        if turn_id is None:  # not an error: the page says that no sample exists yet
            return JSONResponse(None, headers=NO_STORE)
        return await read(request, view.sample_tokens, turn_id)

    async def sample(request: Request, turn_id: int) -> Any:
        if turn_id > MAX_TURN_ID:  # no such row, and SQLite cannot even take the number
            require_admin(request, config)
            raise APIError(404, "Not found in this run.", "invalid_request_error", None, "not_found")
        return await read(request, view.sample_tokens, turn_id)

    async def training(request: Request) -> Any:
        return await read(request, view.training)

    async def versions(request: Request) -> Any:
        return await read(request, view.versions)

    app.add_api_route(PREFIX, bare, methods=["GET"], include_in_schema=False)
    app.add_api_route(f"{PREFIX}/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route(f"{PREFIX}/api/overview", overview, methods=["GET"])
    app.add_api_route(f"{PREFIX}/api/sessions", sessions, methods=["GET"])
    app.add_api_route(f"{PREFIX}/api/sessions/{{session_id}}", session, methods=["GET"])
    app.add_api_route(f"{PREFIX}/api/samples/latest", latest_sample, methods=["GET"])
    app.add_api_route(f"{PREFIX}/api/samples/{{turn_id:int}}", sample, methods=["GET"])
    app.add_api_route(f"{PREFIX}/api/training", training, methods=["GET"])
    app.add_api_route(f"{PREFIX}/api/versions", versions, methods=["GET"])
    app.mount(f"{PREFIX}/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")


def install_for_service(app: FastAPI, service: Any) -> RunView:
    """The dashboard of a running ``clawloop serve``: its store read-only plus what only the process knows. The
    judge set-up is also written to the store's meta here, at start-up, so that the run's folder still names its
    judge once the server is gone (``clawloop dashboard RUN_DIR``)."""
    from clawloop.api.token_texts import TokenTexts
    from clawloop.dashboard.readmodel import latency_summary, record_judge_setup, record_view_settings

    config = service.config
    texts = TokenTexts(service.tokenizer)

    def live() -> dict[str, Any]:
        return {"policy_version": int(service.engine.policy_version),
                "serving": {"live_sessions": len(service.sessions),
                            "chat_latency": latency_summary(service.metrics.latency, "/v1/chat/completions"),
                            "uptime_s": round(time.time() - service.started_at, 1)}}

    judge = service.judge_setup()
    record_judge_setup(service.store, judge)
    record_view_settings(service.store, {"model": config.model, "hint_selection": config.hint_selection,
                                         "adv_diff_clip": config.adv_diff_clip})
    view = RunView(config.run_dir, store_path=service.store.path, token_text=lambda i: texts.get(i)[0],
                   hint_selection=config.hint_selection, adv_diff_clip=config.adv_diff_clip, judge=judge, live=live)
    install(app, view, config)
    return view
