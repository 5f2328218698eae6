"""With no judge configured, `clawloop serve` learns from explicit feedback: the rule judge runs, says so at
start-up, reads OpenClaw-style requests without their envelopes, and /v1/status shows why turns were dropped."""

import logging
import time

import httpx
import torch

from clawloop.config import Config
from clawloop.judge.describe import describe, judge_backend, startup_message
from clawloop.runtime import build_runtime

RUNTIME = ("Runtime: agent=main | session=agent:main:explicit:ocl-b2 | sessionId=ocl-B2 | host=vm | "
           "os=Linux 6.18.44-fc-v657 (x64) | node=v24.21.0 | model=clawloop/clawloop | shell=bash")


def test_auto_is_the_rule_judge_without_a_url_and_http_with_one():
    assert judge_backend(Config.load(env={})) == "rules"
    assert judge_backend(Config.load(env={}, judge_url="http://127.0.0.1:9/v1")) == "http"
    assert judge_backend(Config.load(env={}, judge_backend="engine")) == "engine"
    text = startup_message(Config.load(env={}))
    assert "rule judge" in text and "cannot see" in text and "judge_url" in text and "/v1/status" in text
    assert "implicit" in describe(Config.load(env={}))["cannot_see"]


def chat(http, session, messages):
    r = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                  json={"model": "clawloop", "messages": messages, "max_tokens": 6, "temperature": 1.0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"].get("content") or ""


def test_plain_serve_judges_openclaw_turns_with_rules_and_reports_drops(tmp_path, caplog):
    torch.set_num_threads(1)
    config = Config.load(env={}, model="tiny", device="cpu", port=0, run_dir=str(tmp_path), train=False,
                         num_threads=1, default_max_tokens=6)
    runtime = build_runtime(config, pipeline_poll_s=0.1, console=None)
    with caplog.at_level(logging.WARNING), runtime:
        with httpx.Client(base_url=runtime.server.base_url, timeout=120) as http:
            # One OpenClaw conversation: a correction, a thanks, then the session ends.
            messages = [{"role": "user", "content": "[Mon 2026-11-23 19:59 UTC] What is the capital of France?"
                                                    f"\n\n{RUNTIME}"}]
            for reply in ("[Mon 2026-11-23 20:00 UTC] Too long, answer in one sentence.",
                          "[Mon 2026-11-23 20:01 UTC] Thanks, that's all."):
                answer = chat(http, "ocl", messages)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": reply}]
            chat(http, "ocl", messages)
            # A reply with no explicit feedback, and a new task with pasted text: no signal either way.
            for sid, reply in (("quiet", "[Mon 2026-11-23 20:05 UTC] Ok."),
                               ("task", "[Mon 2026-11-23 20:08 UTC] Summarize the following text in one "
                                        "sentence:\n\n## How a turn becomes training\n\nThe judge votes.")):
                first = [{"role": "user", "content": "[Mon 2026-11-23 20:04 UTC] Name a planet."}]
                answer = chat(http, sid, first)
                chat(http, sid, first + [{"role": "assistant", "content": answer},
                                         {"role": "user", "content": reply}])
            for sid in ("ocl", "quiet", "task"):
                http.post(f"/v1/sessions/{sid}/end").raise_for_status()
            deadline = time.monotonic() + 120
            while True:
                status = http.get("/v1/status").json()
                busy = status["turns_by_state"].get("judgeable", 0) + status["turns_by_state"].get("judging", 0)
                if not busy or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        samples = runtime.server.store.samples()
    assert any("clawloop judge: turns are judged by the rule judge" in r.getMessage() for r in caplog.records)
    judge = status["judge"]
    assert judge["backend"] == "rules" and "explicit" in judge["sees"] and "implicit" in judge["cannot_see"]
    assert judge["invalid"] == 0 and judge["invalid_rate"] == 0.0 and judge["votes"] > 0
    assert status["turns_by_state"].get("ready", 0) == 2  # the corrected answer and the thanked one
    drops = status["drop_reasons"]
    assert drops.get("no_signal", 0) == 2 and drops.get("no_next_state", 0) == 3, drops
    assert "judge_failed" not in drops
    assert sorted(s.kind for s in samples) == ["rl", "rl+opd"]
    assert [h for s in samples for h in s.hints] == ["Answer in one sentence."]  # no timestamp in the hint
