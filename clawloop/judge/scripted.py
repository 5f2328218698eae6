"""A scripted OpenAI-compatible judge server: real HTTP on 127.0.0.1, answers decided by a Python function.

Used by the fault and crash tests (a judge that hangs, fails or talks nonsense) and for dry runs without a judge
model. ``responder(body)`` gets the parsed request body and returns one of:

* a string — sent back as the assistant message content (HTTP 200, OpenAI shape);
* ``Hang(seconds)`` — the server holds the connection that long, then closes it without an answer;
* ``Status(code, text)`` — an HTTP error;
* ``Raw(bytes)`` — a 200 response whose body is exactly those bytes (garbage JSON, truncated bodies, ...).

The server is a ``ThreadingHTTPServer`` (standard library only) on a free port, one thread per connection, so a
hanging request does not block the others. ``in_flight_max`` records the most requests ever open at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Hang:
    seconds: float


@dataclass(frozen=True)
class Status:
    code: int
    text: str = ""


@dataclass(frozen=True)
class Raw:
    body: bytes


Reply = str | Hang | Status | Raw


def last_user_text(body: dict[str, Any]) -> str:
    """The text of the last user message of a chat request (where the judge prompts put the evidence)."""
    for message in reversed(body.get("messages", [])):
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content)
    return ""


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (timed out, was killed) is normal here; anything else is reported."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ScriptedJudgeServer:
    def __init__(self, responder: Callable[[dict[str, Any]], Reply], *, model: str = "scripted-judge",
                 api_key: str = ""):
        self.responder = responder
        self.model = model
        self.api_key = api_key
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.in_flight_max = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _send(self, code: int, payload: bytes, content_type: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _authorised(self) -> bool:
                if not server.api_key:
                    return True
                if self.headers.get("Authorization", "") == f"Bearer {server.api_key}":
                    return True
                self._send(401, b'{"error": {"message": "bad key", "type": "auth"}}')
                return False

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if not self._authorised():
                    return
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [
                        {"id": server.model, "object": "model"}]}).encode())
                else:
                    self._send(404, b'{"error": {"message": "not found"}}')

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0") or 0)
                raw = self.rfile.read(length) if length else b""
                if not self._authorised():
                    return
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    self._send(400, b'{"error": {"message": "bad json"}}')
                    return
                with server._lock:
                    server.requests.append(body)
                    server.in_flight += 1
                    server.in_flight_max = max(server.in_flight_max, server.in_flight)
                try:
                    reply = server.responder(body)
                    if isinstance(reply, Hang):
                        server._stopping.wait(reply.seconds)
                        self.close_connection = True
                        return
                    if isinstance(reply, Status):
                        self._send(reply.code, json.dumps({"error": {"message": reply.text or "scripted"}}).encode())
                        return
                    if isinstance(reply, Raw):
                        self._send(200, reply.body)
                        return
                    self._send(200, json.dumps({
                        "id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion",
                        "created": int(time.time()), "model": server.model,
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": str(reply)}}],
                    }).encode())
                finally:
                    with server._lock:
                        server.in_flight -= 1

        self._httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="scripted-judge", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "ScriptedJudgeServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # release hanging handlers
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "ScriptedJudgeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_forever_from_cli() -> None:  # pragma: no cover - manual dry runs
    """``python -m clawloop.judge.scripted``: a judge that always votes +1 with no hint, for smoke tests."""
    with ScriptedJudgeServer(lambda body: "\\boxed{1}") as server:
        print(server.url, flush=True)
        threading.Event().wait()


if __name__ == "__main__":  # pragma: no cover
    serve_forever_from_cli()
