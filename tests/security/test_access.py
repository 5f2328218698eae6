"""Access control against live servers: the admin rule, browser-borne requests (cross-site, DNS rebinding) and
sessions that belong to the key that opened them."""

from __future__ import annotations

import httpx
import pytest

from clawloop.api.auth import owner_of
from clawloop.store import TurnState
from tests.security.conftest import RawConnection, assert_openai_error, ready_sample

USER_KEY = "user-key-1f0c"
ADMIN_KEY = "admin-key-93be"
ALICE, BOB = "alice-key-5d1a", "bob-key-77c2"
GEN = {"model": "clawloop", "max_tokens": 3, "temperature": 0.0}
ADMIN_CALLS = [
    ("POST", "/v1/trainer/lease", {"n": 3, "lease_s": 86400}),
    ("POST", "/v1/trainer/drop", {"turn_id": 1, "reason": "mine"}),
    ("POST", "/v1/trainer/weights", {"path": "/", "version": 10**19}),
    ("GET", "/v1/trainer/state", None),
]


def _call(c: httpx.Client, method: str, path: str, body, headers=None) -> httpx.Response:
    return c.request(method, path, json=body, headers=headers or {})


# ------------------------------------------------------------------------------------------ admin routes


def test_user_key_without_admin_key_closes_the_admin_routes(make_server):
    """A user key and no admin key: no caller (no key, the user key, a wrong key) reaches an admin route."""
    srv = make_server(api_key=USER_KEY)
    victims = [ready_sample(srv.store, i) for i in range(3)]
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for headers in ({}, {"Authorization": f"Bearer {USER_KEY}"}, {"Authorization": "Bearer nope"}):
            for method, path, body in ADMIN_CALLS:
                r = _call(c, method, path, body, headers)
                assert r.status_code == 403, (path, headers, r.text)
                assert_openai_error(r.status_code, r.content, "admin_key_required")
        # Chat still works with the user key.
        ok = c.post("/v1/chat/completions", json={**GEN, "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {USER_KEY}"})
        assert ok.status_code == 200
    assert srv.store.count_samples() == {"ready": 3}  # nothing leased, nothing dropped
    assert all(srv.store.get_turn(t).state == TurnState.READY for t in victims)
    assert srv.engine.policy_version == 0


def test_admin_routes_open_to_the_user_key_only_when_configured(make_server):
    srv = make_server(api_key=USER_KEY, admin_uses_api_key=True)
    ready_sample(srv.store, 0)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert c.get("/v1/trainer/state").status_code == 401
        r = c.get("/v1/trainer/state", headers={"Authorization": f"Bearer {USER_KEY}"})
        assert r.status_code == 200 and r.json()["waiting"] == 1


def test_admin_key_is_the_only_way_in_when_set(make_server):
    srv = make_server(api_key=USER_KEY, admin_key=ADMIN_KEY)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for headers in ({}, {"Authorization": f"Bearer {USER_KEY}"}):
            assert c.get("/v1/trainer/state", headers=headers).status_code == 401
        assert c.get("/v1/trainer/state", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200


def test_without_any_key_admin_routes_need_loopback_and_same_origin(shared_server):
    srv = shared_server
    with RawConnection(srv.port) as conn:
        status, _, body = conn.request("GET", "/v1/trainer/state", headers={"Content-Type": None})
        assert status == 200, body
        # A page on another loopback port is a foreign origin to an admin route.
        status, _, body = conn.request("GET", "/v1/trainer/state",
                                       headers={"Origin": "http://localhost:8080", "Content-Type": None})
        assert_openai_error(status, body, "cross_origin")
        status, _, body = conn.request("GET", "/v1/trainer/state",
                                       headers={"Sec-Fetch-Site": "same-site", "Content-Type": None})
        assert_openai_error(status, body, "cross_origin")
        # Its own origin is fine.
        status, _, _ = conn.request("GET", "/v1/trainer/state",
                                    headers={"Origin": f"http://{conn.host}", "Content-Type": None})
        assert status == 200


def test_bad_numbers_and_paths_on_admin_routes_are_400_and_change_nothing(make_server, tmp_path):
    srv = make_server(admin_key=ADMIN_KEY)
    tid = ready_sample(srv.store, 0)
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "x.safetensors").write_bytes(b"garbage")
    with httpx.Client(base_url=srv.base_url, timeout=60, headers=auth) as c:
        for body in ({"n": 10**400}, {"n": 1e300}, {"n": -1}, {"n": True}, {"n": "3"}, {"n": 1, "lease_s": 10**400},
                     {"n": 1, "min_n": 10**30}):
            r = c.post("/v1/trainer/lease", json=body)
            assert r.status_code == 400, (body, r.text)
            assert_openai_error(r.status_code, r.content)
        for body in ({"path": str(tmp_path), "version": 1e19}, {"path": str(tmp_path), "version": 10**400},
                     {"path": str(tmp_path / "notamodel"), "version": 3},
                     {"path": str(tmp_path / "notamodel"), "kind": "lora"},
                     {"path": "/etc/passwd"}, {"path": str(tmp_path / "missing")}):
            r = c.post("/v1/trainer/weights", json=body)
            assert r.status_code == 400, (body, r.text)
            err = assert_openai_error(r.status_code, r.content)
            assert "garbage" not in err["message"] and "Errno" not in err["message"]
        for body in ({"lease_id": "x", "step": 10**400, "policy_version": 0, "turn_ids": [tid]},
                     {"lease_id": "x", "step": 1, "policy_version": 0, "turn_ids": [10**30]}):
            assert c.post("/v1/trainer/commit", json=body).status_code == 400
        # Dropping a sample that is not leased is refused: the turn does not move while its sample stays ready.
        r = c.post("/v1/trainer/drop", json={"turn_id": tid, "reason": "nope"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "sample_not_leased"
        assert c.get("/v1/trainer/state").status_code == 200
        assert c.get("/healthz").json()["policy_version"] == 0
    assert srv.store.get_turn(tid).state == TurnState.READY and srv.store.count_samples() == {"ready": 1}
    ok = httpx.post(srv.base_url + "/v1/chat/completions", json={**GEN, "messages": [{"role": "user", "content": "a"}]},
                    timeout=60)
    assert ok.status_code == 200  # serving unaffected


# ---------------------------------------------------------------------------------- browsers and rebinding


@pytest.mark.parametrize("headers, code", [
    ({"Content-Type": "text/plain"}, "unsupported_media_type"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "unsupported_media_type"),
    ({"Content-Type": None}, "unsupported_media_type"),
    ({"Origin": "http://evil.example"}, "forbidden_origin"),
    ({"Origin": "null"}, "forbidden_origin"),
    ({"Sec-Fetch-Site": "cross-site"}, "forbidden_origin"),
    ({"Host": "evil.example"}, "forbidden_host"),
    ({"Host": "rebind.evil.example:30000", "Origin": "http://rebind.evil.example:30000"}, "forbidden_host"),
], ids=["text-plain", "form", "no-type", "origin", "null-origin", "fetch-site", "host", "rebinding"])
def test_browser_borne_requests_are_refused_and_not_stored(shared_server, headers, code):
    srv = shared_server
    before = len(srv.store.turns())
    body = {**GEN, "messages": [{"role": "user", "content": "from a web page"}]}
    with RawConnection(srv.port) as conn:
        status, _, raw = conn.request("POST", "/v1/chat/completions", body, headers)
        assert_openai_error(status, raw, code)
        status, _, raw = conn.request("POST", "/v1/trainer/lease", {"n": 1}, headers)
        assert_openai_error(status, raw, code)
        # The same connection keeps working for a proper request.
        status, _, raw = conn.request("POST", "/v1/chat/completions", body)
        assert status == 200, raw
    assert len(srv.store.turns()) == before + 1  # only the proper request was stored


def test_loopback_pages_and_configured_origins_and_hosts_are_served(make_server):
    srv = make_server(allowed_origins=["https://app.example"], allowed_hosts=["clawloop.internal"])
    body = {**GEN, "messages": [{"role": "user", "content": "hi"}]}
    with RawConnection(srv.port) as conn:
        node_client = {"User-Agent": "OpenAI/JS 7.15.0", "Accept": "application/json", "Accept-Language": "*",
                       "Sec-Fetch-Mode": "cors", "X-Stainless-Runtime": "node"}  # what OpenClaw's client sends
        for headers in (node_client, {"Origin": "http://localhost:3000"}, {"Origin": "https://app.example"},
                        {"Host": "clawloop.internal"}, {"Host": f"localhost:{srv.port}"}):
            status, _, raw = conn.request("POST", "/v1/chat/completions", body, headers)
            assert status == 200, (headers, raw)
        status, _, raw = conn.request("POST", "/v1/chat/completions", body, {"Host": "other.example"})
        assert_openai_error(status, raw, "forbidden_host")


# ------------------------------------------------------------------------------------- session ownership


def _chat(c: httpx.Client, key: str, messages: list[dict], **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **extra.pop("headers", {})}
    return c.post("/v1/chat/completions", json={**GEN, "messages": messages, **extra}, headers=headers)


def test_sessions_belong_to_their_key(make_server, tmp_path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# one key per user\n{BOB}\n")
    run_dir = tmp_path / "owned"
    srv = make_server(api_keys=[ALICE], api_keys_file=str(keys_file), run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert _chat(c, "nobody", [{"role": "user", "content": "x"}]).status_code == 401
        first = [{"role": "user", "content": "Alice's private question"}]
        r = _chat(c, ALICE, first)
        assert r.status_code == 200
        alice_sid, alice_turn = r.json()["clawloop"]["session_id"], r.json()["clawloop"]["turn_id"]
        [alice_stored] = [t.id for t in srv.store.turns()]  # a key is shown masked ids, the store keeps its own
        answer = r.json()["choices"][0]["message"]
        replay = first + [{"role": "assistant", "content": answer["content"]},
                          {"role": "user", "content": "Bob's correction"}]
        # Bob replays Alice's conversation: he gets a session of his own, and Alice's turn is not paired.
        r = _chat(c, BOB, replay)
        assert r.status_code == 200
        bob = r.json()["clawloop"]
        assert bob["session_id"] != alice_sid and bob["paired_turn_id"] is None
        assert r.headers["X-Session-Id"] != alice_sid
        assert srv.store.get_turn(alice_stored).state == TurnState.AWAITING_NEXT
        # Bob naming Alice's session id continues a session of his own under that id.
        r = _chat(c, BOB, replay, session_id=alice_sid)
        assert r.status_code == 200 and r.json()["clawloop"]["paired_turn_id"] is None
        bob_turn = r.json()["clawloop"]["turn_id"]
        assert srv.store.get_turn(alice_stored).state == TurnState.AWAITING_NEXT
        assert srv.store.turns()[-1].owner == owner_of(BOB) != owner_of(ALICE)
        # Bob cannot end Alice's session; ending "his" session of that id leaves Alice's alone.
        r = c.post(f"/v1/sessions/{alice_sid}/end", headers={"Authorization": f"Bearer {BOB}"})
        assert r.status_code == 200 and r.json()["dropped_turn_id"] == bob_turn
        assert srv.store.get_turn(alice_stored).state == TurnState.AWAITING_NEXT
        assert c.post(f"/v1/sessions/{alice_sid}/end", headers={"Authorization": f"Bearer {BOB}"}).status_code == 404
    srv.stop()
    # Ownership is durable: after a restart Alice's continuation pairs her turn, Bob's replay does not.
    srv = make_server(api_keys=[ALICE], api_keys_file=str(keys_file), run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        r = _chat(c, BOB, replay)
        assert r.json()["clawloop"]["paired_turn_id"] is None
        assert srv.store.get_turn(alice_stored).state == TurnState.AWAITING_NEXT
        r = _chat(c, ALICE, replay[:-1] + [{"role": "user", "content": "Alice's own follow-up"}])
        assert r.json()["clawloop"]["session_id"] == alice_sid
        assert r.json()["clawloop"]["paired_turn_id"] == alice_turn
        assert srv.store.get_turn(alice_stored).next_state == [{"role": "user", "content": "Alice's own follow-up"}]
