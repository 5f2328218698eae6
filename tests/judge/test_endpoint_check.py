"""Start-up's judge endpoint check against real HTTP servers on 127.0.0.1: a wrong key or path stops start-up
with the setting named; a judge that is down, slow or failing only warns."""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clawloop.cli import main
from clawloop.config import Config
from clawloop.judge.endpoint_check import JudgeEndpointError, check_judge_endpoint
from clawloop.judge.scripted import ScriptedJudgeServer, Status
from clawloop.runtime import build_runtime
from clawloop.serve import free_port
from clawloop.store import Store


class FixedStatusServer:
    """Answers every GET and POST with ``code`` after ``delay_s``; counts the requests."""

    def __init__(self, code: int, delay_s: float = 0.0):
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                length = int(self.headers.get("Content-Length", "0") or 0)
                if length:
                    self.rfile.read(length)
                outer.hits.append(f"{self.command} {self.path}")
                time.sleep(delay_s)
                body = b'{"error": {"message": "scripted"}}'
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up waiting
                    pass

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def status_server():
    servers: list[FixedStatusServer] = []

    def make(code: int, delay_s: float = 0.0) -> FixedStatusServer:
        servers.append(FixedStatusServer(code, delay_s))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def judge_config(url: str, **values) -> Config:
    return Config.load(env={}, judge_url=url, **values)


def test_a_refused_key_stops_with_the_key_setting_named():
    with ScriptedJudgeServer(lambda body: "\\boxed{1}", api_key="right") as server:
        with pytest.raises(JudgeEndpointError) as err:
            check_judge_endpoint(judge_config(server.url, judge_api_key="wrong"))
        message = str(err.value)
        assert "HTTP 401" in message and "judge_api_key" in message and "CLAWLOOP_JUDGE_API_KEY" in message
        assert "the key sent was refused" in message and "wrong" not in message  # the key is never printed
        check_judge_endpoint(judge_config(server.url, judge_api_key="right"))  # the right key passes
        with pytest.raises(JudgeEndpointError, match="no key was sent"):
            check_judge_endpoint(judge_config(server.url))
        assert server.requests == []  # the check asked only GET /models: no vote was spent


def test_forbidden_is_a_key_problem_too(status_server):
    server = status_server(403)
    with pytest.raises(JudgeEndpointError, match="HTTP 403.*judge_api_key"):
        check_judge_endpoint(judge_config(server.url, judge_api_key="k"))


def test_a_path_with_no_api_stops_with_judge_url_named(status_server):
    server = status_server(404)
    with pytest.raises(JudgeEndpointError) as err:
        check_judge_endpoint(judge_config(server.url))
    assert "judge_url (--judge-url, CLAWLOOP_JUDGE_URL)" in str(err.value) and "404" in str(err.value)
    assert server.hits == ["GET /v1/models", "POST /v1/chat/completions"]  # confirmed before stopping


def test_a_model_the_endpoint_does_not_serve_stops_with_judge_model_named():
    def only_known(body):
        return "\\boxed{1}" if body.get("model") == "scripted-judge" else Status(404, "The model does not exist.")

    with ScriptedJudgeServer(only_known) as server:
        with pytest.raises(JudgeEndpointError, match="judge_model .*'nope'|'nope'.*judge_model"):
            check_judge_endpoint(judge_config(server.url, judge_model="nope"))
        check_judge_endpoint(judge_config(server.url, judge_model="scripted-judge"))  # listed: no chat request
        assert [r["model"] for r in server.requests] == ["nope"]


@pytest.mark.parametrize("code", [500, 503])
def test_a_failing_judge_only_warns(status_server, caplog, code):
    server = status_server(code)
    with caplog.at_level(logging.WARNING, logger="clawloop.judge.endpoint_check"):
        check_judge_endpoint(judge_config(server.url))
    assert f"HTTP {code}" in caplog.text


def test_a_judge_that_is_down_or_slow_only_warns(status_server, caplog):
    refused = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    slow = status_server(200, delay_s=3.0)
    with caplog.at_level(logging.WARNING, logger="clawloop.judge.endpoint_check"):
        check_judge_endpoint(judge_config(refused))
        started = time.monotonic()
        check_judge_endpoint(judge_config(slow.url), timeout_s=0.5)
    assert time.monotonic() - started < 2.5  # a slow judge does not hold start-up
    assert caplog.text.count("cannot be reached at start") == 2


def test_start_up_stops_before_any_model_loads_and_leaves_the_store_closed(tmp_path):
    with ScriptedJudgeServer(lambda body: "\\boxed{1}", api_key="right") as server:
        config = Config.load(env={}, model="tiny", port=0, run_dir=str(tmp_path / "run"), judge_url=server.url,
                             judge_api_key="wrong")
        with pytest.raises(JudgeEndpointError, match="judge_api_key"):
            build_runtime(config, console=None)
    store = Store(tmp_path / "run" / "store.sqlite")  # opened for writing again: nothing holds it
    store.close()


def test_clawloop_serve_prints_the_paragraph_and_exits_2(tmp_path, capsys, status_server):
    server = status_server(404)
    code = main(["serve", "--model", "tiny", "--port", "0", "--run-dir", str(tmp_path / "run"),
                 "--judge-url", server.url])
    err = capsys.readouterr().err
    assert code == 2
    assert "clawloop serve:" in err and "judge_url" in err and "Traceback" not in err
