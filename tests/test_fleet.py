"""Which vLLM servers a config asks for, with what settings, and their supervision (a fake vLLM process)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time

import httpx
import pytest

from clawloop.config import Config
from clawloop.fleet import Fleet, FleetSupervisor, needs_teacher_server, server_settings


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"vocab_size": 49152}')
    return folder


def config_for(model_dir, tmp_path, **values):
    return Config.load(env={}, model=str(model_dir), run_dir=str(tmp_path / "run"), **values)


def test_embedded_runs_start_no_server(model_dir, tmp_path):
    assert Fleet.plan(config_for(model_dir, tmp_path)).servers == {}


def test_lora_policy_serves_adapters_and_hybrid_needs_a_frozen_teacher(model_dir, tmp_path):
    config = config_for(model_dir, tmp_path, engine="vllm", lora=True, lora_rank=32,
                        vllm_policy={"port": 8001, "env": {"CUDA_VISIBLE_DEVICES": "4,5"}})
    fleet = Fleet.plan(config)
    assert set(fleet.servers) == {"policy", "teacher"}
    policy, teacher = fleet.policy.settings, fleet.teacher.settings
    assert policy.model == str(model_dir) and policy.port == 8001 and policy.env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert policy.enable_lora and policy.max_lora_rank == 32 and not policy.dev_mode
    # The teacher scores with prompt log-probs, which crash a LoRA-enabled CPU server: never LoRA.
    assert not teacher.enable_lora
    assert teacher.log_file.endswith("logs/vllm-teacher.log")
    assert "--enable-lora" in policy.command("python") and "--enable-lora" not in teacher.command("python")


def test_full_fine_tuning_policy_runs_in_dev_mode_for_checkpoint_reloads(model_dir, tmp_path):
    settings = server_settings(config_for(model_dir, tmp_path, engine="vllm"), "policy", model_dir)
    assert settings.dev_mode and not settings.enable_lora
    assert settings.environment({})["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize("values, teacher", [
    ({"method": "rl", "judge_backend": "rules"}, False),  # no hints, no model judge: no frozen server
    ({"method": "rl"}, True),  # the judge falls to the frozen base model
    ({"method": "rl", "judge_url": "https://api.example.com/v1"}, False),
    ({"method": "opd", "judge_url": "https://api.example.com/v1"}, True),  # the teacher distils
    ({"method": "opd", "judge_url": "https://api.example.com/v1", "teacher": "policy"}, False),
    ({"method": "hybrid", "train": False}, False),  # serving only: nothing is judged or distilled
])
def test_teacher_server_only_when_something_needs_the_frozen_model(model_dir, tmp_path, values, teacher):
    config = config_for(model_dir, tmp_path, engine="vllm", **values)
    assert needs_teacher_server(config) is teacher
    assert ("teacher" in Fleet.plan(config).servers) is teacher


def test_attached_servers_are_not_managed_and_urls_resolve(model_dir, tmp_path):
    config = config_for(model_dir, tmp_path, engine="vllm", policy_url="http://gpu1:8001",
                        teacher_url="http://gpu2:8002", teacher_model="smol", vllm_judge={"port": 8003})
    fleet = Fleet.plan(config)
    assert not fleet.policy.managed and not fleet.teacher.managed and fleet.judge.managed
    assert fleet.teacher.served_model_name == "smol"
    fleet.judge._url = "http://127.0.0.1:8003"  # as start() would set it
    resolved = fleet.resolve(config)
    assert resolved.policy_url == "http://gpu1:8001" and resolved.judge_url == "http://127.0.0.1:8003/v1"
    assert resolved.vllm_judge == {} and resolved.judge_model == "base"


def test_judge_falls_to_the_teacher_server_over_http(model_dir, tmp_path):
    config = config_for(model_dir, tmp_path, engine="vllm", policy_url="http://gpu1:8001",
                        teacher_url="http://gpu2:8002", judge_extra_body={"structured_outputs": {"regex": "x"}})
    resolved = Fleet.plan(config).resolve(config)
    assert resolved.judge_url == "http://gpu2:8002/v1" and resolved.judge_model == "base"
    explicit = config_for(model_dir, tmp_path, engine="vllm", policy_url="http://gpu1:8001",
                          teacher_url="http://gpu2:8002", judge_backend="engine")
    assert Fleet.plan(explicit).resolve(explicit).judge_url == ""  # the engine judge runs on the teacher engine


FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vLLM's OpenAI server: /health and /v1/models, on the --port it is given."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[sys.argv.index("-m") + 2:]
    port = int(args[args.index("--port") + 1])
    name = args[args.index("--served-model-name") + 1]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"{}" if self.path == "/health" else json.dumps(
                {"data": [{"id": name, "max_model_len": 2048}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


class RecordingPublisher:
    def __init__(self):
        self.restores = 0

    async def restore(self):
        self.restores += 1


def test_a_dead_managed_server_is_restarted_and_the_policy_weights_restored(model_dir, tmp_path):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    config = config_for(model_dir, tmp_path, engine="vllm", method="rl", judge_backend="rules", lora=True,
                        vllm_policy={"python": str(python), "startup_timeout_s": 30.0})
    fleet = Fleet.plan(config).start()
    try:
        url = fleet.policy.url
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "base"
        fleet.publisher = RecordingPublisher()
        supervisor = FleetSupervisor(fleet)
        assert asyncio.run(supervisor.check_once()) == []  # alive: nothing to do
        os.killpg(fleet.policy.process.pid, signal.SIGKILL)
        fleet.policy.process.wait(10)
        assert asyncio.run(supervisor.check_once()) == ["policy"]
        assert fleet.publisher.restores == 1
        assert fleet.policy.url == url  # same port: the engine's base URL stays valid
        assert httpx.get(url + "/health").status_code == 200
        assert fleet.policy.restarts == 1
    finally:
        fleet.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=0.5)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the managed server outlived fleet.stop()")


def test_an_attached_policy_server_that_comes_back_gets_the_weights_again(tmp_path):
    import subprocess

    from clawloop.engines.vllm_server import VLLMServer, free_port

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    port = free_port()
    argv = [sys.executable, script, "-m", "vllm", "--port", str(port), "--served-model-name", "base"]

    def launch():
        process = subprocess.Popen(argv)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    return process
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the fake server did not start")

    process = launch()
    fleet = Fleet(policy=VLLMServer.attach(f"http://127.0.0.1:{port}"))
    fleet.publisher = RecordingPublisher()
    supervisor = FleetSupervisor(fleet)
    try:
        assert asyncio.run(supervisor.check_once()) == []
        process.kill()
        process.wait(10)
        assert asyncio.run(supervisor.check_once()) == []  # down: nothing to restore yet, and not restarted by us
        assert fleet.publisher.restores == 0
        process = launch()  # whoever runs it brings it back, with the base weights
        assert asyncio.run(supervisor.check_once()) == ["policy"]
        assert fleet.publisher.restores == 1
        assert asyncio.run(supervisor.check_once()) == []
    finally:
        process.kill()


def test_a_server_left_by_a_killed_run_is_stopped_by_the_next_start(model_dir, tmp_path):
    import subprocess

    from clawloop.fleet import stop_leftover

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    # A process whose command line is a vLLM server's, in its own session, as VLLMServer starts them.
    leftover = subprocess.Popen([sys.executable, str(script), "-m", "vllm.entrypoints.openai.api_server", "--port",
                                 "0", "--served-model-name", "base"], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        pid_file = tmp_path / "vllm-policy.pid"
        pid_file.write_text(str(other.pid))
        assert stop_leftover(pid_file) is False and other.poll() is None  # not a vLLM server: left alone
        pid_file.write_text(str(leftover.pid))
        assert stop_leftover(pid_file) is True
        assert leftover.wait(10) is not None
        assert stop_leftover(tmp_path / "missing.pid") is False
    finally:
        leftover.kill()
        other.kill()
