"""Chat latency while the loop learns, against the same server idle: the p50 / p90 ratio, measured in one run.

One real server (``clawloop.runtime.build_runtime``: the default model unless ``--model``, real HTTP on 127.0.0.1,
the rule judge, the embedded trainer) and two client threads:

* the **probe** sends the same short chat request again and again, each in a new session (so it never gives a
  turn a next state and makes no work), one at a time, and records each request's latency;
* the **driver** keeps the same request pace in both kinds of window. In a *busy* window it holds conversations:
  a question, then "That is wrong …" in the same session, so every conversation gives the pipeline a turn to
  judge and the trainer a sample; with ``rollout_batch_size = --batch`` the trainer leases, trains, publishes and
  commits a step every ``--batch`` conversations. In an *idle* window it sends the same two requests, each in a
  new session with an answer the server never gave, so nothing is judged or trained.

Windows alternate (idle, busy, idle, busy, …) for ``--rounds`` rounds of ``--window-s`` seconds each, so slow
drift (weights changing what the probe's answer looks like, a warming cache) falls on both kinds alike. Between
windows the run waits until the pipeline has judged everything and no step is running, so an idle window starts
idle. A sample never waits for a full batch on its own (``batch_wait_s`` and ``idle_train_s`` are set beyond the
run), so no step starts in an idle window; the table counts the steps and judged turns of each kind of window.

Printed: p50 and p90 latency of the probe in each kind of window, their ratios (busy / idle; the target for p50
is at most 1.2), the steps committed and turns judged in each. The number is what it is on this machine: on 2 CPU
cores the trainer and the server share the same cores, so the ratio mostly says how much CPU a step takes.

The default model is the one users get (SmolLM2-135M-Instruct). ``--model tiny`` is a harsher case, not a more
realistic one: the tiny random model's decoding is almost all Python, so it measures the contention for Python's
interpreter lock between the serving threads and the trainer more than the sharing of the CPU.

    .venv/bin/python benchmarks/chat_latency.py                      # default model, about 4 minutes
    .venv/bin/python benchmarks/chat_latency.py --model tiny         # the interpreter-lock case
    .venv/bin/python benchmarks/chat_latency.py --rounds 4 --window-s 30 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from clawloop.config import Config  # noqa: E402
from clawloop.runtime import Runtime, build_runtime  # noqa: E402
from clawloop.store import TurnState  # noqa: E402

PROBE = [{"role": "user", "content": "What is the capital of France?"}]
QUESTIONS = ["Name a prime number.", "Say hello in Spanish.", "What colour is the sky?", "Name a planet.",
             "Give me a synonym for quick.", "What is two plus two?", "Name a fruit.", "Name an ocean."]
CORRECTION = "That is wrong. Answer in one short sentence."


@dataclass
class Window:
    kind: str
    latencies_s: list[float] = field(default_factory=list)
    steps: int = 0
    judged: int = 0


def chat(http: httpx.Client, session: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                         json={"model": "clawloop", "messages": messages, "temperature": 0.0,
                               "max_tokens": max_tokens})
    response.raise_for_status()
    return response.json()


def probe(http: httpx.Client, window: Window, stop: threading.Event, max_tokens: int) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        chat(http, f"probe-{uuid.uuid4().hex}", PROBE, max_tokens)
        window.latencies_s.append(time.perf_counter() - started)


def drive(http: httpx.Client, busy: bool, stop: threading.Event, max_tokens: int) -> None:
    n = 0
    while not stop.is_set():
        question = [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}]
        n += 1
        first_session = f"drive-{uuid.uuid4().hex}"
        answer = chat(http, first_session, question, max_tokens)["choices"][0]["message"].get("content") or ""
        if busy:  # the same session: the correction is the first turn's next state, so it is judged
            follow = question + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": CORRECTION}]
            chat(http, first_session, follow, max_tokens)
            http.post(f"/v1/sessions/{first_session}/end").raise_for_status()
        else:  # a new session with an answer never given: pairs with nothing, makes no work
            follow = question + [{"role": "assistant", "content": f"(idle {n})"},
                                 {"role": "user", "content": CORRECTION}]
            chat(http, f"drive-{uuid.uuid4().hex}", follow, max_tokens)


def settle(runtime: Runtime, timeout_s: float = 300.0) -> None:
    """Wait until nothing waits to be judged and no step is running."""
    store, trainer = runtime.server.store, runtime.trainer
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = store.count_turns()
        pending = counts.get(TurnState.JUDGEABLE, 0) + counts.get(TurnState.JUDGING, 0)
        if pending == 0 and not runtime.pipeline.busy and (trainer is None or not trainer.training):
            return
        time.sleep(0.1)
    raise TimeoutError("the pipeline or the trainer did not settle")


def judged_count(runtime: Runtime) -> int:
    return sum(v for k, v in runtime.pipeline.stats.items() if k.startswith(("sample:", "dropped:")))


def run_window(runtime: Runtime, kind: str, seconds: float, max_tokens: int) -> Window:
    window = Window(kind)
    steps0, judged0 = runtime.trainer.step if runtime.trainer else 0, judged_count(runtime)
    stop = threading.Event()
    url = runtime.server.base_url
    with httpx.Client(base_url=url, timeout=300) as probe_http, httpx.Client(base_url=url, timeout=300) as drive_http:
        threads = [threading.Thread(target=probe, args=(probe_http, window, stop, max_tokens)),
                   threading.Thread(target=drive, args=(drive_http, kind == "busy", stop, max_tokens))]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
    if kind == "busy":  # the window's work counts to it even when it finishes just after
        settle(runtime)
    window.steps = (runtime.trainer.step if runtime.trainer else 0) - steps0
    window.judged = judged_count(runtime) - judged0
    if kind == "idle":
        settle(runtime)
    return window


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="default (SmolLM2-135M-Instruct), tiny, or a local model folder.")
    parser.add_argument("--rounds", type=int, default=3, help="Idle + busy window pairs.")
    parser.add_argument("--window-s", type=float, default=20.0, help="Length of each window.")
    parser.add_argument("--batch", type=int, default=2, help="rollout_batch_size: conversations per step.")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="Torch threads of the engines and the trainer.")
    parser.add_argument("--gate", action="store_true", help="Keep the publication gate on (slower steps).")
    parser.add_argument("--run-dir", default="", help="Run folder (default: a new temporary one).")
    args = parser.parse_args(argv)

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="clawloop-chat-latency-")
    config = Config.load(env={}, model=args.model, port=0, run_dir=run_dir, judge_backend="rules",
                         num_threads=args.threads, max_batch_size=8, rollout_batch_size=args.batch,
                         batch_wait_s=86400.0, idle_train_s=86400.0, gate=args.gate, device="cpu",
                         session_idle_timeout_s=86400.0)
    started = time.monotonic()
    runtime = build_runtime(config, console=None, pipeline_poll_s=0.2, trainer_poll_s=0.2)
    windows: list[Window] = []
    with runtime:
        print(f"server up in {time.monotonic() - started:.0f}s on {runtime.server.base_url} (model {args.model}, "
              f"method {config.method}, batch {args.batch}, gate {'on' if args.gate else 'off'}, run dir {run_dir})",
              flush=True)
        run_window(runtime, "idle", min(5.0, args.window_s), args.max_tokens)  # warm-up, not counted
        for r in range(args.rounds):
            for kind in ("idle", "busy"):
                w = run_window(runtime, kind, args.window_s, args.max_tokens)
                windows.append(w)
                print(f"round {r + 1} {kind}: {len(w.latencies_s)} probes, p50 "
                      f"{1000 * statistics.median(w.latencies_s):.0f} ms, {w.steps} step(s), {w.judged} judged",
                      flush=True)
    lat = {k: [x for w in windows if w.kind == k for x in w.latencies_s] for k in ("idle", "busy")}
    steps = {k: sum(w.steps for w in windows if w.kind == k) for k in ("idle", "busy")}
    judged = {k: sum(w.judged for w in windows if w.kind == k) for k in ("idle", "busy")}
    p50 = {k: quantile(v, 0.5) for k, v in lat.items()}
    p90 = {k: quantile(v, 0.9) for k, v in lat.items()}
    print()
    print(f"{'':24}{'idle':>12}{'busy':>12}{'busy/idle':>12}")
    print(f"{'probe requests':24}{len(lat['idle']):>12}{len(lat['busy']):>12}")
    print(f"{'p50 latency (ms)':24}{1000 * p50['idle']:>12.1f}{1000 * p50['busy']:>12.1f}"
          f"{p50['busy'] / p50['idle']:>12.2f}")
    print(f"{'p90 latency (ms)':24}{1000 * p90['idle']:>12.1f}{1000 * p90['busy']:>12.1f}"
          f"{p90['busy'] / p90['idle']:>12.2f}")
    print(f"{'steps committed':24}{steps['idle']:>12}{steps['busy']:>12}")
    print(f"{'turns judged':24}{judged['idle']:>12}{judged['busy']:>12}")
    ratio = p50["busy"] / p50["idle"]
    print(f"\np50 ratio {ratio:.2f} (target <= 1.2): {'met' if ratio <= 1.2 else 'not met'} on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
