"""Rollback over HTTP against a live server that trains: the admin route and ``clawloop rollback --url`` serve a
kept version again at once (its exact log-probs), without a restart, while chat requests keep being answered."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import torch

from clawloop.cli import main as cli_main
from clawloop.config import Config
from clawloop.engines.base import ScoreRequest
from clawloop.runtime import build_runtime
from tests.e2e_support import QUESTIONS, conversation

ADMIN_KEY = "rollback-admin-key-31d9"


def _score(engine, prompt, response):
    (result,) = asyncio.run(engine.score([ScoreRequest(prompt_ids=prompt, response_ids=response, top_k=4)]))
    return result


def test_admin_rollback_serves_a_kept_version_at_once(tiny_model_path, tiny_tokenizer, tmp_path):
    torch.set_num_threads(2)
    run_dir = tmp_path / "run"
    config = Config.load(env={}, model=str(tiny_model_path), device="cpu", run_dir=str(run_dir), admin_key=ADMIN_KEY,
                         port=31860, judge_backend="rules", prm_m=1, method="rl", lora=True, lr=1e-2,
                         rollout_batch_size=2, micro_batch_size=2, default_max_tokens=8, num_threads=1,
                         gate_probe_tokens=8, gate_min_guard_pass=0.0)  # word salad: no guard share (e2e_support)
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    prompt = list(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a joke."}],
                                                     add_generation_prompt=True)["input_ids"])
    response = list(tiny_tokenizer("Why did the chicken cross?", add_special_tokens=False)["input_ids"])
    with runtime:
        engine = runtime.server.engine
        v0 = _score(engine, prompt, response)
        url = runtime.server.base_url
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(2):
                conversation(http, f"c{i}", QUESTIONS[i], corrected=i == 0)
            deadline = time.time() + 240
            while engine.policy_version < 1:
                assert time.time() < deadline, f"no version published: {runtime.server.store.count_samples()}"
                time.sleep(0.2)
            v1 = _score(engine, prompt, response)
            assert v1.policy_version == 1 and (v1.logprobs_T - v0.logprobs_T).abs().max() > 1e-5

            # Chat requests go on while the rollback happens.
            answered: list[int] = []
            stop = threading.Event()

            def user() -> None:
                with httpx.Client(base_url=url, timeout=120) as h:
                    while not stop.is_set():
                        r = h.post("/v1/chat/completions", headers={"X-Turn-Type": "side"},
                                   json={"model": "clawloop", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "Hi"}]})
                        answered.append(r.status_code)

            thread = threading.Thread(target=user, daemon=True)
            thread.start()
            try:
                assert http.post("/v1/admin/rollback", json={"version": 0}).status_code == 401
                bad = http.post("/v1/admin/rollback", json={"version": "one"},
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert bad.status_code == 400
                missing = http.post("/v1/admin/rollback", json={"version": 99},
                                    headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert missing.status_code == 404 and "not in" in missing.text
                done = http.post("/v1/admin/rollback", json={"version": 0},
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert done.status_code == 200, done.text
                assert done.json()["version"] == 0 and engine.policy_version == 0
                time.sleep(0.5)
            finally:
                stop.set()
                thread.join(60)
            assert answered and set(answered) == {200}
            again = _score(engine, prompt, response)
            assert again.policy_version == 0
            torch.testing.assert_close(again.logprobs_T, v0.logprobs_T, rtol=0, atol=0)

            # The command line does the same through the route.
            assert cli_main(["rollback", str(run_dir), "--to", "1", "--url", url, "--admin-key", ADMIN_KEY]) == 0
            assert engine.policy_version == 1
            torch.testing.assert_close(_score(engine, prompt, response).logprobs_T, v1.logprobs_T, rtol=0, atol=0)

            listed = http.get("/v1/admin/versions", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
            assert listed["serving"] == 1 and listed["gate"]["on"] is True
            assert [v["version"] for v in listed["versions"]] == [1]
            assert [e["kind"] for e in listed["events"] if e["kind"] == "rollback"] == ["rollback", "rollback"]
