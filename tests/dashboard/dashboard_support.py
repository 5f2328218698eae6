"""A real short run for the dashboard tests and scripts/dashboard_screenshots.py: the tiny model behind the real
HTTP API with training on, the rule judge (no URL needed), conversations through the chat API and real steps.

``start_run`` returns the started runtime; ``converse`` plays one session (question, answer, the user's reply);
``wait_for`` polls a condition with a deadline.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from clawloop.config import Config
from clawloop.runtime import build_runtime

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Say hello in Spanish.",
             "What colour is the sky?", "Give me a synonym for quick.", "What is two plus two?",
             "Name a planet.", "Name a fruit."]
CORRECTION = "That is wrong. Answer in one short sentence."
APPROVAL = "Great, thanks!"


def run_config(run_dir: str, port: int = 0, **overrides: Any) -> Config:
    values = dict(model="tiny", host="127.0.0.1", port=port, run_dir=run_dir, judge_backend="rules", prm_m=1,
                  default_max_tokens=12, num_threads=2, max_batch_size=8, rollout_batch_size=2, lr=1e-3,
                  checkpoint_every=100, device="cpu", gate=False)
    values.update(overrides)
    return Config.load(env={}, **values)


def start_run(config: Config) -> Any:
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.1, console=None)
    runtime.start()
    return runtime


def chat(http: httpx.Client, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                         json={"model": "clawloop", "messages": messages, "temperature": 1.0, "max_tokens": 12})
    response.raise_for_status()
    return response.json()


def converse(http: httpx.Client, session: str, question: str, corrected: bool, end: bool = True) -> int:
    """Ask, reply (a correction or thanks), end the session. Returns the judged turn's id."""
    messages = [{"role": "user", "content": question}]
    first = chat(http, session, messages)
    answer = first["choices"][0]["message"].get("content") or ""
    chat(http, session, messages + [{"role": "assistant", "content": answer},
                                    {"role": "user", "content": CORRECTION if corrected else APPROVAL}])
    if end:
        http.post(f"/v1/sessions/{session}/end").raise_for_status()
    return int(first["clawloop"]["turn_id"])


def wait_for(predicate: Any, timeout_s: float = 180.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
