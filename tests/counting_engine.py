"""``CountingEngine``: a real engine wrapped to record every ``score`` call, for tests of how often and with what the
teacher is asked."""

from __future__ import annotations


class CountingEngine:
    """The real engine, recording every ``score`` call and its requests."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def score(self, requests):
        self.calls.append(list(requests))
        return await self.engine.score(requests)
