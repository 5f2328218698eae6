"""The HTTP judge client against a real local server that misbehaves on purpose."""

import asyncio
import threading

import pytest

from clawloop.judge.client import HTTPJudgeClient
from clawloop.judge.scripted import Hang, Raw, ScriptedJudgeServer, Status, last_user_text

MESSAGES = [{"role": "system", "content": "judge"}, {"role": "user", "content": "MODE=ok"}]


def _messages(mode: str) -> list[dict]:
    return [{"role": "system", "content": "judge"}, {"role": "user", "content": f"MODE={mode}"}]


def run(coro):
    return asyncio.run(coro)


class FlakyResponder:
    """Fails the first ``failures`` calls of each mode, then answers."""

    def __init__(self, failures: int = 1):
        self.failures = failures
        self.seen: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, body):
        mode = last_user_text(body).split("=", 1)[1]
        with self.lock:
            n = self.seen[mode] = self.seen.get(mode, 0) + 1
        if mode == "ok":
            return "fine \\boxed{1}"
        if mode == "hang":
            return Hang(30)
        if mode == "e500":
            return Status(500) if n <= self.failures else "recovered \\boxed{-1}"
        if mode == "e400":
            return Status(400, "bad request")
        if mode == "garbage":
            return Raw(b"{not json")
        if mode == "nochoices":
            return Raw(b'{"choices": []}')
        raise AssertionError(mode)


@pytest.fixture
def server():
    with ScriptedJudgeServer(FlakyResponder(), api_key="sekret") as s:
        yield s


def client_for(server, **kw):
    kw.setdefault("timeout_s", 1.0)
    kw.setdefault("retries", 1)
    kw.setdefault("backoff_s", 0.01)
    return HTTPJudgeClient(server.url, kw.pop("model", ""), kw.pop("api_key", "sekret"), **kw)


def test_success_discovers_model_and_sends_key(server):
    async def go():
        client = client_for(server)
        out = await client.complete(_messages("ok"), temperature=0.6, max_tokens=32)
        await client.close()
        return out, client.model

    out, model = run(go())
    assert out.error == "" and out.text == "fine \\boxed{1}" and out.attempts == 1
    assert model == "scripted-judge"
    body = server.requests[-1]
    assert body["model"] == "scripted-judge" and body["max_tokens"] == 32 and body["temperature"] == 0.6


def test_extra_body_fields_reach_the_endpoint_without_overriding_the_vote_settings(server):
    regex = "[\\s\\S]*\\\\boxed\\{(1|-1|0)\\}"
    extra = {"structured_outputs": {"regex": regex}, "max_tokens": 1}

    async def go():
        client = client_for(server, extra_body=extra)
        out = await client.complete(_messages("ok"), temperature=0.6, max_tokens=32)
        await client.close()
        return out

    assert run(go()).error == ""
    body = server.requests[-1]
    assert body["structured_outputs"] == {"regex": regex}
    assert body["max_tokens"] == 32  # the judge's own settings win over extra fields


def test_wrong_key_is_an_error_not_an_exception(server):
    async def go():
        client = client_for(server, api_key="wrong", model="m")
        out = await client.complete(_messages("ok"), temperature=0.6, max_tokens=8)
        await client.close()
        return out

    out = run(go())
    assert out.text.startswith('{"error"') and "HTTP 401" in out.error and out.attempts == 1


def test_hang_times_out_after_retries(server):
    async def go():
        client = client_for(server, model="m", timeout_s=0.3, retries=2)
        out = await client.complete(_messages("hang"), temperature=0.6, max_tokens=8)
        await client.close()
        return out

    out = run(go())
    assert "timed out" in out.error and "after 3 attempts" in out.error
    assert out.attempts == 3 and out.text == ""
    assert len(server.requests) == 3


def test_server_error_is_retried(server):
    async def go():
        client = client_for(server, model="m", retries=2)
        return await client.complete(_messages("e500"), temperature=0.6, max_tokens=8)

    out = run(go())
    assert out.error == "" and out.text == "recovered \\boxed{-1}" and out.attempts == 2


def test_client_error_is_not_retried(server):
    async def go():
        client = client_for(server, model="m", retries=3)
        return await client.complete(_messages("e400"), temperature=0.6, max_tokens=8)

    out = run(go())
    assert out.error == "HTTP 400" and out.attempts == 1 and "bad request" in out.text
    assert len(server.requests) == 1


@pytest.mark.parametrize("mode", ["garbage", "nochoices"])
def test_unreadable_body_is_recorded(server, mode):
    async def go():
        client = client_for(server, model="m", retries=1)
        return await client.complete(_messages(mode), temperature=0.6, max_tokens=8)

    out = run(go())
    assert "unreadable response body" in out.error
    assert out.text  # the raw body is kept for the record
    assert out.attempts == 2


def test_nothing_listening_is_an_error():
    async def go():
        client = HTTPJudgeClient("http://127.0.0.1:9/v1", "m", timeout_s=0.5, retries=1, backoff_s=0.01)
        return await client.complete(MESSAGES, temperature=0.6, max_tokens=8)

    out = run(go())
    assert out.error and out.text == ""


def test_concurrency_limit_is_respected():
    release = threading.Event()

    def slow(body):
        release.wait(5)
        return "\\boxed{1}"

    with ScriptedJudgeServer(slow) as server:
        async def go():
            client = HTTPJudgeClient(server.url, "m", timeout_s=10, retries=0, concurrency=2)
            tasks = [asyncio.create_task(client.complete(MESSAGES, temperature=0.6, max_tokens=8))
                     for _ in range(6)]
            while len(server.requests) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # give a third request the chance to (wrongly) get through
            started_while_blocked = len(server.requests)
            release.set()
            outs = await asyncio.gather(*tasks)
            await client.close()
            return started_while_blocked, outs

        started, outs = run(go())
    assert started == 2
    assert server.in_flight_max <= 2
    assert all(o.error == "" for o in outs) and len(server.requests) == 6
