"""Screenshots of every dashboard page from a real short run (tiny model, rule judge, real steps), for docs/dashboard/.

    python scripts/dashboard_screenshots.py [--out docs/dashboard] [--port 31050] [--run-dir DIR] [--demo]

The live pages come from a running server; with ``--demo`` a short ``clawloop demo`` on the tiny model runs too
and its finished folder is shown by ``clawloop dashboard RUN_DIR``'s app (``finished-*.png``: the held-out
evaluations and the gate's decisions of a demo).

Uses the system Chromium through Playwright (``CLAWLOOP_CHROMIUM`` or the first of chromium / chromium-browser /
google-chrome on PATH); scripts/setup_chromium.sh installs it on Debian. Prints each file written and any
console error the pages logged (the script fails when there is one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "dashboard"))

import httpx  # noqa: E402

from browser_support import chromium_path  # noqa: E402
from dashboard_support import QUESTIONS, converse, run_config, start_run, wait_for  # noqa: E402

def serve_in_thread(app, port: int):
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=60, what="the dashboard app")
    return server, thread


def finished_demo_shots(browser, out: Path, port: int, errors: list[str]) -> None:
    from clawloop.cli import main as cli
    from clawloop.config import Config
    from clawloop.dashboard.standalone import build_app

    run_dir = tempfile.mkdtemp(prefix="clawloop-dash-demo-")
    rc = cli(["demo", "--model", "tiny", "--interactions", "12", "--eval-every", "4", "--rollout-batch-size", "2",
              "--heldout-n", "3", "--run-dir", run_dir, "--num-threads", "2", "--max-batch-size", "4", "--seed", "1",
              "--gate-every", "1", "--gate-probe-tokens", "8", "--port", str(port)])
    if rc != 0:
        raise SystemExit(f"the demo failed (exit {rc})")
    app, _ = build_app(run_dir, Config.load(env={}, port=port + 1), model="tiny")
    server, thread = serve_in_thread(app, port + 1)
    try:
        page = browser.new_page(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        for name in ("overview", "training", "versions"):
            page.goto(f"http://127.0.0.1:{port + 1}/dashboard/#{name}")
            page.wait_for_timeout(2500)
            path = out / f"finished-{name}.png"
            page.screenshot(path=str(path), full_page=True)
            print(path)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


PAGES = [("overview", "#overview"), ("conversations", "#conversations"), ("sample", "#sample"),
         ("training", "#training"), ("versions", "#versions")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard"))
    parser.add_argument("--port", type=int, default=31050)
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--demo", action="store_true", help="Also a short tiny-model demo, shown when finished.")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    exe = chromium_path()
    if exe is None:
        print("no Chromium found: run scripts/setup_chromium.sh", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="clawloop-dash-")
    runtime = start_run(run_config(run_dir, port=args.port, gate=True))
    errors: list[str] = []
    try:
        with httpx.Client(base_url=runtime.server.base_url, timeout=120) as http:
            for i in range(args.sessions):
                converse(http, f"demo-{i}", QUESTIONS[i % len(QUESTIONS)], corrected=i % 3 != 1)
            wait_for(lambda: runtime.trainer.step >= args.sessions // 2, timeout_s=300, what="training steps")
            converse(http, "latest", "Name an ocean.", corrected=True, end=False)  # one turn still pending
            time.sleep(1.0)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            for name, frag in PAGES:
                page.goto(f"{runtime.server.base_url}/dashboard/{frag}")
                page.wait_for_timeout(2500)
                if name == "conversations":
                    page.click("#session-list li[data-session='demo-0']")
                    page.wait_for_timeout(1500)
                if name == "sample":
                    page.hover("#tokens .tok >> nth=3")
                    page.wait_for_timeout(300)
                path = out / f"{name}.png"
                page.screenshot(path=str(path), full_page=name not in ("sample",))
                print(path)
            page.close()  # it polls: closed before its server stops
            if args.demo:
                runtime.stop()
                finished_demo_shots(browser, out, args.port + 10, errors)
            browser.close()
    finally:
        runtime.stop()
    for e in errors:
        print(f"console error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
