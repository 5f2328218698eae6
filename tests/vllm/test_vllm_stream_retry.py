"""Streaming requests to vLLM retry like plain ones before the first event: refused connections and 5xx answers,
with backoff, each retry counted; the last answer is reported as it is. No vLLM needed (a small local server)."""

from __future__ import annotations

import asyncio
import json

import pytest

from clawloop.engines.base import EngineError, Generation, SamplingParams, TokenEvent
from clawloop.engines.vllm_server import free_port
from tests.vllm.test_vllm_errors import FakeServer, engine_for

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


def sse(*events) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def chunk(text, token_id, logprob, finish=None):
    return {"choices": [{"text": text, "token_ids": [token_id], "finish_reason": finish,
                         "logprobs": {"token_logprobs": [logprob], "tokens": [f"token_id:{token_id}"],
                                      "top_logprobs": None}}]}


async def collect(engine):
    return [event async for event in engine.generate_stream([1, 2, 3], PARAMS)]


def test_a_stream_is_retried_after_5xx_then_delivered():
    def flaky(hit):
        if hit <= 2:
            return 503, {"error": {"message": "warming up"}}, 0.0
        return 200, sse(chunk("h", 5, -0.5), chunk("i", 2, -0.1, finish="stop")), 0.0

    with FakeServer(flaky) as server:
        engine = engine_for(server.url)
        events = asyncio.run(collect(engine))
        assert server.hits == 3
    assert engine.stats["retries"] == 2
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    final = events[-1]
    assert [t.token_id for t in tokens] == [5, 2] and isinstance(final, Generation)
    assert (final.token_ids, final.logprobs, final.text, final.finish_reason) == ([5, 2], [-0.5, -0.1], "hi", "stop")


def test_a_stream_that_keeps_failing_reports_the_last_answer():
    with FakeServer(lambda hit: (500, {"error": {"message": "EngineCore encountered an issue"}}, 0.0)) as server:
        engine = engine_for(server.url)
        with pytest.raises(EngineError, match="answered 500: EngineCore encountered an issue"):
            asyncio.run(collect(engine))
        assert server.hits == 3  # the first try and two retries
    assert engine.stats["retries"] == 2


def test_a_4xx_stream_answer_is_not_retried():
    with FakeServer(lambda hit: (404, {"error": {"message": "The model `base` does not exist."}}, 0.0)) as server:
        engine = engine_for(server.url)
        with pytest.raises(EngineError, match="not found"):
            asyncio.run(collect(engine))
        assert server.hits == 1
    assert engine.stats["retries"] == 0


def test_a_stream_to_a_missing_server_fails_naming_the_url_after_the_retries():
    url = f"http://127.0.0.1:{free_port()}"
    engine = engine_for(url)
    with pytest.raises(EngineError, match="stream failed: ConnectError") as info:
        asyncio.run(collect(engine))
    assert url in str(info.value)
    assert engine.stats["retries"] == 2
