"""The dashboard's JSON views against a run whose records are known (tests/dashboard/known_run.py): the content a
person sees, the admin rule, the browser guard, read-only access, and ``clawloop dashboard RUN_DIR``."""

from __future__ import annotations

import hashlib
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawloop.dashboard.readmodel import view_for_run_dir
from clawloop.store import Store
from known_run import (EVAL_RAW, EXPECTED_ADVANTAGES, HINTS, add_rejected_step, add_two_users_main_sessions,
                       judge_and_train, turn, write_known_run)

ROOT = Path(__file__).resolve().parents[2]
ADMIN_KEY = "dash-admin-4b1e"
USER_KEY = "dash-user-90ac"
VIEWS = ["overview", "sessions", "sessions/s1", "samples/latest", "samples/1", "training", "versions"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def known(tmp_path):
    run_dir = tmp_path / "run"
    ids = write_known_run(run_dir)
    return run_dir, ids


@pytest.fixture
def with_rejection(known):
    run_dir, ids = known
    return run_dir, {**ids, **add_rejected_step(run_dir)}


def test_views_show_the_known_run(make_server, known):
    run_dir, ids = known
    srv = make_server(run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url + "/dashboard/api", timeout=60) as c:
        ov = c.get("overview").json()
        assert ov["live"] and ov["policy_version"] == 0 and ov["policy_version_from"] == "served now"
        assert ov["steps"] == 1 and ov["last_step"]["loss"] == 0.5
        assert ov["turns_by_state"] == {"consumed": 1, "dropped": 1, "awaiting_next": 1}
        assert ov["drop_reasons"] == {"no_next_state": 1} and ov["samples_waiting"] == 0
        assert ov["judge"]["votes"] == 2 and ov["judge"]["invalid_rate"] == 0.0
        assert ov["rollbacks"] == 1 and ov["gate"]["events_by_kind"] == {"gate_accepted": 1, "rollback": 1}
        assert ov["serving"]["live_sessions"] == 1  # s2 waits for its next message

        sessions = c.get("sessions").json()["sessions"]
        assert [s["session_id"] for s in sessions] == ["s2", "s1"]  # most recently active first
        assert sessions[1]["turns"] == 2 and sessions[1]["states"] == {"consumed": 1, "dropped": 1}

        s1 = c.get("sessions/s1").json()["turns"]
        first, second = s1
        assert first["answer"] == "Paris is a city." and first["next_state"][0]["content"] == "That is wrong, be brief."
        assert [(v["kind"], v["score"]) for v in first["votes"]] == [("eval", -1), ("hint", 1)]
        assert first["votes"][0]["raw_text"] == EVAL_RAW
        assert first["sample"]["hints"] == HINTS
        assert first["sample"]["chosen_hint"] == {"index": 1, "hint": HINTS[1], "selection": "sequence_optimal"}
        assert first["fate"] == {"fate": "trained", "step": 1, "version": 1,
                                 "text": "trained at step 1, published in v1"}
        assert second["fate"]["fate"] == "dropped" and second["fate"]["reason"] == "no_next_state"
        assert c.get("sessions/nobody").status_code == 404

        sample = c.get("samples/latest").json()
        assert sample == c.get(f"samples/{ids['t1']}").json()
        assert [t["advantage"] for t in sample["tokens"]] == pytest.approx(EXPECTED_ADVANTAGES)
        assert [t["hint_index"] for t in sample["tokens"]] == [1, 1, 1]
        assert [t["overlap"] for t in sample["tokens"]] == [2, 2, 2]
        tok = sample["tokens"][0]
        assert [e["id"] for e in tok["student_topk"]] == [10, 20] and all(e["shared"] for e in tok["teacher_topk"])
        assert tok["text"] == srv.engine.tokenizer.convert_ids_to_tokens(10)  # this id's piece is plain text
        assert sample["grpo"]["reward"] == -1.0 and sample["grpo"]["votes"][0]["raw_text"] == EVAL_RAW
        unjudged = c.get(f"samples/{ids['t3']}").json()
        assert unjudged["grpo"] is None and not unjudged["has_targets"] and "advantage" not in unjudged["tokens"][0]
        assert c.get("samples/999").status_code == 404
        assert c.get("samples/99999999999999999999").status_code == 404  # past SQLite's row ids: no 500

        training = c.get("training").json()
        assert training["steps"] == [1] and training["series"]["loss"] == [0.5]
        assert training["series"]["opd_overlap_at_h_star"] == [2.0]
        assert [(e["name"], e["score"]) for e in training["evaluations"]] == [("before", 0.25)]

        versions = c.get("versions").json()
        assert [(v["version"], v["status"]) for v in versions["versions"]] == [(1, "accepted"), (2, "rolled_back")]
        assert versions["versions"][0]["steps"] == [1] and versions["versions"][0]["samples"] == 1
        assert [e["kind"] for e in versions["timeline"]] == ["gate_accepted", "rollback"]


def test_a_version_lists_only_the_steps_it_contains(make_server, with_rejection):
    """Step 2 was rejected by the gate and its update thrown away: v3 holds step 3 only, and step 2 is listed as
    in no version."""
    run_dir, _ = with_rejection
    srv = make_server(run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url + "/dashboard/api", timeout=60) as c:
        versions = c.get("versions").json()
    by_number = {v["version"]: v for v in versions["versions"]}
    assert [(n, v["status"], v["steps"], v["samples"]) for n, v in by_number.items()] == [
        (1, "accepted", [1], 1), (2, "rolled_back", [], 0), (3, "accepted", [3], 1)]
    assert [(s["step"], s["fate"], s["text"]) for s in versions["steps_in_no_version"]] == [
        (2, "rejected", "trained at step 2, rejected by the gate, not in any served version")]


def test_turns_of_a_rejected_step_say_so(make_server, with_rejection):
    run_dir, ids = with_rejection
    srv = make_server(run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url + "/dashboard/api", timeout=60) as c:
        rejected, accepted = c.get("sessions/s3").json()["turns"]
        sample = c.get(f"samples/{ids['t4']}").json()
    assert rejected["fate"] == {"fate": "rejected", "step": 2,
                                "text": "trained at step 2, rejected by the gate, not in any served version"}
    assert sample["fate"] == rejected["fate"]
    assert accepted["fate"] == {"fate": "trained", "step": 3, "version": 3,
                                "text": "trained at step 3, published in v3"}


def test_steps_a_rollback_threw_away_or_the_gate_has_not_checked_say_so(with_rejection):
    """Checked every 2 steps: step 4 waits for the check when a rollback to v1 throws it away (and v3 with it);
    step 5 is still waiting."""
    run_dir, _ = with_rejection
    store = Store(run_dir / "store.sqlite")
    try:
        t6 = store.add_turn(turn("s4", 0, "Unchecked, then thrown away."))
        t7 = store.add_turn(turn("s4", 1, "Still unchecked."))
        judge_and_train(store, t6, 4, 1.0, lambda: 3, gate_due_in=1)
        store.record_rollback(1, 3, {"optimizer": "restored", "step": 4})
        judge_and_train(store, t7, 5, 1.0, lambda: 1, gate_due_in=1)
    finally:
        store.close()
    view = view_for_run_dir(run_dir)
    fates = [t["fate"]["text"] for t in view.session("s4")["turns"]]
    assert fates == ["trained at step 4, discarded by a rollback to v1, not in any served version",
                     "trained at step 5, waiting for the gate's next check (not served yet)"]
    assert view.session("s3")["turns"][1]["fate"]["text"] == "trained at step 3, in v3 (rolled back)"
    versions = view.versions()
    assert [s["step"] for s in versions["steps_in_no_version"]] == [2, 4, 5]
    assert {v["version"]: v["steps"] for v in versions["versions"]} == {1: [1], 2: [], 3: [3]}


def test_a_finished_run_names_its_judge(make_server, known):
    """The judge a server ran is still named once the server is gone (`clawloop dashboard RUN_DIR`)."""
    run_dir, _ = known
    srv = make_server(run_dir=run_dir, judge_backend="rules")
    with httpx.Client(base_url=srv.base_url + "/dashboard/api", timeout=60) as c:
        live = c.get("overview").json()["judge"]
    srv.stop()
    finished = view_for_run_dir(run_dir).overview()
    assert not finished["live"] and live["backend"] == "rules"
    assert {k: finished["judge"][k] for k in ("backend", "sees", "judging")} == \
        {k: live[k] for k in ("backend", "sees", "judging")}


def test_the_data_needs_the_admin_key_and_the_page_holds_none(make_server, known):
    run_dir, _ = known
    srv = make_server(run_dir=run_dir, api_key=USER_KEY, admin_key=ADMIN_KEY)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for view in VIEWS:
            for headers in ({}, {"Authorization": f"Bearer {USER_KEY}"}, {"Authorization": "Bearer wrong"}):
                r = c.get(f"/dashboard/api/{view}", headers=headers)
                assert r.status_code == 401, (view, headers, r.text)
            ok = c.get(f"/dashboard/api/{view}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert ok.status_code == 200, (view, ok.text)
        page = c.get("/dashboard/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "s1" not in page.text and "Paris" not in page.text
        assert c.get("/dashboard/static/vendor/uplot/uPlot.iife.min.js").status_code == 200
        assert c.get("/dashboard", follow_redirects=False).headers["location"] == "/dashboard/"


def test_user_keys_without_an_admin_key_close_the_data(make_server, known):
    run_dir, _ = known
    srv = make_server(run_dir=run_dir, api_key=USER_KEY)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        r = c.get("/dashboard/api/sessions", headers={"Authorization": f"Bearer {USER_KEY}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"


def test_the_browser_guard_covers_the_dashboard(make_server, known):
    run_dir, _ = known
    srv = make_server(run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        own = srv.base_url
        same_origin = {"Origin": own, "Sec-Fetch-Site": "same-origin"}
        assert c.get("/dashboard/api/sessions", headers=same_origin).status_code == 200
        assert c.get("/dashboard/api/sessions", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200
        for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
            r = c.get("/dashboard/api/sessions", headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin", headers
        r = c.get("/dashboard/", headers={"Host": "rebind.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host"


def test_the_dashboard_changes_nothing(make_server, known):
    run_dir, _ = known
    srv = make_server(run_dir=run_dir)
    store_file = run_dir / "store.sqlite"
    before = [tuple(r) for r in sqlite3.connect(store_file).iterdump()]
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for view in VIEWS:
            assert c.get(f"/dashboard/api/{view}").status_code == 200
            for method in ("POST", "PUT", "DELETE", "PATCH"):
                r = c.request(method, f"/dashboard/api/{view}", json={})
                assert r.status_code == 405, (method, view)
    assert [tuple(r) for r in sqlite3.connect(store_file).iterdump()] == before
    # The views' own handle is SQLite's read-only mode: even a write slipped in would be refused.
    view = view_for_run_dir(run_dir)
    handle = view.open_store()
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            handle.set_meta("x", "y")
    finally:
        handle.close()


def free_port() -> int:
    for port in range(31100, 31200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 31100-31199")


def test_clawloop_dashboard_serves_a_finished_run(known, tiny_tokenizer):
    run_dir, ids = known
    before = digest(run_dir / "store.sqlite")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CLAWLOOP_ADMIN_KEY": ADMIN_KEY}
    proc = subprocess.Popen([sys.executable, "-m", "clawloop.cli", "dashboard", str(run_dir), "--port", str(port),
                             "--model", "tiny"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/dashboard/", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(0.2)
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx.get(f"{base}/dashboard/api/overview", timeout=30).status_code == 401
        ov = httpx.get(f"{base}/dashboard/api/overview", headers=auth, timeout=30).json()
        assert not ov["live"] and ov["policy_version"] == 1  # v2 was rolled back
        sample = httpx.get(f"{base}/dashboard/api/samples/{ids['t1']}", headers=auth, timeout=30).json()
        assert [t["advantage"] for t in sample["tokens"]] == pytest.approx(EXPECTED_ADVANTAGES)
        texts = [t["text"] for t in sample["tokens"]]  # from the tokenizer of --model, not bare ids
        assert texts == tiny_tokenizer.convert_ids_to_tokens([t["id"] for t in sample["tokens"]])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert digest(run_dir / "store.sqlite") == before


def test_clawloop_dashboard_refuses_a_folder_without_a_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "clawloop.cli", "dashboard", str(tmp_path)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 2 and "holds no store" in out.stderr


def as_older_store(run_dir, statements: str):
    """The run's store made as an older version of the code wrote it (``statements`` take away what it lacked):
    its digest, and a view of it."""
    db = sqlite3.connect(run_dir / "store.sqlite")
    db.executescript("DROP INDEX turns_owner; " + statements)  # the index came with the owner columns
    db.close()
    return digest(run_dir / "store.sqlite"), view_for_run_dir(run_dir)


def test_a_store_older_than_the_code_is_shown_as_it_is(known):
    """A run recorded before versions, events and per-user owners existed: read as it is, nothing added to it."""
    run_dir, _ = known
    before, view = as_older_store(run_dir, "DROP TABLE events; DROP TABLE versions; DROP TABLE requeued_steps; "
                                           "ALTER TABLE turns DROP COLUMN owner;")
    assert view.overview()["rollbacks"] == 0 and view.versions()["versions"] == []
    assert view.session("s1")["turns"][0]["fate"]["text"] == "trained at step 1"
    assert view.training()["steps"] == [1]
    tables = {r[0] for r in sqlite3.connect(run_dir / "store.sqlite").execute("SELECT name FROM sqlite_master")}
    assert "events" not in tables and digest(run_dir / "store.sqlite") == before


def test_a_store_older_than_its_owner_columns_is_shown_as_it_is(known):
    """The tables are all there but were written before the per-user ``owner`` column: every view reads them."""
    run_dir, _ = known
    before, view = as_older_store(run_dir, "ALTER TABLE turns DROP COLUMN owner; ALTER TABLE steps DROP COLUMN "
                                           "owner; ALTER TABLE versions DROP COLUMN owner;")
    assert view.overview()["rollbacks"] == 1
    assert [(v["version"], v["status"]) for v in view.versions()["versions"]] == [(1, "accepted"), (2, "rolled_back")]
    assert view.session("s1")["turns"][0]["fate"]["text"] == "trained at step 1, published in v1"
    assert view.sessions()["sessions"][0]["owner"] == ""
    assert digest(run_dir / "store.sqlite") == before


def test_two_users_sessions_of_the_same_name_stay_apart(make_server, known):
    """Per-user keys: users choose their session ids, so alice's "main" and bob's "main" are two sessions, each
    shown with its own turns and its owner."""
    run_dir, _ = known
    add_two_users_main_sessions(run_dir)
    srv = make_server(run_dir=run_dir)
    with httpx.Client(base_url=srv.base_url + "/dashboard/api", timeout=60) as c:
        listed = [(s["session_id"], s["owner"], s["turns"]) for s in c.get("sessions").json()["sessions"]]
        assert listed[:2] == [("main", "bob", 1), ("main", "alice", 1)]
        for owner in ("alice", "bob"):
            shown = c.get("sessions/main", params={"owner": owner}).json()
            assert shown["owner"] == owner and [t["answer"] for t in shown["turns"]] == [f"answer to {owner}"]
        assert c.get("sessions/main").status_code == 404  # no keyless session of that name
        assert c.get("sessions/s1").json()["owner"] == ""


def test_a_served_run_read_from_its_folder_shows_its_tokens_and_hints_as_its_server_did(make_server, known):
    """A run no demo summarised (clawloop serve): its server keeps the model and hint settings in the store, and
    `clawloop dashboard RUN_DIR` reads them from there instead of its own defaults."""
    from clawloop.config import Config
    from clawloop.dashboard.standalone import build_app

    run_dir, _ = known
    make_server(run_dir=run_dir, hint_selection="shortest", adv_diff_clip=0.5).stop()
    _, view = build_app(run_dir, Config.load(env={}, admin_key=ADMIN_KEY))
    assert (view.hint_selection, view.adv_diff_clip) == ("shortest", 0.5)
    assert view.sample_tokens(1)["chosen_hint"]["selection"] == "shortest"


def test_a_fresh_server_shows_an_empty_run(make_server):
    srv = make_server()
    with httpx.Client(base_url=srv.base_url + "/dashboard/api", timeout=60) as c:
        ov = c.get("overview").json()
        assert ov["turns_total"] == 0 and ov["steps"] == 0 and ov["judge"]["invalid_rate"] is None
        assert c.get("sessions").json() == {"sessions": []}
        latest = c.get("samples/latest")
        assert latest.status_code == 200 and latest.json() is None
        assert c.get("training").json()["steps"] == [] and c.get("versions").json()["versions"] == []


def test_a_running_run_is_read_beside_its_server(make_server, known):
    """`clawloop dashboard RUN_DIR` on a run whose server is up: the server keeps writing, the view sees it."""
    run_dir, _ = known
    srv = make_server(run_dir=run_dir)
    view = view_for_run_dir(run_dir)
    assert [s["session_id"] for s in view.sessions()["sessions"]] == ["s2", "s1"]
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", headers={"X-Session-Id": "later"},
                   json={"model": "clawloop", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
    assert view.sessions()["sessions"][0]["session_id"] == "later"
    assert view.overview()["turns_total"] == 4 and not view.overview()["live"]
