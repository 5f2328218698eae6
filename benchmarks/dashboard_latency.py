"""Chat API latency with the dashboard open and polling against the dashboard closed, side by side in one run.

One ``clawloop serve`` server (tiny model, serving only: no judge or trainer whose bursts would blur the
comparison) answers ``--requests`` chat requests per condition, one at a time, each a new stored main turn.
The conditions alternate in ``--blocks`` blocks (closed, open, closed, open, ...) so drift (caches, the store
growing) falls on both alike. "Open" means:

* ``browser``: ``--tabs`` headless Chromium tabs on the dashboard (Conversations, Sample, Training, ...), each
  polling as a person's page does (every 2 s: the overview plus its view). The browser runs on this machine,
  so its own CPU use counts too: the case of a person watching on the server itself.
* ``http``: the same requests the tabs make, sent by plain HTTP pollers at the page's rate (the server's cost
  alone); ``--poll-ms`` lowers the interval for a stress case.

Prints p50 / p95 / mean latency per condition and the ratios open / closed.

    .venv/bin/python benchmarks/dashboard_latency.py
    .venv/bin/python benchmarks/dashboard_latency.py --mode http --poll-ms 100 --requests 80
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests" / "dashboard"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import httpx  # noqa: E402

from clawloop.config import Config  # noqa: E402
from clawloop.serve import Server  # noqa: E402

VIEWS = ["conversations", "sample", "training", "overview", "versions"]
PAGE_CALLS = {"conversations": ["sessions", "sessions/{sid}"], "sample": ["samples/latest"], "training": ["training"],
              "overview": [], "versions": ["versions"]}


def chat(http: httpx.Client, sid: str, text: str, max_tokens: int) -> float:
    t = time.perf_counter()
    r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                  json={"model": "clawloop", "messages": [{"role": "user", "content": text}],
                        "max_tokens": max_tokens, "temperature": 1.0})
    r.raise_for_status()
    return time.perf_counter() - t


class HttpPollers:
    """Threads sending what the dashboard tabs send, at the page's interval."""

    def __init__(self, base_url: str, tabs: int, poll_s: float):
        self.base_url, self.tabs, self.poll_s = base_url, tabs, poll_s
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.calls = 0

    def run_tab(self, view: str) -> None:
        sid = None
        with httpx.Client(base_url=self.base_url + "/dashboard/api", timeout=60) as c:
            while not self.stop_event.is_set():
                c.get("overview")  # every tab refreshes the header from the overview
                self.calls += 1
                for path in PAGE_CALLS[view]:
                    if path == "sessions/{sid}":
                        if sid is None:
                            continue
                        path = f"sessions/{sid}"
                    r = c.get(path)
                    self.calls += 1
                    if path == "sessions" and r.json()["sessions"]:
                        sid = r.json()["sessions"][0]["session_id"]
                self.stop_event.wait(self.poll_s)

    def __enter__(self) -> "HttpPollers":
        for i in range(self.tabs):
            t = threading.Thread(target=self.run_tab, args=(VIEWS[i % len(VIEWS)],), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=30)


class BrowserTabs:
    """Headless Chromium tabs with the dashboard open (the page polls by itself)."""

    def __init__(self, base_url: str, tabs: int, exe: str):
        self.base_url, self.tabs, self.exe = base_url, tabs, exe

    def __enter__(self) -> "BrowserTabs":
        from playwright.sync_api import sync_playwright

        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=self.exe, args=["--no-sandbox"])
        self.pages = []
        for i in range(self.tabs):
            page = self.browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{self.base_url}/dashboard/#{VIEWS[i % len(VIEWS)]}")
            self.pages.append(page)
        time.sleep(2.5)  # first render done, polling under way
        return self

    def __exit__(self, *exc: object) -> None:
        self.browser.close()
        self.pw.stop()


def dashboard_calls(server: Server) -> int:
    """Dashboard API requests the server has answered (from its own request counters)."""
    return int(sum(n for labels, n in server.service.metrics.requests.items()
                   if dict(labels).get("route", "").startswith("/dashboard/api")))


def dashboard_time_s(server: Server) -> float:
    """Total seconds the server spent answering dashboard API requests (its latency histogram's sums)."""
    hist = server.service.metrics.latency
    return float(sum(v for labels, v in hist.sums.items()
                     if dict(labels).get("route", "").startswith("/dashboard/api")))


def summary(xs: list[float]) -> dict[str, float]:
    ordered = sorted(xs)
    return {"n": len(xs), "p50": statistics.median(ordered), "p95": ordered[int(0.95 * (len(ordered) - 1))],
            "mean": statistics.fmean(ordered)}


def measure(mode: str, server: Server, args: argparse.Namespace, counter: list[int]) -> tuple[list[float], list[float]]:
    closed: list[float] = []
    opened: list[float] = []
    per_block = max(1, args.requests // args.blocks)
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for block in range(2 * args.blocks):
            is_open = block % 2 == 1
            target = opened if is_open else closed
            if not is_open:
                for _ in range(per_block):
                    counter[0] += 1
                    target.append(chat(http, f"bench-{counter[0]}", f"Question {counter[0]}?", args.max_tokens))
                continue
            # The pages poll by themselves (the browser is its own process); the HTTP pollers are threads.
            opener = HttpPollers(server.base_url, args.tabs, args.poll_ms / 1000) if mode == "http" else \
                BrowserTabs(server.base_url, args.tabs, args.chromium)
            with opener:
                time.sleep(0.2)
                for _ in range(per_block):
                    counter[0] += 1
                    target.append(chat(http, f"bench-{counter[0]}", f"Question {counter[0]}?", args.max_tokens))
    return closed, opened


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=90, help="Chat requests per condition.")
    parser.add_argument("--blocks", type=int, default=6, help="Alternations of closed / open.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tabs", type=int, default=3, help="Dashboard tabs open (pages or HTTP pollers).")
    parser.add_argument("--poll-ms", type=float, default=2000, help="Interval of the HTTP pollers (the page's: 2000).")
    parser.add_argument("--mode", choices=["browser", "http", "both"], default="both")
    parser.add_argument("--warmup-sessions", type=int, default=40, help="Turns stored before measuring.")
    parser.add_argument("--port", type=int, default=31150)
    parser.add_argument("--chromium", default="", help="Browser executable (default: found on PATH).")
    args = parser.parse_args()
    modes = ["http", "browser"] if args.mode == "both" else [args.mode]
    if "browser" in modes:
        from browser_support import chromium_path

        args.chromium = args.chromium or chromium_path() or ""
        if not args.chromium:
            print("no Chromium found (scripts/setup_chromium.sh): measuring the http mode only")
            modes = [m for m in modes if m != "browser"]

    run_dir = tempfile.mkdtemp(prefix="clawloop-dashbench-")
    config = Config.load(env={}, model="tiny", port=args.port, run_dir=run_dir, train=False, num_threads=2,
                         default_max_tokens=args.max_tokens, max_batch_size=8)
    server = Server(config).start()
    counter = [0]
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            for i in range(args.warmup_sessions):
                counter[0] += 1
                chat(http, f"warm-{i}", f"Warm-up question {i}?", args.max_tokens)
        print(f"tiny model, serving only, {args.requests} chat requests per condition in {args.blocks} alternating "
              f"blocks, max_tokens {args.max_tokens}, {args.tabs} dashboard tab(s), {args.warmup_sessions} turns "
              f"stored before")
        print(f"{'mode':<8} {'condition':<22} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'mean ms':>8}")
        for mode in modes:
            calls_before, busy_before, t0 = dashboard_calls(server), dashboard_time_s(server), time.perf_counter()
            closed, opened = measure(mode, server, args, counter)
            calls, seconds = dashboard_calls(server) - calls_before, time.perf_counter() - t0
            busy_ms = 1000 * (dashboard_time_s(server) - busy_before) / max(1, calls)
            c, o = summary(closed), summary(opened)
            label = f"open ({args.tabs} tabs, {args.poll_ms:g} ms)" if mode == "http" else f"open ({args.tabs} tabs)"
            for name, s in (("closed", c), (label, o)):
                print(f"{mode:<8} {name:<22} {s['n']:>4} {1000 * s['p50']:>8.1f} {1000 * s['p95']:>8.1f} "
                      f"{1000 * s['mean']:>8.1f}")
            print(f"{mode:<8} ratio open/closed: p50 {o['p50'] / c['p50']:.3f}  p95 {o['p95'] / c['p95']:.3f}  "
                  f"mean {o['mean'] / c['mean']:.3f}  ({calls} dashboard requests in {seconds:.0f} s, "
                  f"{busy_ms:.1f} ms each on average)")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
