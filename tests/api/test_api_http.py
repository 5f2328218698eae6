"""The OpenAI-compatible API over real HTTP with the official ``openai`` client: plain and streamed chat,
log-probs, sampling settings, the stored turn matching the answer exactly, and the side routes."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from clawloop.config import Config
from clawloop.engines.base import SamplingParams
from clawloop.serve import Server

USER = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


def decode(server, ids):
    return server.service.tokenizer.decode(ids, skip_special_tokens=False)


def visible_ids(server, turn):
    """Generated ids minus a final EOS (the client never sees it)."""
    ids = turn.response_ids
    if turn.finish_reason in ("stop", "tool_calls") and ids and ids[-1] in server.engine.eos_token_ids:
        return ids[:-1]
    return ids


def test_plain_chat_is_stored_exactly_as_sampled(server, client):
    raw = client.chat.completions.with_raw_response.create(model="clawloop", messages=USER, max_tokens=6,
                                                           temperature=0.7, top_p=0.9)
    resp = raw.parse()
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == "clawloop"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    ext = resp.model_extra["clawloop"]
    assert ext["turn_type"] == "main" and ext["policy_version"] == 0 and ext["session_id"].startswith("sess_")
    assert raw.headers["x-policy-version"] == "0" and raw.headers["x-session-id"] == ext["session_id"]

    turn = server.store.get_turn(ext["turn_id"])  # committed before the answer came back
    assert turn.session_id == ext["session_id"] and turn.state == "awaiting_next"
    assert turn.messages == USER and turn.tools is None
    assert turn.prompt_ids == server.service.renderer.render(USER).ids
    assert decode(server, visible_ids(server, turn)) == choice.message.content == turn.response_text
    assert len(turn.logprobs) == len(turn.response_ids) == resp.usage.completion_tokens <= 6
    assert all(lp <= 0 and math.isfinite(lp) for lp in turn.logprobs)
    assert resp.usage.prompt_tokens == len(turn.prompt_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert (turn.temperature, turn.policy_version) == (pytest.approx(0.7), 0)
    assert turn.top_p == pytest.approx(0.9)
    assert turn.assistant_message == {"role": "assistant", "content": choice.message.content}


def test_streaming_sends_openai_chunks_and_stores_before_done(server, http):
    body = {"model": "clawloop", "messages": USER, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    stored_when_finish_arrived = None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-policy-version"] == "0"
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: "):]
            events.append(payload)
            if payload != "[DONE]":
                chunk = json.loads(payload)
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    # The turn must already be durable when the finish chunk is sent.
                    stored_when_finish_arrived = server.store.get_turn(chunk["clawloop"]["turn_id"])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content_chunks = [c for c in chunks[1:] if c["choices"] and "content" in c["choices"][0]["delta"]]
    assert len(content_chunks) >= 2  # token by token, not one blob
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(
        stored_when_finish_arrived.response_ids)
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    turn = stored_when_finish_arrived
    assert decode(server, visible_ids(server, turn)) == text == turn.response_text
    assert finish[0]["clawloop"]["session_id"] == turn.session_id == r.headers["x-session-id"]


def test_streaming_with_the_openai_client_matches_greedy_non_streaming(client):
    kwargs = dict(model="clawloop", messages=USER, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    pieces, reasons = [], []
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == plain
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])


def test_logprobs_and_top_logprobs_have_openai_shape(server, client):
    resp = client.chat.completions.create(model="clawloop", messages=USER, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    entries = resp.choices[0].logprobs.content
    turn = server.store.get_turn(resp.model_extra["clawloop"]["turn_id"])
    assert len(entries) == len(visible_ids(server, turn)) == 5
    for entry, lp in zip(entries, turn.logprobs):
        assert entry.logprob == pytest.approx(lp, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert bytes(entry.bytes).decode("utf-8", errors="backslashreplace") == entry.token
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == \
        resp.choices[0].message.content

    stream = client.chat.completions.create(model="clawloop", messages=USER, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_stop_strings_cut_the_text_and_the_ids_keep_what_was_sampled(server, client):
    base = dict(model="clawloop", messages=USER, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**base).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"greedy text too short to pick a stop string: {full!r}"
    resp = client.chat.completions.create(stop=[stop], **base)
    content = resp.choices[0].message.content
    assert content == full[: full.find(stop)] and resp.choices[0].finish_reason == "stop"
    turn = server.store.get_turn(resp.model_extra["clawloop"]["turn_id"])
    decoded = decode(server, turn.response_ids)
    assert decoded.startswith(content) and stop in decoded[len(content) - 1:]


def test_seed_makes_sampling_repeatable_and_max_tokens_is_honoured(client):
    kwargs = dict(model="clawloop", messages=USER, temperature=1.0, seed=1234)
    a = client.chat.completions.create(max_tokens=7, **kwargs)
    b = client.chat.completions.create(max_tokens=7, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    c = client.chat.completions.create(max_completion_tokens=3, **kwargs)
    assert c.usage.completion_tokens <= 3
    d = client.chat.completions.create(**{**kwargs, "seed": 99}, max_tokens=7)
    assert d.usage.completion_tokens <= 7


def test_default_max_tokens_comes_from_the_config(make_server):
    srv = make_server(default_max_tokens=3)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    resp = c.chat.completions.create(model="clawloop", messages=USER, temperature=1.0)
    assert resp.usage.completion_tokens <= 3


def test_models_health_status_and_metrics(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["clawloop"]
    assert client.models.retrieve("clawloop").id == "clawloop"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert http.get("/sessions/abc/v1/models").json()["data"][0]["id"] == "clawloop"
    assert http.get("/healthz").json()["status"] == "ok"

    client.chat.completions.create(model="clawloop", messages=USER, max_tokens=2)
    client.chat.completions.create(model="clawloop", messages=USER, max_tokens=2,
                                   extra_headers={"X-Turn-Type": "side"})
    status = http.get("/v1/status").json()
    assert status["policy_version"] == 0 and status["samples_waiting"] == 0
    assert status["turns_by_state"] == {"awaiting_next": 1} and status["last_step"] is None
    assert status["live_sessions"] == 1

    http.get("/nowhere")
    text = http.get("/metrics").text
    lines = set(text.splitlines())
    assert 'clawloop_http_requests_total{method="POST",route="/v1/chat/completions",status="200"} 2' in lines
    assert 'clawloop_http_requests_total{method="GET",route="unmatched",status="404"} 1' in lines
    assert 'clawloop_served_turns_total{stored="true",turn_type="main"} 1' in lines
    assert 'clawloop_served_turns_total{stored="false",turn_type="side"} 1' in lines
    assert 'clawloop_turns{state="awaiting_next"} 1' in lines
    assert "clawloop_live_sessions 1" in lines and "clawloop_policy_version 0" in lines
    assert 'clawloop_completion_tokens_total{turn_type="main"} 2' in lines
    assert 'clawloop_request_latency_seconds_bucket{route="/v1/chat/completions",le="+Inf"} 2' in lines
    assert 'clawloop_request_latency_seconds_count{route="/v1/chat/completions"} 2' in lines
    assert "# TYPE clawloop_request_latency_seconds histogram" in lines


def test_binds_loopback_by_default(server):
    assert server.config.host == "127.0.0.1"
    assert httpx.get(f"http://127.0.0.1:{server.port}/healthz").status_code == 200


@pytest.mark.real_model
def test_real_smollm2_stops_at_eos_and_ids_minus_eos_decode_to_the_text(make_server):
    from clawloop.engines.hf import HFEngine

    engine = HFEngine("default", device="cpu", num_threads=2, max_batch_size=2)
    try:
        srv = make_server(engine=engine, model="default")
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        resp = c.chat.completions.create(model="clawloop", messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=64, temperature=0)
        assert resp.choices[0].finish_reason == "stop"
        turn = srv.store.get_turn(resp.model_extra["clawloop"]["turn_id"])
        assert turn.response_ids[-1] == 2  # <|im_end|>
        assert decode(srv, turn.response_ids[:-1]) == resp.choices[0].message.content
        assert resp.choices[0].message.content.strip()
    finally:
        srv.stop()
        engine.close_sync()


def test_an_abandoned_stream_is_not_stored_and_frees_its_session(server, wait_for):
    body = {"messages": USER, "max_tokens": 400, "temperature": 1.0, "stream": True, "session_id": "gone"}
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the role chunk; then hang up mid-answer
    assert wait_for(lambda: server.service.extra_stats["streams_abandoned"] == 1)
    assert server.store.turns() == []  # the client never saw the whole answer: nothing to train on
    # The session is free again: the next request in it is served (not blocked by a leftover lock).
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["clawloop"]["session_id"] == "gone"
    assert 'clawloop_streams_abandoned_total 1' in httpx.get(server.base_url + "/metrics").text


def test_background_components_start_with_the_server_and_stop_before_it(tmp_path, tiny_engine):
    events = []

    class Component:
        async def start(self):
            events.append("start")

        async def stop(self):
            events.append("stop")

    srv = Server(Config.load(env={}, model="tiny", port=0, run_dir=str(tmp_path / "run")),
                 engine=tiny_engine, components=[Component()]).start()
    assert events == ["start"]
    assert httpx.get(srv.base_url + "/healthz").status_code == 200
    srv.stop()
    assert events == ["start", "stop"]
    # An engine the server was given is not closed by it.
    assert len(asyncio.run(tiny_engine.generate([1, 9, 2], SamplingParams(max_tokens=1))).token_ids) == 1
