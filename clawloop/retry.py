"""Retries with exponential backoff: the one loop behind every transport retry in clawloop.

A caller says what one attempt is, which failures are worth another try, and what to do (log, count) before
each wait; what is not retried, and the last failure when the tries run out, is raised unchanged for the caller
to translate into its own error. An attempt is told its number, so it can treat the last try differently (an
HTTP status that would be retried is an answer to report on the last try).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """``retries`` further tries after the first; the wait before try ``n + 1`` is ``base_s · 2ⁿ``, times a
    uniform factor in [0.5, 1.5) with ``jitter`` (so that many clients failing together do not return together)."""

    retries: int
    base_s: float
    jitter: bool = False

    @property
    def attempts(self) -> int:
        return max(0, self.retries) + 1

    def is_last(self, attempt: int) -> bool:
        return attempt >= self.attempts - 1

    def max_wait_s(self) -> float:
        """The longest all the waits can add up to (for a deadline that must leave room for every retry)."""
        top = 1.5 if self.jitter else 1.0
        return sum(self.base_s * top * 2 ** n for n in range(max(0, self.retries)))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try ``attempt`` (0-based)."""
        delay = self.base_s * 2 ** attempt
        return delay * (0.5 + random.random()) if self.jitter else delay


OnRetry = Callable[[int, BaseException, float], object]
"""Called as (failed attempt, its error, seconds about to be waited) before each wait."""


async def retry_async(attempt_fn: Callable[[int], Awaitable[T]], backoff: Backoff, *,
                      retryable: Callable[[BaseException], bool], on_retry: OnRetry | None = None) -> T:
    """``await attempt_fn(attempt)`` until it returns, a failure is not ``retryable`` or the tries run out."""
    for attempt in range(backoff.attempts):
        try:
            return await attempt_fn(attempt)
        except Exception as exc:  # noqa: BLE001 - the caller's predicate decides; the rest is re-raised
            if backoff.is_last(attempt) or not retryable(exc):
                raise
            delay = backoff.delay(attempt)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
        await asyncio.sleep(delay)
    raise AssertionError("unreachable")


def retry_sync(attempt_fn: Callable[[int], T], backoff: Backoff, *, retryable: Callable[[BaseException], bool],
               on_retry: OnRetry | None = None) -> T:
    """The blocking form of ``retry_async``."""
    for attempt in range(backoff.attempts):
        try:
            return attempt_fn(attempt)
        except Exception as exc:  # noqa: BLE001 - see retry_async
            if backoff.is_last(attempt) or not retryable(exc):
                raise
            delay = backoff.delay(attempt)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
        time.sleep(delay)
    raise AssertionError("unreachable")
