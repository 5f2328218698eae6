"""How the trainer asks the teacher: the ``TeacherClient`` contract and its two implementations.

The old-policy pass (``trainer.old_policy``) hands a micro-batch's ``TeacherRequest``s to ``submit`` and goes
on with the next micro-batch's forward; it collects the answer (``Future.result``) only when it needs it. So a
client never blocks in ``submit``:

* ``InProcessTeacher`` wraps a ``clawloop.teacher.Teacher`` whose engine lives on an event loop: the server's
  (the embedded trainer runs in a worker thread beside it; the call is scheduled there with
  ``run_coroutine_threadsafe``), or, with no loop given (offline training), a loop of its own on a daemon
  thread, started at the first call.
* ``RemoteTeacher`` posts the requests to the server's admin route ``/v1/trainer/teacher``
  (``clawloop.api.teacher_routes``) with the admin key, from a worker thread; transport errors and 502/503/504
  answers are retried with backoff (``clawloop.retry``), anything else is raised. For ``torchrun`` trainers,
  whose process has no engine.

A failed or timed-out call raises from ``Future.result``; the old-policy pass then leaves the OPD branch of
those samples out (never a stale set).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import httpx

from clawloop.retry import Backoff, retry_sync
from clawloop.teacher import Teacher
from clawloop.wire import TeacherRequest, TeacherScores, request_to_json, scores_from_json

RETRY_STATUSES = (502, 503, 504)


class TeacherClient(Protocol):
    """Scores ``TeacherRequest``s without blocking the caller; one ``TeacherScores`` per request, in order."""

    timeout_s: float
    """How long the caller waits for one call's answer before leaving its samples' OPD branch out."""

    def submit(self, requests: list[TeacherRequest]) -> Future[list[TeacherScores]]: ...

    def close(self) -> None: ...


class InProcessTeacher:
    """``Teacher.score`` on the event loop that owns its engine (see the module docstring)."""

    def __init__(self, teacher: Teacher, loop: asyncio.AbstractEventLoop | None = None, *,
                 timeout_s: float = 600.0):
        self.teacher = teacher
        self.loop = loop
        self.timeout_s = float(timeout_s)
        self._own: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, requests: list[TeacherRequest]) -> Future[list[TeacherScores]]:
        return asyncio.run_coroutine_threadsafe(self.teacher.score(requests), self._target())

    def _target(self) -> asyncio.AbstractEventLoop:
        if self.loop is not None:
            if not self.loop.is_running():
                raise RuntimeError("the teacher's event loop is not running")
            return self.loop
        with self._lock:
            if self._own is None:
                self._own = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._own.run_forever, name="clawloop-teacher",
                                                daemon=True)
                self._thread.start()
            return self._own

    def close(self) -> None:
        """Stop the loop this client started (if any); a given loop is its owner's."""
        with self._lock:
            own, thread, self._own, self._thread = self._own, self._thread, None, None
        if own is not None and thread is not None:
            own.call_soon_threadsafe(own.stop)
            thread.join(timeout=10)
            own.close()


class RemoteTeacher:
    """The server's teacher over its admin route (see the module docstring)."""

    def __init__(self, api_url: str, admin_key: str = "", *, timeout_s: float = 600.0, retries: int = 3,
                 backoff_s: float = 0.5):
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._client = httpx.Client(base_url=api_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self.timeout_s = float(timeout_s) * (retries + 1)
        self.backoff = Backoff(retries, backoff_s)
        # Two workers: micro-batch g + 1's call may start before g's answer is read.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="clawloop-remote-teacher")

    def submit(self, requests: list[TeacherRequest]) -> Future[list[TeacherScores]]:
        return self._pool.submit(self.score, requests)

    def score(self, requests: list[TeacherRequest]) -> list[TeacherScores]:
        """Blocking: one call to the route (with retries)."""
        body = {"requests": [request_to_json(r) for r in requests]}

        def attempt(_: int) -> httpx.Response:
            response = self._client.post("/v1/trainer/teacher", json=body)
            if response.status_code in RETRY_STATUSES:
                response.raise_for_status()
            return response

        response = retry_sync(attempt, self.backoff, retryable=_retryable)
        response.raise_for_status()
        scores = [scores_from_json(d) for d in response.json()["scores"]]
        if len(scores) != len(requests):
            raise RuntimeError(f"the teacher route answered {len(scores)} scores for {len(requests)} requests")
        return scores

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in RETRY_STATUSES


def in_process(teacher: Any, loop: asyncio.AbstractEventLoop | None = None) -> TeacherClient | None:
    """The client for a launcher's teacher argument: None, a ``Teacher`` (wrapped on ``loop``), or already a
    ``TeacherClient`` (passed through)."""
    if teacher is None:
        return None
    if isinstance(teacher, Teacher):
        return InProcessTeacher(teacher, loop)
    return teacher
