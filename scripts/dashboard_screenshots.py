"""Screenshots of every dashboard page from a real short run (tiny model, rule judge, real steps), for docs/dashboard/.

    python scripts/dashboard_screenshots.py [--out docs/dashboard] [--port 31050] [--run-dir DIR]

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

PAGES = [("overview", "#overview"), ("conversations", "#conversations"), ("sample", "#sample"),
         ("training", "#training"), ("versions", "#versions")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard"))
    parser.add_argument("--port", type=int, default=31050)
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--sessions", type=int, default=8)
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
            browser.close()
    finally:
        runtime.stop()
    for e in errors:
        print(f"console error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
