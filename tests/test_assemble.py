"""The composition root (``clawloop.assemble``): what runs beside serving, with training on and off, and a killed
vLLM server restarted while training is on. The vLLM servers are a real stand-in process (tests/engines/
test_fleet.py's ``FAKE_VLLM``) listening on a real port; the tokenizer and training model are the tiny model's."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import pytest

from clawloop.config import Config
from clawloop.fleet import FleetSupervisor
from clawloop.pipeline import Pipeline
from clawloop.runtime import build_runtime
from clawloop.serve import Server
from clawloop.trainer.loop import OnlineTrainer
from tests.test_fleet import FAKE_VLLM


@pytest.fixture
def fake_vllm_python(tmp_path):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return python


def vllm_config(tmp_path, python, **values) -> Config:
    return Config.load(env={}, model="tiny", port=0, run_dir=str(tmp_path / "run"), engine="vllm", method="rl",
                       judge_backend="rules", lora=True, num_threads=2, max_batch_size=4,
                       vllm_policy={"python": str(python), "startup_timeout_s": 60.0}, **values)


def wait_until(predicate, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_with_training_on_a_killed_policy_server_is_restarted(tmp_path, fake_vllm_python):
    config = vllm_config(tmp_path, fake_vllm_python)
    assert config.train and config.trainer == "embedded"  # the default: training on, in this process
    runtime = build_runtime(config, console=None, supervise_interval_s=0.3, pipeline_poll_s=0.2)
    with runtime:
        kinds = [type(c) for c in runtime.server.components]
        assert kinds == [FleetSupervisor, Pipeline, OnlineTrainer]  # the supervisor is not dropped by training
        supervisor = runtime.server.components[0]
        policy = runtime.server.fleet.policy
        url, first_pid = policy.url, policy.process.pid
        os.killpg(first_pid, signal.SIGKILL)
        policy.process.wait(10)
        wait_until(lambda: supervisor.restarted == ["policy"], what="the supervisor to restart the policy server")
        assert policy.process.pid != first_pid and policy.url == url
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        # Serving goes on against the restarted server: the API still answers with the policy's model card.
        with httpx.Client(base_url=runtime.server.base_url, timeout=30) as http:
            assert http.get("/v1/models").json()["data"][0]["id"] == config.served_model_name
    with pytest.raises(httpx.HTTPError):  # stopping the runtime stopped the server it started
        httpx.get(url + "/health", timeout=2)


def test_with_training_off_the_supervisor_still_runs_and_nothing_learns(tmp_path, fake_vllm_python):
    server = Server(vllm_config(tmp_path, fake_vllm_python, train=False), supervise_interval_s=0.3)
    try:
        server.build()
        assert [type(c) for c in server.components] == [FleetSupervisor]
        assert server.parts.pipeline is None and server.parts.trainer is None and server.parts.judge is None
    finally:
        server.stop()
