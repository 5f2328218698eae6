"""Which vLLM servers a config asks for, with what settings, how they are guarded, and their supervision (a fake
vLLM process)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from clawloop.config import Config, ConfigError
from clawloop.engines import vllm_server
from clawloop.engines.base import EngineError
from clawloop.engines.vllm_server import LAUNCH_ENV, VLLMServer, free_port
from clawloop.fleet import Fleet, FleetSupervisor, needs_teacher_server, server_settings, stop_leftover


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


def test_attached_servers_are_sent_the_keys_they_ask_for(model_dir, tmp_path):
    """A server started elsewhere (python -m clawloop.engines.vllm_server with an api_key) is called with its key:
    by the engines, the publisher, and the judge when it falls to the teacher server."""
    config = config_for(model_dir, tmp_path, engine="vllm", method="rl", policy_url="http://gpu1:8001",
                        policy_api_key="policy-key-1", teacher_url="http://gpu2:8002", teacher_api_key="teacher-key-2")
    fleet = Fleet.plan(config)
    assert fleet.policy.api_key == "policy-key-1" and fleet.teacher.api_key == "teacher-key-2"
    assert fleet.policy.engine().api_key == "policy-key-1"
    resolved = fleet.resolve(config)
    assert resolved.judge_url == "http://gpu2:8002/v1" and resolved.judge_api_key == "teacher-key-2"
    with pytest.raises(ConfigError, match="policy_api_key is the key of the server at policy_url"):
        config_for(model_dir, tmp_path, engine="vllm", policy_api_key="k")


def test_judge_falls_to_the_teacher_server_over_http(model_dir, tmp_path):
    config = config_for(model_dir, tmp_path, engine="vllm", policy_url="http://gpu1:8001",
                        teacher_url="http://gpu2:8002", judge_extra_body={"structured_outputs": {"regex": "x"}})
    resolved = Fleet.plan(config).resolve(config)
    assert resolved.judge_url == "http://gpu2:8002/v1" and resolved.judge_model == "base"
    explicit = config_for(model_dir, tmp_path, engine="vllm", policy_url="http://gpu1:8001",
                          teacher_url="http://gpu2:8002", judge_backend="engine")
    assert Fleet.plan(explicit).resolve(explicit).judge_url == ""  # the engine judge runs on the teacher engine


FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vLLM's OpenAI server: /health and /v1/models, on the --port it is given, its answers marked
    with its launch id as the guard clawloop loads into vLLM marks them."""
    import json, os, sys
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
            self.send_header("x-clawloop-launch", os.environ.get("CLAWLOOP_VLLM_LAUNCH", ""))
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


LINGERING = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
"""A process that ignores SIGTERM (as a stuck server may), ready once it printed a line."""


def lingering(launch_id: str) -> subprocess.Popen:
    """A process of launch ``launch_id``, as VLLMServer starts them: its own session, the id in its environment, a
    vLLM server's command line."""
    process = subprocess.Popen([sys.executable, "-c", LINGERING, "-m", "vllm.entrypoints.openai.api_server"],
                               env={**os.environ, LAUNCH_ENV: launch_id}, stdout=subprocess.PIPE,
                               start_new_session=True)
    process.stdout.readline()
    return process


def test_a_server_left_by_a_killed_run_is_stopped_by_the_next_start(tmp_path):
    leftover, other_run = lingering("launch-of-the-killed-run"), lingering("launch-of-another-run")
    try:
        pid_file = tmp_path / "vllm-policy.pid"
        # The recorded pid was reused by another run's server: the launch id, not the pid, says what is ours.
        pid_file.write_text(json.dumps({"pid": other_run.pid, "launch": "a-launch-long-gone"}))
        assert stop_leftover(pid_file) is False and other_run.poll() is None
        pid_file.write_text(json.dumps({"pid": leftover.pid, "launch": "launch-of-the-killed-run"}))
        assert stop_leftover(pid_file, grace_s=0.5) is True
        # It ignored SIGTERM, so it was killed. By the time stop_leftover returned its memory was gone (it waits until
        # the process has no environment left to read); the exit can still be finishing, so reaping it may wait.
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert other_run.poll() is None
        assert stop_leftover(tmp_path / "missing.pid") is False
        pid_file.write_text(str(other_run.pid))  # an older version's pid file: nothing to tell its server by
        assert stop_leftover(pid_file) is False and other_run.poll() is None
    finally:
        leftover.kill()
        other_run.kill()


def test_a_leftover_that_may_not_be_signalled_does_not_stop_the_start(tmp_path, monkeypatch):
    leftover = lingering("launch-of-the-killed-run")
    try:
        pid_file = tmp_path / "vllm-policy.pid"
        pid_file.write_text(json.dumps({"pid": leftover.pid, "launch": "launch-of-the-killed-run"}))

        def refuse(*_):
            raise PermissionError("not allowed")

        monkeypatch.setattr(os, "kill", refuse)
        monkeypatch.setattr(os, "killpg", refuse)
        started = time.monotonic()
        assert stop_leftover(pid_file, grace_s=5.0) is True  # found; the port check then says what holds the port
        assert time.monotonic() - started < 5.0  # nothing to wait for when no signal could be sent
    finally:
        monkeypatch.undo()
        leftover.kill()


def fake_vllm_python(tmp_path: Path, source: str) -> Path:
    """An executable that runs ``source`` with this interpreter, given a vLLM server's arguments."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(source)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    return python


def test_the_pid_file_follows_every_start_of_the_server(model_dir, tmp_path):
    python = fake_vllm_python(tmp_path, FAKE_VLLM)
    config = config_for(model_dir, tmp_path, engine="vllm", method="rl", judge_backend="rules", lora=True,
                        vllm_policy={"python": str(python), "startup_timeout_s": 30.0})
    fleet = Fleet.plan(config).start()
    pid_file = tmp_path / "run" / "logs" / "vllm-policy.pid"
    try:
        first = json.loads(pid_file.read_text())
        assert first == {"pid": fleet.policy.process.pid, "launch": fleet.policy.launch_id}
        os.killpg(fleet.policy.process.pid, signal.SIGKILL)
        fleet.policy.process.wait(10)
        assert fleet.policy.ensure_running()
        second = json.loads(pid_file.read_text())  # a run killed now leaves the restarted server findable
        assert second == {"pid": fleet.policy.process.pid, "launch": fleet.policy.launch_id} != first
    finally:
        fleet.stop()
    assert not pid_file.exists()


GUARDED_VLLM = textwrap.dedent('''
    """A stand-in for vLLM's OpenAI server as an ASGI app: it loads every --middleware as vLLM does (a class is
    wrapped around the app) and answers 200 everywhere, dev-mode routes included."""
    import importlib, json, sys
    import uvicorn
    args = sys.argv[sys.argv.index("-m") + 2:]
    port = int(args[args.index("--port") + 1])
    name = args[args.index("--served-model-name") + 1]

    async def app(scope, receive, send):
        answer = {"data": [{"id": name, "max_model_len": 2048}]} if scope["path"] == "/v1/models" else {}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    for flag, value in zip(args, args[1:]):
        if flag == "--middleware":
            module, attribute = value.rsplit(".", 1)
            app = getattr(importlib.import_module(module), attribute)(app)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
''')

WEIGHT_ROUTES = ("/collective_rpc", "/pause?mode=wait", "/update_weight_version", "/v1/load_lora_adapter")


@pytest.mark.parametrize("configured_key", ["", "a-key-of-the-operator"])
def test_every_managed_server_has_a_key_and_asks_for_it_on_every_route(model_dir, tmp_path, configured_key):
    python = fake_vllm_python(tmp_path, GUARDED_VLLM)
    section = {"python": str(python), "startup_timeout_s": 30.0}
    if configured_key:
        section["api_key"] = configured_key
    config = config_for(model_dir, tmp_path, engine="vllm", method="rl", judge_backend="rules", vllm_policy=section)
    fleet = Fleet.plan(config)
    key = fleet.policy.settings.api_key
    if configured_key:
        assert key == configured_key
    else:  # random, and another run's is another
        assert len(key) >= 32 and key != Fleet.plan(config).policy.settings.api_key
    assert fleet.policy.settings.dev_mode  # full fine-tuning: the routes that swap weights are on
    fleet.start()
    try:
        url = fleet.policy.url
        for route in WEIGHT_ROUTES:
            assert httpx.post(url + route, json={}).status_code == 401, route
            assert httpx.post(url + route, json={}, headers={"Authorization": "Bearer guess"}).status_code == 401
            assert httpx.post(url + route, json={}, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # liveness probes carry no key
        assert fleet.policy.engine().api_key == key  # the engine, and the publisher that calls through it
        assert VLLMServer.attach(url).api_key == key  # another part of this process attaching by URL
    finally:
        fleet.stop()


def test_the_key_reaches_the_server_in_its_environment_never_its_command_line_or_a_log(model_dir, tmp_path, caplog):
    python = fake_vllm_python(tmp_path, FAKE_VLLM)
    key = "k-" + "s3cret" * 6
    config = config_for(model_dir, tmp_path, engine="vllm", method="rl", judge_backend="rules",
                        vllm_policy={"python": str(python), "startup_timeout_s": 30.0, "api_key": key})
    fleet = Fleet.plan(config)
    log_file = Path(fleet.policy.settings.log_file)
    log_file.parent.mkdir(parents=True)
    log_file.write_text("an earlier run's output\n")
    log_file.chmod(0o644)
    with caplog.at_level(logging.DEBUG):
        fleet.start()
    try:
        pid = fleet.policy.process.pid
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()  # readable by every local user
        assert f"VLLM_API_KEY={key}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    finally:
        fleet.stop()
    assert key not in caplog.text and key not in log_file.read_text()
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="as api_key"):
        config_for(model_dir, tmp_path, engine="vllm", vllm_policy={"extra_args": [f"--api-key={key}"]})


def test_a_judge_on_a_keyed_server_is_sent_its_key(model_dir, tmp_path):
    on_teacher = config_for(model_dir, tmp_path, engine="vllm", method="rl")  # the judge falls to the teacher
    fleet = Fleet.plan(on_teacher)
    fleet.policy._url, fleet.teacher._url = "http://127.0.0.1:8001", "http://127.0.0.1:8002"  # as start() sets them
    resolved = fleet.resolve(on_teacher)
    assert resolved.judge_url == "http://127.0.0.1:8002/v1"
    assert resolved.judge_api_key == fleet.teacher.api_key != ""
    own_judge = config_for(model_dir, tmp_path, engine="vllm", method="rl", vllm_judge={"api_key": "judge-key"})
    fleet = Fleet.plan(own_judge)
    for server in fleet.servers.values():
        server._url = "http://127.0.0.1:8003"
    assert fleet.resolve(own_judge).judge_api_key == "judge-key"


def serve_a_stranger(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """Another run's server on a port of its own (not started by the VLLMServer under test)."""
    script = tmp_path / "stranger.py"
    script.write_text(FAKE_VLLM)
    port = free_port()
    process = subprocess.Popen([sys.executable, str(script), "-m", "vllm", "--port", str(port), "--served-model-name",
                                "base"], env={**os.environ, LAUNCH_ENV: "the-other-run"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                return process, port
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the stranger did not start")


def policy_fleet_on(model_dir, tmp_path, python: Path, port: int) -> Fleet:
    """The planned fleet of a run whose policy server ``python`` starts on the fixed ``port``."""
    config = config_for(model_dir, tmp_path, engine="vllm", method="rl", judge_backend="rules",
                        vllm_policy={"python": str(python), "port": port, "startup_timeout_s": 10.0})
    return Fleet.plan(config)


@pytest.fixture
def stranger_port(tmp_path):
    """The port of another process's server, which answers on it for the test."""
    stranger, port = serve_a_stranger(tmp_path)
    yield port
    stranger.kill()
    stranger.wait(10)


def test_a_port_another_process_holds_is_refused_before_launching(model_dir, tmp_path, stranger_port):
    port = stranger_port
    fleet = policy_fleet_on(model_dir, tmp_path, fake_vllm_python(tmp_path, FAKE_VLLM), port)
    with pytest.raises(EngineError, match=f"port {port} .*another process holds it"):
        fleet.start()
    assert fleet.policy.process is None  # nothing was launched


def test_a_stranger_answering_on_the_port_is_not_taken_for_the_server_started_here(model_dir, tmp_path, monkeypatch,
                                                                                   stranger_port):
    """Should the port check miss it (another server binding the port while ours starts), readiness still tells."""
    port = stranger_port
    monkeypatch.setattr(vllm_server, "port_taken", lambda host, port: False, raising=False)
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 60\n")  # ours is still loading: only the stranger answers
    python.chmod(0o755)
    fleet = policy_fleet_on(model_dir, tmp_path, python, port)
    with pytest.raises(EngineError, match=f"another process answers on port {port}"):
        fleet.start()
    assert fleet.policy.process is None  # ours was stopped


class StubServer:
    """A managed server whose ``ensure_running`` answers from a script: True (restarted), False, or an error."""

    managed = True
    url = "http://stub"

    def __init__(self, *answers):
        self.answers = list(answers)
        self.checks = 0

    def ensure_running(self):
        self.checks += 1
        answer = self.answers.pop(0) if self.answers else False
        if isinstance(answer, Exception):
            raise answer
        return answer


class FlakyPublisher:
    def __init__(self, failures: int):
        self.failures = failures
        self.attempts = 0

    async def restore(self):
        self.attempts += 1
        if self.attempts <= self.failures:
            raise EngineError("the server answered 503")


def test_a_failed_restore_is_tried_again_at_the_next_check():
    fleet = Fleet(policy=StubServer(True), publisher=FlakyPublisher(failures=1))
    supervisor = FleetSupervisor(fleet)
    with pytest.raises(EngineError, match="503"):
        asyncio.run(supervisor.check_once())
    assert asyncio.run(supervisor.check_once()) == []  # alive now, but still on the base weights
    assert fleet.publisher.attempts == 2
    assert supervisor.restarted == ["policy"]
    asyncio.run(supervisor.check_once())
    assert fleet.publisher.attempts == 2  # restored: nothing more to do


def test_one_roles_failure_does_not_keep_the_others_from_being_checked():
    fleet = Fleet(policy=StubServer(EngineError("died and was already restarted 3 times")),
                  teacher=StubServer(True), judge=StubServer(False))
    supervisor = FleetSupervisor(fleet)
    with pytest.raises(EngineError, match="died and was already restarted"):
        asyncio.run(supervisor.check_once())
    assert fleet.teacher.checks == 1 and fleet.judge.checks == 1
    assert supervisor.restarted == ["teacher"]
