"""The composition root (``clawloop.assemble``): what runs beside serving, with training on and off, and a killed
vLLM server restarted while training is on. The vLLM servers are a real stand-in process (tests/engines/
test_fleet.py's ``FAKE_VLLM``) listening on a real port; the tokenizer and training model are the tiny model's."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from clawloop.config import Config
from clawloop.engines.base import EngineError
from clawloop.fleet import FleetSupervisor
from clawloop.pipeline import Pipeline
from clawloop.runtime import build_runtime
from clawloop.serve import Server
from clawloop.trainer.loop import OnlineTrainer
from tests.test_fleet import FAKE_VLLM
from tests.test_fleet import fake_vllm_python as write_fake_vllm


@pytest.fixture
def fake_vllm_python(tmp_path):
    return write_fake_vllm(tmp_path, FAKE_VLLM)


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


RAW_LOGPROBS_VLLM = FAKE_VLLM.replace("ThreadingHTTPServer((", textwrap.dedent('''
    def do_POST(self):  # completions whose log-probs ignore the temperature, as vLLM's default raw mode
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        choice = {"text": "", "token_ids": [0], "finish_reason": "length",
                  "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:0"],
                               "top_logprobs": [{"token_id:0": -1.0, "token_id:1": -2.0}]}}
        body = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    Handler.do_POST = do_POST
''') + "ThreadingHTTPServer((")
assert RAW_LOGPROBS_VLLM != FAKE_VLLM


def test_an_attached_server_reporting_untempered_log_probs_is_refused_at_start(tmp_path):
    """A vLLM server attached by URL but started without --logprobs-mode processed_logprobs reports the model's raw
    log-probs whatever the temperature: every answer would be trained on with the log-probs of another
    distribution than it was drawn from. Serving does not start, and says what to change."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(RAW_LOGPROBS_VLLM)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, script, "-m", "vllm", "--port", str(port), "--served-model-name",
                                "policy"])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url + "/health"), what="the fake server")
        server = Server(Config.load(env={}, model="tiny", port=0, run_dir=str(tmp_path / "run"), engine="vllm",
                                    method="rl", judge_backend="rules", lora=True, num_threads=2, max_batch_size=4,
                                    train=False, policy_url=url, policy_model="policy"))
        server.build()
        try:
            with pytest.raises(RuntimeError, match="failed to start"):
                server.start()

            async def serving_starts() -> None:  # the same start-up, where its error can be read
                async with server.parts.lifespan(server.app):
                    pass

            with pytest.raises(EngineError, match="untempered log-probs; start vLLM with --logprobs-mode "
                                                  "processed_logprobs"):
                asyncio.run(serving_starts())
        finally:
            server.stop()
    finally:
        process.kill()
        process.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
