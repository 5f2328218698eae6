"""``clawloop dashboard RUN_DIR``: the dashboard of a finished or running run, served on its own.

The run's store is opened read-only (a running ``clawloop serve`` keeps writing it; SQLite's WAL lets both work);
the app has the same guard and admin rule as the serving API, so the same settings (``--admin-key``,
``CLAWLOOP_ADMIN_KEY``, ``--host``) mean the same here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from clawloop.api.auth import KeyRing
from clawloop.api.errors import install_error_handlers
from clawloop.api.guard import BrowserGuard, CatchAll
from clawloop.config import Config
from clawloop.store import find_store
from clawloop.dashboard.readmodel import RunView, recorded_view_settings, view_for_run_dir
from clawloop.dashboard.routes import PREFIX, install

log = logging.getLogger("clawloop.dashboard")


def token_text_for(model: str) -> Any:
    """Token id -> text with the tokenizer of ``model`` (None when it cannot be loaded: ids are shown instead)."""
    try:
        from clawloop.api.token_texts import TokenTexts
        from clawloop.engines.model_files import load_tokenizer, resolve_model

        texts = TokenTexts(load_tokenizer(resolve_model(model)))
    except Exception as exc:  # noqa: BLE001 - the dashboard still works, with token ids
        log.warning("dashboard: no tokenizer for %r (%s); tokens are shown as ids", model, exc)
        return None
    return lambda token_id: texts.get(token_id)[0]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What the demo wrote about the run at its end (``summary.json``: settings, judge), else {}."""
    import json

    try:
        return dict(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return {}


def build_app(run_dir: str | Path, config: Config, *, model: str | None = None) -> tuple[FastAPI, RunView]:
    """The dashboard app of ``run_dir``. Its tokens and hints are shown with the settings its server recorded in
    the store, else those of the demo's summary, else ``config``'s; ``model`` names the tokenizer instead."""
    run_dir = Path(run_dir)
    summary = run_summary(run_dir)
    settings = {**(summary.get("settings") or {}), **recorded_view_settings(find_store(run_dir))}
    judge = summary.get("judge") if isinstance(summary.get("judge"), dict) else None
    view = view_for_run_dir(
        run_dir, token_text=token_text_for(model or settings.get("model") or "default"),
        hint_selection=settings.get("hint_selection", config.hint_selection),
        adv_diff_clip=float(settings.get("adv_diff_clip", config.adv_diff_clip)), judge=judge)
    app = FastAPI(title="clawloop dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    install(app, view, config)
    app.add_middleware(CatchAll)
    app.add_middleware(BrowserGuard, config=config)
    app.state.keyring = KeyRing.from_config(config)
    return app, view


def serve_dashboard(run_dir: str | Path, config: Config, *, model: str | None = None,
                    log_level: str = "warning") -> None:
    import uvicorn

    app, _ = build_app(run_dir, config, model=model)
    print(f"clawloop dashboard of {run_dir}: http://{config.host}:{config.port}{PREFIX}/", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=log_level)
