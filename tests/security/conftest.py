"""Fixtures for the security tests: live servers of the tiny model on 127.0.0.1, and raw HTTP on one socket.

* ``make_server(**settings)`` and ``wait_for`` (function): as in tests/api (a fresh run folder per server).
* ``shared_server`` (module): one server with no key, for tests that only send requests.
* ``RawConnection(port)``: one keep-alive TCP connection; ``request(method, path, body, headers)`` sends one
  HTTP/1.1 request and returns (status, headers, body). Used to prove a connection survives an error and to
  send bytes no HTTP client library would (non-latin-1 header values).
* ``ready_sample(store, i)``: a turn moved through the store's states to a ``ready`` sample (no model needed).
"""

from __future__ import annotations

import json
import socket

import pytest

from clawloop.config import Config
from clawloop.serve import Server
from clawloop.store import SampleRecord, TurnRecord
from tests.api.conftest import TEST_SETTINGS, make_server, wait_for  # noqa: F401 - fixtures used by the tests


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, tiny_engine):
    config = Config.load(env={}, **{**TEST_SETTINGS, "run_dir": str(tmp_path_factory.mktemp("shared"))})
    srv = Server(config, engine=tiny_engine).start()
    yield srv
    srv.stop()


def ready_sample(store, i: int) -> int:
    turn = TurnRecord(session_id=f"victim-{i}", messages=[{"role": "user", "content": f"private question {i}"}],
                      prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-1.0, -1.0], temperature=1.0, top_p=1.0,
                      policy_version=0, assistant_message={"role": "assistant", "content": "answer"})
    tid = store.add_turn(turn)
    assert store.set_next_state(tid, [{"role": "user", "content": "thanks"}])
    assert [t.id for t in store.claim_judgeable(1)] == [tid]
    assert store.put_sample(SampleRecord(turn_id=tid, reward=1.0, kind="rl"))
    return tid


class RawConnection:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout_s: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.host = f"{host}:{port}"
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, method: str, path: str, body: bytes | dict | None = None,
             headers: dict[str, str | bytes] | None = None) -> None:
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        head = {"Host": self.host, "Content-Type": "application/json"}
        head.update(headers or {})
        lines = [f"{method} {path} HTTP/1.1".encode()]
        for k, v in head.items():
            if v is None:
                continue
            lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode("latin-1")))
        if body is not None:
            lines.append(f"Content-Length: {len(body)}".encode())
        self.sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + (body or b""))

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk
        out, self.buffer = self.buffer.split(marker, 1)
        return out

    def _read_n(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        head = self._read_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = self._read_n(int(headers["content-length"]))
        else:  # chunked
            body = b""
            while True:
                size = int(self._read_until(b"\r\n"), 16)
                data = self._read_n(size + 2)[:size]
                if size == 0:
                    break
                body += data
        return status, headers, body

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str | bytes] | None = None) -> tuple[int, dict[str, str], bytes]:
        self.send(method, path, body, headers)
        return self.response()


def assert_openai_error(status: int, body: bytes, code: str | None = None) -> dict:
    assert 400 <= status < 600, status
    payload = json.loads(body)
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, payload
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, payload
    return err
