"""What one user key can learn about, or do to, another key's conversations: session limits and eviction,
requests whose client left, the status route and the turn ids a user is given. Against live servers of the tiny
model, through HTTP."""

from __future__ import annotations

import re
import time

import httpx

from clawloop.api.auth import owner_of
from clawloop.store import TurnState
from tests.security.conftest import RawConnection

ALICE, BOB = "alice-key-5d1a", "bob-key-77c2"
ADMIN_KEY = "admin-key-93be"
GEN = {"model": "clawloop", "max_tokens": 3, "temperature": 0.0}
URL = "/v1/chat/completions"


def _chat(c: httpx.Client, key: str | None, messages: list[dict], **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = c.post(URL, json={**GEN, "messages": messages, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    return r


def _continued(messages: list[dict], response: httpx.Response, text: str) -> list[dict]:
    answer = response.json()["choices"][0]["message"]
    return messages + [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": text}]


def _turns_of(srv, key: str) -> list:
    return [t for t in srv.store.turns() if t.owner == owner_of(key)]


def _status(c: httpx.Client, key: str | None) -> dict:
    r = c.get("/v1/status", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------------- limits and eviction


def test_a_key_at_its_session_limit_ends_its_own_sessions_never_another_keys(make_server):
    srv = make_server(api_keys=[ALICE, BOB], max_sessions=4)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        alice_first = [{"role": "user", "content": "Alice asks about tides"}]
        r = _chat(c, ALICE, alice_first)
        alice_turn_id = r.json()["clawloop"]["turn_id"]
        for i in range(8):  # eight ordinary requests, each a new conversation of Bob's
            _chat(c, BOB, [{"role": "user", "content": f"Bob's question number {i}"}])
        # Alice's pending turn survived: her next message still pairs it.
        r = _chat(c, ALICE, _continued(alice_first, r, "Thanks, and at night?"))
        assert r.json()["clawloop"]["paired_turn_id"] == alice_turn_id
    [alice_paired, _] = _turns_of(srv, ALICE)
    assert alice_paired.state == TurnState.JUDGEABLE
    bob = _turns_of(srv, BOB)
    # Bob lost his own oldest sessions, in order; his newest ones are live.
    assert [t.state for t in bob] == [TurnState.DROPPED] * 5 + [TurnState.AWAITING_NEXT] * 3
    assert all(t.reason == "no_next_state" for t in bob[:5])
    assert len(srv.sessions) <= 4


def test_a_restart_over_the_limit_drops_from_the_key_holding_the_most(make_server, tmp_path):
    run_dir = tmp_path / "restart"
    srv = make_server(api_keys=[ALICE, BOB], run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        _chat(c, ALICE, [{"role": "user", "content": "Alice's oldest conversation"}])
        for i in range(3):
            _chat(c, BOB, [{"role": "user", "content": f"Bob's conversation {i}"}])
    srv.stop()
    srv = make_server(api_keys=[ALICE, BOB], run_dir=run_dir, max_sessions=2)
    assert [t.state for t in _turns_of(srv, ALICE)] == [TurnState.AWAITING_NEXT]
    assert [t.state for t in _turns_of(srv, BOB)] == [TurnState.DROPPED] * 2 + [TurnState.AWAITING_NEXT]
    assert len(srv.sessions) == 2


# -------------------------------------------------------------------------------- clients that leave


def _hang_up_non_streamed(srv, wait_for, content: str) -> None:
    abandoned = srv.service.extra_stats["requests_abandoned"]
    body = {"model": "clawloop", "max_tokens": 2000, "temperature": 1.0, "seed": 7,
            "messages": [{"role": "user", "content": content}]}
    conn = RawConnection(srv.port)
    conn.send("POST", URL, body)
    time.sleep(0.3)
    conn.close()
    wait_for(lambda: srv.service.extra_stats["requests_abandoned"] == abandoned + 1, timeout_s=60)


def _hang_up_streamed(srv, wait_for, content: str) -> None:
    abandoned = srv.service.extra_stats["streams_abandoned"]
    body = {"model": "clawloop", "max_tokens": 400, "temperature": 1.0, "stream": True,
            "messages": [{"role": "user", "content": content}]}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", URL, json=body) as r:
            assert next(r.iter_lines()).startswith("data: ")  # the role chunk; then hang up mid-answer
    wait_for(lambda: srv.service.extra_stats["streams_abandoned"] == abandoned + 1, timeout_s=60)


def test_a_request_whose_client_left_leaves_no_session_and_ends_none(make_server, wait_for):
    srv = make_server(max_sessions=2)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        kept = [_chat(c, None, [{"role": "user", "content": f"conversation {i}"}]).json()["clawloop"]
                for i in range(2)]
        _hang_up_non_streamed(srv, wait_for, "a question nobody waits for")
        _hang_up_streamed(srv, wait_for, "a stream nobody reads")
        # Nothing was stored for the two requests, so no session of theirs stays open...
        wait_for(lambda: _status(c, None)["live_sessions"] == 2)
        assert all(srv.sessions.get(k["session_id"]) is not None for k in kept) and len(srv.sessions) == 2
        # ...and the conversations that were there keep their pending turns.
        assert [srv.store.get_turn(k["turn_id"]).state for k in kept] == [TurnState.AWAITING_NEXT] * 2
        assert len(srv.store.turns()) == 2


# ------------------------------------------------------------------------------------- what a key sees


def test_status_shows_a_user_their_own_activity_and_the_admin_everything(make_server):
    srv = make_server(api_keys=[ALICE, BOB], admin_key=ADMIN_KEY)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        _chat(c, ALICE, [{"role": "user", "content": "Alice's only question"}])
        bob = [{"role": "user", "content": "Bob's first question"}]
        r = _chat(c, BOB, bob, session_id="bob-chat")
        r = _chat(c, BOB, _continued(bob, r, "Bob's second question"), session_id="bob-chat")
        _chat(c, BOB, [{"role": "user", "content": "Bob's side chat"}], session_id="bob-other")
        assert c.post("/v1/sessions/bob-other/end", headers={"Authorization": f"Bearer {BOB}"}).status_code == 200

        alice = _status(c, ALICE)
        assert alice["turns_by_state"] == {"awaiting_next": 1}
        assert alice["drop_reasons"] == {} and alice["live_sessions"] == 1
        # Run-wide figures are not a user's to see.
        for run_wide in ("last_step", "samples_waiting", "samples_by_state"):
            assert run_wide not in alice
        assert "votes" not in alice["judge"] and "top_errors" not in alice["judge"]
        assert alice["policy_version"] == 0 and alice["model"] == "clawloop"

        bob_status = _status(c, BOB)
        assert bob_status["turns_by_state"] == {"judgeable": 1, "awaiting_next": 1, "dropped": 1}
        assert bob_status["drop_reasons"] == {"no_next_state": 1} and bob_status["live_sessions"] == 1

        admin = _status(c, ADMIN_KEY)
        assert admin["turns_by_state"] == {"judgeable": 1, "awaiting_next": 2, "dropped": 1}
        assert admin["live_sessions"] == 2 and admin["last_step"] is None and admin["samples_waiting"] == 0
        assert c.get("/v1/status", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_turn_ids_given_to_a_user_do_not_count_other_users_turns(make_server, tmp_path):
    run_dir = tmp_path / "ids"
    srv = make_server(api_keys=[ALICE, BOB], admin_key=ADMIN_KEY, run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        alice = [{"role": "user", "content": "Alice starts"}]
        first = _chat(c, ALICE, alice, session_id="alice")
        for i in range(5):
            _chat(c, BOB, [{"role": "user", "content": f"Bob is busy {i}"}])
        alice = _continued(alice, first, "Alice goes on")
        second = _chat(c, ALICE, alice, session_id="alice")
    real = [t.id for t in _turns_of(srv, ALICE)]
    assert real == [1, 7]  # the store's sequence counts Bob's five turns in between
    given = [first.json()["clawloop"]["turn_id"], second.json()["clawloop"]["turn_id"]]
    # Opaque: no number to read a count from, and none the store's sequence could be recovered from.
    assert all(isinstance(public, str) and re.fullmatch(r"turn_[0-9a-f]{24}", public) for public in given)
    assert len(set(given)) == 2
    # The ids stay the user's handle on a turn: the pairing names it, and so do a restart and ending the session.
    assert second.json()["clawloop"]["paired_turn_id"] == given[0]
    srv.stop()
    srv = make_server(api_keys=[ALICE, BOB], admin_key=ADMIN_KEY, run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        third = _chat(c, ALICE, _continued(alice, second, "and finally"), session_id="alice")
        assert third.json()["clawloop"]["paired_turn_id"] == given[1]
        ended = c.post("/v1/sessions/alice/end", headers={"Authorization": f"Bearer {ALICE}"}).json()
        assert ended["dropped_turn_id"] == third.json()["clawloop"]["turn_id"]
        # The admin's views keep the store's own ids.
        turns = c.get("/dashboard/api/sessions/alice", params={"owner": owner_of(ALICE)},
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        assert [t["turn_id"] for t in turns["turns"]] == [1, 7, 8]
