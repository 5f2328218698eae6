"""Sessions over HTTP: ids from header, body, path and conversation prefix; next-state pairing across turns;
ending by header, body, endpoint, idle timeout and eviction; side turns; concurrency; restart."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import openai

from clawloop.store import TurnState

GEN = dict(model="clawloop", max_tokens=4, temperature=1.0)


def user(text):
    return {"role": "user", "content": text}


def answer_of(resp):
    msg = resp.choices[0].message
    return {"role": "assistant", "content": msg.content}


def ext(resp):
    return resp.model_extra["clawloop"]


def converse(client, n_turns, tag, **kwargs):
    """n_turns main turns of one conversation, each request carrying the whole history. Returns
    [(request messages, response)]."""
    history, out = [], []
    for k in range(n_turns):
        history = history + [user(f"{tag} question {k}")]
        resp = client.chat.completions.create(messages=history, **GEN, **kwargs)
        out.append((history, resp))
        history = history + [answer_of(resp)]
    return out


def check_chain(store, turns, session_id):
    """Every stored turn but the last has the next user message as its next state; the last awaits."""
    ids = [ext(resp)["turn_id"] for _, resp in turns]
    records = [store.get_turn(i) for i in ids]
    assert all(r.session_id == session_id for r in records)
    assert [r.turn_index for r in records] == list(range(len(records)))
    for k, r in enumerate(records):
        assert r.messages == turns[k][0]
        if k + 1 < len(records):
            assert r.state == TurnState.JUDGEABLE
            assert r.next_state == [turns[k + 1][0][-1]]
            assert ext(turns[k + 1][1])["paired_turn_id"] == r.id
        else:
            assert r.state == TurnState.AWAITING_NEXT and r.next_state is None
    return records


def test_session_from_header_pairs_next_states_across_four_turns(server, client):
    judgeable = []
    server.on_judgeable = judgeable.append
    turns = converse(client, 4, "hdr", extra_headers={"X-Session-Id": "conv-header"})
    assert all(ext(r)["session_id"] == "conv-header" for _, r in turns)
    records = check_chain(server.store, turns, "conv-header")
    assert judgeable == [r.id for r in records[:-1]]


def test_session_from_body_field(server, client):
    turns = converse(client, 3, "body", extra_body={"session_id": "conv-body"})
    check_chain(server.store, turns, "conv-body")


def test_session_from_path_prefix(server):
    c = openai.OpenAI(base_url=server.base_url + "/sessions/conv-path/v1", api_key="x", max_retries=0)
    turns = converse(c, 3, "path")
    check_chain(server.store, turns, "conv-path")


def test_stock_client_is_matched_by_conversation_prefix(server, client):
    a = converse(client, 3, "alpha")
    b = converse(client, 3, "beta")
    sid_a, sid_b = ext(a[0][1])["session_id"], ext(b[0][1])["session_id"]
    assert sid_a != sid_b and sid_a.startswith("sess_")
    assert all(ext(r)["session_id"] == sid_a for _, r in a)
    check_chain(server.store, a, sid_a)
    check_chain(server.store, b, sid_b)


def test_tool_results_are_part_of_the_next_state(server, client):
    h = {"X-Session-Id": "tools-1"}
    first = client.chat.completions.create(messages=[user("run ls")], extra_headers=h, **GEN)
    # The client's agent acted on the answer; the environment's output follows it.
    history = [user("run ls"), answer_of(first),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "a.txt b.txt"}]
    client.chat.completions.create(messages=history, extra_headers=h, **GEN)
    turn = server.store.get_turn(ext(first)["turn_id"])
    assert turn.next_state == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]},
        {"role": "tool", "content": "a.txt b.txt", "tool_call_id": "call_1"}]


def test_side_turns_are_served_but_not_stored_or_paired(server, client):
    h = {"X-Session-Id": "mixed"}
    first = client.chat.completions.create(messages=[user("q1")], extra_headers=h, **GEN)
    side = client.chat.completions.create(messages=[user("summarise our chat as a title")],
                                          extra_headers={**h, "X-Turn-Type": "side"}, **GEN)
    side_body = client.chat.completions.create(messages=[user("another helper call")], extra_headers=h,
                                               extra_body={"turn_type": "side"}, **GEN)
    for s in (side, side_body):
        assert ext(s)["turn_type"] == "side" and ext(s)["turn_id"] is None and ext(s)["session_id"] == "mixed"
    assert server.store.get_turn(ext(first)["turn_id"]).state == TurnState.AWAITING_NEXT
    assert len(server.store.turns()) == 1
    client.chat.completions.create(messages=[user("q1"), answer_of(first), user("q2")], extra_headers=h, **GEN)
    assert server.store.get_turn(ext(first)["turn_id"]).next_state == [user("q2")]


def test_default_turn_type_side_stores_nothing(make_server):
    srv = make_server(default_turn_type="side")
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    resp = c.chat.completions.create(messages=[user("hi")], **GEN)
    assert ext(resp)["turn_type"] == "side" and srv.store.turns() == []
    main = c.chat.completions.create(messages=[user("hi")], extra_headers={"X-Turn-Type": "main"}, **GEN)
    assert srv.store.get_turn(ext(main)["turn_id"]).state == TurnState.AWAITING_NEXT


def test_session_end_by_header_body_and_endpoint_drops_the_last_turn(server, client, http):
    # Header on the last request: it is served and stored, then closed for lack of a next state.
    t1 = client.chat.completions.create(messages=[user("a")], extra_headers={"X-Session-Id": "e1"}, **GEN)
    t2 = client.chat.completions.create(messages=[user("a"), answer_of(t1), user("b")],
                                        extra_headers={"X-Session-Id": "e1", "X-Session-Done": "true"}, **GEN)
    r1, r2 = server.store.get_turn(ext(t1)["turn_id"]), server.store.get_turn(ext(t2)["turn_id"])
    assert r1.state == TurnState.JUDGEABLE and r1.next_state == [user("b")]
    assert (r2.state, r2.reason) == (TurnState.DROPPED, "no_next_state")
    assert server.sessions.get("e1") is None

    t3 = client.chat.completions.create(messages=[user("c")], extra_body={"session_id": "e2", "session_done": 1},
                                        **GEN)
    assert server.store.get_turn(ext(t3)["turn_id"]).reason == "no_next_state"

    t4 = client.chat.completions.create(messages=[user("d")], extra_headers={"X-Session-Id": "e3"}, **GEN)
    r = http.post("/v1/sessions/e3/end")
    assert r.status_code == 200 and r.json() == {"id": "e3", "object": "session", "ended": True,
                                                 "dropped_turn_id": ext(t4)["turn_id"]}
    assert server.store.get_turn(ext(t4)["turn_id"]).reason == "no_next_state"
    missing = http.post("/v1/sessions/e3/end")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    # A new request with the ended id starts afresh: nothing to pair.
    t5 = client.chat.completions.create(messages=[user("d"), answer_of(t4), user("e")],
                                        extra_headers={"X-Session-Id": "e3"}, **GEN)
    assert ext(t5)["paired_turn_id"] is None
    assert server.store.drop_reasons() == {"no_next_state": 3}


def test_idle_timeout_closes_the_pending_turn(make_server, wait_for):
    srv = make_server(session_idle_timeout_s=0.3)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    resp = c.chat.completions.create(messages=[user("anyone there?")], **GEN)
    tid = ext(resp)["turn_id"]
    wait_for(lambda: srv.store.get_turn(tid).state == TurnState.DROPPED)
    assert srv.store.get_turn(tid).reason == "no_next_state"
    # The sweeper writes the store first and forgets the session right after, on the server's event loop.
    wait_for(lambda: srv.sessions.get(ext(resp)["session_id"]) is None)
    assert 'clawloop_sessions_ended_total{cause="idle"} 1' in httpx.get(srv.base_url + "/metrics").text


def test_eviction_beyond_max_sessions_ends_the_oldest(make_server):
    srv = make_server(max_sessions=2)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    ids = [ext(c.chat.completions.create(messages=[user(f"s{i}")], extra_headers={"X-Session-Id": f"s{i}"},
                                         **GEN))["turn_id"] for i in range(3)]
    assert [srv.store.get_turn(i).state for i in ids] == [TurnState.DROPPED, TurnState.AWAITING_NEXT,
                                                          TurnState.AWAITING_NEXT]
    assert len(srv.sessions) == 2


def test_eight_concurrent_sessions_lose_and_mix_up_nothing(server):
    """Eight conversations of three turns at once: four name their session, four rely on prefix matching."""
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)

    async def conversation(i):
        kwargs = {"extra_headers": {"X-Session-Id": f"conc-{i}"}} if i % 2 == 0 else {}
        history, turns = [], []
        for k in range(3):
            history = history + [user(f"conversation {i} message {k}")]
            resp = await client.chat.completions.create(messages=history, **GEN, **kwargs)
            turns.append((history, resp))
            history = history + [answer_of(resp)]
        return turns

    async def main():
        try:
            return await asyncio.gather(*(conversation(i) for i in range(8)))
        finally:
            await client.close()

    results = asyncio.run(main())
    sids = set()
    for i, turns in enumerate(results):
        sid = ext(turns[0][1])["session_id"]
        assert all(ext(r)["session_id"] == sid for _, r in turns)
        if i % 2 == 0:
            assert sid == f"conc-{i}"
        check_chain(server.store, turns, sid)
        sids.add(sid)
    assert len(sids) == 8
    assert len(server.store.turns()) == 24
    assert server.store.count_turns() == {"judgeable": 16, "awaiting_next": 8}


def test_concurrent_requests_in_one_session_are_serialised(server):
    """Two identical requests at once in one session: the second sees the first's stored turn and (being a
    regeneration of the same context) closes it with a reason, so no turn is left half-paired."""
    url = server.base_url + "/v1/chat/completions"
    body = {"messages": [user("same")], "max_tokens": 4, "session_id": "dup"}
    results = []

    def post():
        results.append(httpx.post(url, json=body, timeout=120).json())

    threads = [threading.Thread(target=post) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = sorted(r["clawloop"]["turn_id"] for r in results)
    first, second = server.store.get_turn(ids[0]), server.store.get_turn(ids[1])
    assert (first.turn_index, second.turn_index) == (0, 1)
    assert (first.state, first.reason) == (TurnState.DROPPED, "regenerated")
    assert second.state == TurnState.AWAITING_NEXT


def test_restart_rebuilds_sessions_so_pairing_survives(make_server, tmp_path):
    run_dir = tmp_path / "persistent"
    srv = make_server(run_dir=run_dir)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    named = c.chat.completions.create(messages=[user("n1")], extra_headers={"X-Session-Id": "keep"}, **GEN)
    stock = c.chat.completions.create(messages=[user("s1")], **GEN)
    srv.stop()

    srv2 = make_server(run_dir=run_dir)
    c2 = openai.OpenAI(base_url=srv2.base_url + "/v1", api_key="x", max_retries=0)
    n2 = c2.chat.completions.create(messages=[user("n1"), answer_of(named), user("n2")],
                                    extra_headers={"X-Session-Id": "keep"}, **GEN)
    s2 = c2.chat.completions.create(messages=[user("s1"), answer_of(stock), user("s2")], **GEN)
    assert ext(n2)["paired_turn_id"] == ext(named)["turn_id"]
    assert ext(s2)["session_id"] == ext(stock)["session_id"] and ext(s2)["paired_turn_id"] == ext(stock)["turn_id"]
    assert srv2.store.get_turn(ext(named)["turn_id"]).next_state == [user("n2")]
    assert srv2.store.get_turn(ext(n2)["turn_id"]).turn_index == 1


def test_async_judgeable_hook_runs_off_the_request_path(make_server, wait_for):
    seen = []

    async def hook(turn_id):
        await asyncio.sleep(0)
        seen.append(turn_id)

    srv = make_server(on_judgeable=hook)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    turns = converse(c, 3, "hook", extra_headers={"X-Session-Id": "h"})
    wait_for(lambda: len(seen) == 2)
    assert seen == [ext(r)["turn_id"] for _, r in turns[:2]]


def _stream_nobody_reads(port: int, session_id: str) -> socket.socket:
    """A streamed request whose client reads nothing: a small receive window, so the server's buffers fill."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
                       "max_tokens": 1900, "logprobs": True, "top_logprobs": 20}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"X-Session-Id: {session_id}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_stream_nobody_reads_does_not_hold_its_session_for_ever(make_server, wait_for):
    """The request holds its session until its stream ends, and ending the session (or a forget, or the idle
    sweep) waits for it: a client that stops reading is cut off after stream_send_timeout_s."""
    srv = make_server(stream_send_timeout_s=2.0)
    sock = _stream_nobody_reads(srv.port, "held")
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            wait_for(lambda: http.get("/v1/status").json()["live_sessions"] == 1)
            ended = http.post("/v1/sessions/held/end")  # waits for the stream, which is cut off
            assert ended.status_code == 200
            assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2}).status_code == 200
    finally:
        sock.close()
