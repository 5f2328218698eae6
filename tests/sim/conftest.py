"""Fixtures for the simulation tests.

* ``fake_openai`` (function): a real HTTP server on a free local port speaking just enough of the OpenAI chat
  API (plus clawloop's ``POST /v1/sessions/{id}/end``). It records every request (path, headers, JSON body)
  and answers with ``server.responder(body, headers) -> str`` (settable per test; deterministic). Its
  ``base_url`` is the root, ``base_url + "/v1"`` is what OpenAI clients take.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


class FakeOpenAI:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.responder = lambda body, headers: "Hello."
        self.fail_with: int | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append({"path": self.path, "headers": headers, "body": body})
                if fake.fail_with is not None:
                    return self._send(fake.fail_with, {"error": {"message": "boom", "type": "server_error"}})
                if self.path.endswith("/end") and "/sessions/" in self.path:
                    return self._send(200, {"ended": True})
                if self.path.endswith("/chat/completions"):
                    text = fake.responder(body, headers)
                    return self._send(200, {
                        "id": f"chatcmpl-{len(fake.requests)}",
                        "object": "chat.completion",
                        "model": body.get("model", "fake"),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": text}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    })
                return self._send(404, {"error": {"message": "not found"}})

            def _send(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def chat_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"].endswith("/chat/completions")]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_openai():
    server = FakeOpenAI()
    yield server
    server.close()
