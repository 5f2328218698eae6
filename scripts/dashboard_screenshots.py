"""Screenshots of every dashboard page from a real run of the default model, for docs/dashboard/ and the README.

    python scripts/dashboard_screenshots.py --run-dir DIR [--out docs/dashboard] [--port 31060] [--model default]

When DIR holds no run yet, ``clawloop demo --run-dir DIR`` runs first (what ``make demo`` runs: SmolLM2-135M-
Instruct, the simulated ``brief`` user, the rule judge, online training behind the publication gate; about 12
minutes on a 2-core CPU). The finished folder is then shown the way ``clawloop dashboard DIR`` shows it and each
page is photographed: the conversation picked is one with a turn whose step the gate rejected when there is one
(else the newest with a trained turn), the sample is the newest with teacher targets, with a token hovered.

Uses the system Chromium through Playwright (``CLAWLOOP_CHROMIUM`` or the first of chromium / chromium-browser /
google-chrome on PATH); scripts/setup_chromium.sh installs it on Debian. Prints each file written and any
console error the pages logged (the script fails when there is one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "dashboard"))

from browser_support import chromium_path  # noqa: E402
from dashboard_support import wait_for  # noqa: E402

PAGES = ("overview", "conversations", "sample", "training", "versions")
WIDTH = 1360
MAX_HEIGHT = 2400
"""Longest picture kept (a long conversation is cut there)."""


def run_demo(run_dir: Path, model: str) -> None:
    from clawloop.cli import main as cli

    rc = cli(["demo", "--run-dir", str(run_dir), "--model", model])
    if rc != 0:
        raise SystemExit(f"the demo failed (exit {rc})")


def serve_in_thread(app: Any, port: int) -> tuple[Any, Any]:
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=60, what="the dashboard app")
    return server, thread


def session_to_show(view: Any) -> str | None:
    """A session with a turn of a rejected step, else the newest session with a trained turn, else the newest."""
    sessions = [s["session_id"] for s in view.sessions()["sessions"]]
    fates = {sid: {t["fate"]["fate"] for t in view.session(sid)["turns"]} for sid in sessions}
    for wanted in ("rejected", "trained"):
        for sid in sessions:
            if wanted in fates[sid]:
                return sid
    return sessions[0] if sessions else None


def photograph(page: Any, base: str, name: str, view: Any, out: Path) -> Path:
    if name == "conversations":
        sid = session_to_show(view)
        page.goto(f"{base}/#conversations/{sid}" if sid else f"{base}/#conversations")
        page.wait_for_selector("#session-detail article.turn, #session-list li.muted", timeout=15000)
    else:
        page.goto(f"{base}/#{name}")
    page.wait_for_timeout(2500)  # one poll: charts laid out, every part rendered
    tokens = page.locator("#tokens .tok")
    if name == "sample" and tokens.count():
        tokens.nth(min(3, tokens.count() - 1)).hover()  # the tooltip with both top-k sets
        page.wait_for_timeout(300)
    path = out / f"{name}.png"
    height = min(MAX_HEIGHT, page.evaluate("document.documentElement.scrollHeight"))
    full = name != "sample"  # the sample keeps its hover tooltip in the first screen
    page.screenshot(path=str(path), full_page=full,
                    clip={"x": 0, "y": 0, "width": WIDTH, "height": height} if full else None)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, help="A finished run folder, or where to run the demo first.")
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard"))
    parser.add_argument("--port", type=int, default=31060, help="The dashboard's port while photographing.")
    parser.add_argument("--model", default="default", help="The demo's model when it runs (default: SmolLM2).")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from clawloop.config import Config
    from clawloop.dashboard.standalone import build_app
    from clawloop.store import find_store

    exe = chromium_path()
    if exe is None:
        print("no Chromium found: run scripts/setup_chromium.sh", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    try:
        find_store(run_dir)
    except FileNotFoundError:
        run_demo(run_dir, args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app, view = build_app(run_dir, Config.load(env={}, port=args.port))
    server, thread = serve_in_thread(app, args.port)
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": WIDTH, "height": 900}, device_scale_factor=1)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            for name in PAGES:
                print(photograph(page, f"http://127.0.0.1:{args.port}/dashboard", name, view, out))
            page.close()
            browser.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    for e in errors:
        print(f"console error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
