"""Shared by tests/test_end_to_end.py and its crash worker: the full serve + judge + train wiring, a scripted
judge that reads the user's reply, and conversations driven over HTTP.

Wiring: ``clawloop.runtime.build_runtime`` — what ``clawloop serve`` runs with training on (``Server`` + judge/teacher
``Pipeline`` + ``OnlineTrainer`` as server components on the server's event loop).
"""

from __future__ import annotations

from typing import Any

import httpx

from clawloop.config import Config
from clawloop.judge.scripted import last_user_text
from clawloop.runtime import build_runtime
from clawloop.serve import Server
from clawloop.trainer.loop import OnlineTrainer

HINT = "Reply with one short sentence and nothing else."
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Say hello in Spanish.",
             "What colour is the sky?", "Give me a synonym for quick.", "What is two plus two?",
             "Name a planet.", "Write a word that rhymes with cat.", "Name a fruit.", "What is ice made of?",
             "Name an ocean.", "Say goodbye in French."]


def judge(body: dict[str, Any]) -> str:
    """Scripted judge: a reply saying 'wrong' is a correction (-1, with a hint); 'thanks' is approval (+1)."""
    evidence = last_user_text(body)
    hint_vote = "[HINT_START]" in body["messages"][0]["content"]
    corrected = "wrong" in evidence.lower()
    if hint_vote:
        return f"\\boxed{{1}} [HINT_START]{HINT}[HINT_END]" if corrected else "No hindsight here. \\boxed{-1}"
    return "The user asks for a redo. \\boxed{-1}" if corrected else "The user moves on. \\boxed{1}"


def e2e_config(run_dir: str, judge_url: str, **overrides: Any) -> Config:
    # The publication gate stays on, but without its guard share, its knowledge probes, its preference check and the
    # run's corrected prompts: the tiny random model writes word salad that the guard may judge either way on any
    # probe, states a known fact only by chance (once in the 136 sampled answers of one run's reference, so one
    # chance answer decided), reads a hint as noise, and may flip a corrected prompt's answer, which no earlier fix
    # may do (a fresh-clone run rejected step 2 for "What is the capital of France?"). Any of these would make the
    # number of published versions a coin toss (the gate's decisions are tested in tests/trainer/test_gate.py and
    # tests/gate/). The KL bound still applies.
    values = dict(model="tiny", port=0, run_dir=run_dir, judge_url=judge_url, judge_model="scripted-judge",
                  prm_m=1, judge_retries=0, judge_timeout_s=30, default_max_tokens=8, num_threads=2,
                  max_batch_size=8, rollout_batch_size=2, lr=1e-3, checkpoint_every=2, device="cpu",
                  gate_min_guard_pass=0.0, gate_knowledge=False, gate_preference=False, gate_fixed_prompts=0)
    values.update(overrides)
    return Config.load(env={}, **values)


def build_server(config: Config, *, resume: bool = False) -> tuple[Server, Any, OnlineTrainer]:
    runtime = build_runtime(config, resume=resume, pipeline_poll_s=0.2, trainer_poll_s=0.1, console=None)
    return runtime.server, runtime.pipeline, runtime.trainer


def chat(http: httpx.Client, session: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                         json={"model": "clawloop", "messages": messages, "temperature": 1.0, "max_tokens": 8,
                               **extra})
    response.raise_for_status()
    return response.json()


def conversation(http: httpx.Client, session: str, question: str, corrected: bool) -> int:
    """Ask, reply ('wrong...' or 'thanks'), end the session. Returns the first turn's id (the judged one)."""
    messages = [{"role": "user", "content": question}]
    first = chat(http, session, messages)
    answer = first["choices"][0]["message"]
    reply = "That is wrong, try again." if corrected else "Great, thanks!"
    chat(http, session, messages + [{"role": "assistant", "content": answer.get("content") or ""},
                                    {"role": "user", "content": reply}])
    http.post(f"/v1/sessions/{session}/end").raise_for_status()
    return int(first["clawloop"]["turn_id"])
