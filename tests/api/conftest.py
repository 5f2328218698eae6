"""Fixtures for the API tests: live uvicorn servers on free ports of 127.0.0.1, serving the tiny model.

* ``make_server(**settings)`` (function): start a ``clawloop.serve.Server`` on a fresh run folder (or the
  ``run_dir`` given) with the shared ``tiny_engine`` and the given Config settings; stopped after the test.
  ``engine=`` swaps in another engine, ``on_judgeable=`` attaches the hook.
* ``server`` (function): ``make_server()`` with the test defaults.
* ``client`` (function): the official ``openai`` client pointed at ``server``.
* ``http`` (function): an ``httpx.Client`` on ``server`` for raw requests.
* ``wait_for(predicate)`` (function): poll until true (no timing assertions: only a generous deadline).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from clawloop.config import Config
from clawloop.serve import Server

TEST_SETTINGS = {"model": "tiny", "port": 0, "default_max_tokens": 8, "num_threads": 2, "max_batch_size": 8}


@pytest.fixture
def make_server(tmp_path, tiny_engine):
    servers: list[Server] = []
    counter = {"n": 0}

    def make(engine=None, on_judgeable=None, run_dir: Path | None = None, **settings) -> Server:
        counter["n"] += 1
        folder = run_dir if run_dir is not None else tmp_path / f"run{counter['n']}"
        config = Config.load(env={}, **{**TEST_SETTINGS, "run_dir": str(folder), **settings})
        srv = Server(config, engine=engine or tiny_engine, on_judgeable=on_judgeable)
        servers.append(srv)
        return srv.start()

    yield make
    for srv in servers:
        srv.stop()


@pytest.fixture
def server(make_server) -> Server:
    return make_server()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(interval_s)


@pytest.fixture
def wait_for():
    return _wait_for
