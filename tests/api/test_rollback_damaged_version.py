"""Rollback over HTTP to a kept version whose files are damaged: a 409 in OpenAI's error shape that names the
version and the file, and the served weights stay exactly as they were (same version, same log-probs)."""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import torch

from clawloop.config import Config
from clawloop.engines.base import ScoreRequest
from clawloop.runtime import build_runtime
from clawloop.trainer import versions as history
from tests.e2e_support import QUESTIONS, conversation

ADMIN_KEY = "damaged-rollback-admin-key-80c2"


def _score(engine, prompt, response):
    (result,) = asyncio.run(engine.score([ScoreRequest(prompt_ids=prompt, response_ids=response, top_k=4)]))
    return result


def _cut_short(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_rollback_to_a_damaged_version_is_refused_and_serving_is_untouched(tiny_model_path, tiny_tokenizer,
                                                                          tmp_path):
    torch.set_num_threads(2)
    run_dir = tmp_path / "run"
    config = Config.load(env={}, model=str(tiny_model_path), device="cpu", run_dir=str(run_dir), admin_key=ADMIN_KEY,
                         port=0, judge_backend="rules", prm_m=1, method="rl", lora=True, lr=1e-2,
                         rollout_batch_size=2, micro_batch_size=2, default_max_tokens=8, num_threads=1, gate=False)
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    prompt = list(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a joke."}],
                                                     add_generation_prompt=True)["input_ids"])
    response = list(tiny_tokenizer("Why did the chicken cross?", add_special_tokens=False)["input_ids"])
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with runtime:
        engine = runtime.server.engine
        with httpx.Client(base_url=runtime.server.base_url, timeout=120) as http:
            for i in range(2):
                conversation(http, f"c{i}", QUESTIONS[i], corrected=i == 0)
            deadline = time.time() + 240
            while engine.policy_version < 1:
                assert time.time() < deadline, f"no version published: {runtime.server.store.count_samples()}"
                time.sleep(0.2)
            served = _score(engine, prompt, response)
            assert served.policy_version == 1

            damages = [(0, "version.json", lambda p: p.write_text('{"version": 0, "st')),
                       (0, "weights.safetensors", _cut_short),
                       (1, "optimizer.pt", _cut_short)]
            for version, name, damage in damages:
                folder = history.version_dir(run_dir, version)
                intact = tmp_path / f"intact-v{version}-{name}"
                shutil.copytree(folder, intact)
                damage(folder / name)
                refused = http.post("/v1/admin/rollback", json={"version": version}, headers=admin)
                assert refused.status_code == 409, (name, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "version_damaged" and error["param"] == "version"
                assert error["type"] == "invalid_request_error"
                assert f"Version {version}" in error["message"] and name in error["message"]
                assert "Expecting" not in error["message"]  # no raw parser text
                after = _score(engine, prompt, response)
                assert engine.policy_version == 1 and after.policy_version == 1
                torch.testing.assert_close(after.logprobs_T, served.logprobs_T, rtol=0, atol=0)
                shutil.rmtree(folder)
                shutil.copytree(intact, folder)

            # Once the folder is whole again the same rollback goes through.
            done = http.post("/v1/admin/rollback", json={"version": 0}, headers=admin)
            assert done.status_code == 200, done.text
            assert engine.policy_version == 0
