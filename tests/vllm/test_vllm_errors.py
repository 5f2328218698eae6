"""How the vLLM engine and server launcher fail: always an EngineError that names the URL and what went wrong.

These tests need no vLLM: a missing server is a free port, a misbehaving one is a small local HTTP server, and a
server that cannot start is a fake interpreter. They run in every test session.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clawloop.engines.base import EngineError, PromptTooLongError, SamplingParams, ScoreRequest
from clawloop.engines.vllm import VLLMEngine
from clawloop.engines.vllm_server import VLLMServer, VLLMServerSettings, free_port

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


class FakeServer:
    """An HTTP server answering every POST with ``behaviour`` (a callable of the request count)."""

    def __init__(self, behaviour):
        self.hits = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.hits += 1
                status, body, delay_s = behaviour(owner.hits)
                time.sleep(delay_s)
                payload = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def engine_for(url: str, **kwargs) -> VLLMEngine:
    kwargs.setdefault("max_context", 2048)
    kwargs.setdefault("retries", 2)
    kwargs.setdefault("backoff_s", 0.01)
    return VLLMEngine(url, "base", **kwargs)


def test_missing_server_is_an_engine_error_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    engine = engine_for(url)
    with pytest.raises(EngineError, match="unreachable after 3 attempts") as info:
        asyncio.run(engine.generate([1, 2, 3], PARAMS))
    assert url in str(info.value)
    assert engine.stats["retries"] == 2
    with pytest.raises(EngineError, match=url):
        asyncio.run(engine.score([ScoreRequest([1, 2], [3, 4])]))
    with pytest.raises(EngineError, match=url):
        asyncio.run(engine.connect())


def test_server_errors_are_retried_then_reported():
    def flaky(hit):  # two 503s, then a proper completion
        if hit <= 2:
            return 503, {"error": {"message": "warming up"}}, 0.0
        choice = {"text": "hi", "token_ids": [5, 2], "finish_reason": "stop",
                  "logprobs": {"token_logprobs": [-0.5, -0.1], "tokens": ["token_id:5", "token_id:2"],
                               "top_logprobs": None}}
        return 200, {"choices": [choice]}, 0.0

    with FakeServer(flaky) as server:
        g = asyncio.run(engine_for(server.url).generate([1, 2, 3], PARAMS))
    assert (g.token_ids, g.logprobs, g.text, g.finish_reason) == ([5, 2], [-0.5, -0.1], "hi", "stop")

    with FakeServer(lambda hit: (500, {"error": {"message": "EngineCore encountered an issue"}}, 0.0)) as server:
        engine = engine_for(server.url)
        with pytest.raises(EngineError, match="answered 500: EngineCore encountered an issue"):
            asyncio.run(engine.generate([1, 2, 3], PARAMS))
        assert server.hits == 3  # the first try and two retries


@pytest.mark.parametrize(
    ("status", "body", "match"),
    [
        (200, "<html>not json</html>", "non-JSON"),
        (200, {"object": "list"}, "without choices"),
        (200, {"choices": [{"text": "x", "token_ids": [1, 2], "finish_reason": "stop", "logprobs": None}]},
         "2 token ids but 0 log-probs"),
        (200, {"choices": [{"text": "", "token_ids": [], "finish_reason": "abort", "logprobs": {}}]},
         "finish_reason='abort'"),
        (404, {"error": {"message": "The model `base` does not exist."}}, "not found"),
    ],
)
def test_unexpected_answers_are_reported_with_what_came_back(status, body, match):
    with FakeServer(lambda hit: (status, body, 0.0)) as server:
        engine = engine_for(server.url)
        with pytest.raises(EngineError, match=match) as info:
            asyncio.run(engine.generate([1, 2, 3], PARAMS))
        assert server.url in str(info.value)
        assert server.hits == 1  # answers that are not 5xx are never retried


def test_a_slow_server_times_out_without_retrying():
    with FakeServer(lambda hit: (200, {"choices": []}, 2.0)) as server:
        engine = engine_for(server.url, request_timeout_s=0.3)
        with pytest.raises(EngineError, match="no answer within"):
            asyncio.run(engine.generate([1, 2, 3], PARAMS))
        assert server.hits == 1


def test_prompts_that_do_not_fit_are_refused():
    message = {"error": {"message": "This model's maximum context length is 2048 tokens."}}
    with FakeServer(lambda hit: (400, message, 0.0)) as server:
        # The engine checks what it knows first, without a request...
        engine = engine_for(server.url, max_context=16)
        with pytest.raises(PromptTooLongError, match="exceeds the context length of 16"):
            asyncio.run(engine.generate(list(range(10)), SamplingParams(max_tokens=7)))
        with pytest.raises(PromptTooLongError, match="one spare position"):
            asyncio.run(engine.score([ScoreRequest(list(range(10)), list(range(6)))]))
        assert server.hits == 0
        # ...and maps the server's own refusal to the same error.
        engine = engine_for(server.url, max_context=None)
        with pytest.raises(PromptTooLongError, match="maximum context length"):
            asyncio.run(engine.generate(list(range(10)), SamplingParams(max_tokens=7)))


def test_bad_requests_fail_before_reaching_the_server():
    engine = engine_for(f"http://127.0.0.1:{free_port()}", vocab_size=100, max_logprobs=8)
    for prompt, params, match in [
        ([], PARAMS, "empty"),
        ([1, 100], PARAMS, "outside"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_logprobs=9), "max_logprobs=8"),
    ]:
        with pytest.raises(EngineError, match=match):
            asyncio.run(engine.generate(prompt, params))
    with pytest.raises(EngineError, match="max_logprobs=8"):
        asyncio.run(engine.score([ScoreRequest([1], [2], top_k=9)]))
    assert engine.stats["retries"] == 0


def test_server_without_interpreter_or_model_fails_clearly(tmp_path):
    settings = VLLMServerSettings(model=str(tmp_path), python=str(tmp_path / "no-python"))
    with pytest.raises(EngineError, match="no vLLM interpreter"):
        VLLMServer(settings).start()
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexit 0\n")
    fake_python.chmod(0o755)
    with pytest.raises(EngineError, match="not a local model folder"):
        VLLMServer(VLLMServerSettings(model=str(tmp_path / "missing"), python=str(fake_python))).start()


def test_server_that_dies_while_starting_reports_its_log(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\necho 'ValueError: this model cannot be served' >&2\nexit 3\n")
    fake_python.chmod(0o755)
    server = VLLMServer(VLLMServerSettings(model=str(tmp_path), python=str(fake_python),
                                           log_file=str(tmp_path / "server.log"), startup_timeout_s=60))
    with pytest.raises(EngineError, match="exited with code 3") as info:
        server.start()
    assert "this model cannot be served" in str(info.value)
    assert server.url in str(info.value)


def test_server_that_never_gets_ready_is_stopped_after_the_timeout(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexec sleep 60\n")
    fake_python.chmod(0o755)
    server = VLLMServer(VLLMServerSettings(model=str(tmp_path), python=str(fake_python), startup_timeout_s=2,
                                           log_file=str(tmp_path / "server.log")))
    with pytest.raises(EngineError, match="not ready after 2 s"):
        server.start()
    assert server.process is None and not server.is_alive()  # stopped, not leaked


def test_server_command_line_carries_the_settings_clawloop_relies_on(tmp_path):
    settings = VLLMServerSettings.from_mapping({
        "model": str(tmp_path), "port": 8123, "enable_lora": True, "dev_mode": True, "enforce_eager": True,
        "extra_args": ["--seed", "7"], "api_key": "the-key",
    })
    argv = settings.command("/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv)
    for flag in ("--logprobs-mode processed_logprobs", "--generation-config vllm", "--max-logprobs 64",
                 "--enable-lora", "--enforce-eager", "--port 8123", "--seed 7",
                 "--middleware clawloop_vllm_guard.RequireKey"):
        assert flag in flags
    assert "the-key" not in flags  # a command line is readable by every local user
    env = settings.environment({"PATH": "/bin", "VIRTUAL_ENV": "/work/.venv", "VLLM_API_KEY": "inherited"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and "VIRTUAL_ENV" not in env
    assert env["VLLM_API_KEY"] == "the-key"
    assert "VLLM_API_KEY" not in VLLMServerSettings(model="m").environment({"VLLM_API_KEY": "inherited"})
    with pytest.raises(ValueError, match=r"unknown vLLM server setting\(s\) \[.max_modle_len.\]"):
        VLLMServerSettings.from_mapping({"model": "x", "max_modle_len": 10})


FAKE_VLLM = '''#!{python}
"""Stands in for `python -m vllm.entrypoints.openai.api_server`: serves /health and /v1/models on --port, its answers
marked with its launch id as the guard clawloop loads into vLLM marks them."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
name = args[args.index("--served-model-name") + 1]

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"{{}}" if self.path == "/health" else json.dumps(
            {{"data": [{{"id": name, "max_model_len": 2048}}]}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-clawloop-launch", os.environ.get("CLAWLOOP_VLLM_LAUNCH", ""))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

print("fake vLLM serving", name, "on", port, flush=True)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_a_dead_server_is_restarted_and_an_attached_one_is_left_alone(tmp_path):
    import os
    import signal
    import sys

    (tmp_path / "config.json").write_text('{"vocab_size": 123}')
    fake_python = tmp_path / "python"
    fake_python.write_text(FAKE_VLLM.format(python=sys.executable))
    fake_python.chmod(0o755)
    settings = VLLMServerSettings(model=str(tmp_path), python=str(fake_python), served_model_name="policy",
                                  log_file=str(tmp_path / "server.log"), startup_timeout_s=60, max_restarts=1)
    server = VLLMServer(settings)
    try:
        server.start()
        assert server.is_alive() and server.url == f"http://127.0.0.1:{server.settings.port}"
        assert not server.ensure_running()  # alive: nothing to do
        engine = server.engine()
        assert (engine.max_context, engine.vocab_size, engine.prompt_logprobs) == (2048, 123, True)

        attached = VLLMServer.attach(server.url, served_model_name="policy").start()
        attached.stop()  # not ours to stop
        assert server.is_alive() and attached.is_alive()
        assert asyncio.run(attached.engine().connect())["max_model_len"] == 2048

        first_pid = server.process.pid
        os.killpg(first_pid, signal.SIGKILL)
        server.process.wait(10)
        assert server.ensure_running() and server.restarts == 1
        assert server.is_alive() and server.process.pid != first_pid
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        with pytest.raises(EngineError, match="already restarted 1 times"):
            server.ensure_running()
    finally:
        server.stop()
    assert "fake vLLM serving policy" in (tmp_path / "server.log").read_text()
