"""Per-user policies on a live server (``policy_scope = "per_user"``): two user keys, real HTTP, the rule judge.

User A's conversations train A's own adapter, which then serves A's answers under A's versions; user B's answers
stay exactly the base model's, token for token and log-prob for log-prob, before and after A trained, whatever B
puts in the request. Each user's versions, steps and folder are their own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from clawloop.api.auth import owner_of
from clawloop.config import Config, ConfigError
from clawloop.runtime import build_runtime
from clawloop.store import Store, TurnState
from clawloop.trainer.forget import forget_user
from tests.e2e_support import QUESTIONS, chat

KEY_A = "per-user-key-a-5b1e"
KEY_B = "per-user-key-b-90c4"
ADMIN_KEY = "per-user-admin-key-77f0"
MARKER = "Asked by the quokka."
PROBE = [{"role": "user", "content": "Tell me a joke."}]


def per_user_config(model: Path, run_dir: Path, **overrides) -> Config:
    values = dict(model=str(model), device="cpu", run_dir=str(run_dir), port=0, api_keys=[KEY_A, KEY_B],
                  policy_scope="per_user", judge_backend="rules", prm_m=1, method="rl", lora=True, lr=1e-2,
                  rollout_batch_size=2, micro_batch_size=2, default_max_tokens=8, num_threads=1,
                  batch_wait_s=0.0, idle_train_s=0.0, gate_probe_tokens=8,
                  gate_min_guard_pass=0.0)  # word salad: no guard share (tests/e2e_support.py)
    values.update(overrides)
    return Config.load(env={}, **values)


PENDING = (TurnState.JUDGEABLE, TurnState.JUDGING, TurnState.READY, TurnState.LEASED)


def settled(runtime, owner: str) -> bool:
    """Whether every turn of ``owner`` has been judged and trained on and the trainer is between steps, so no later
    version of theirs is on its way: A's turns make more than one step, and an answer read before the last one was
    published was once compared with the next version's."""
    store = runtime.server.store
    pending = any(t.owner == owner for state in PENDING for t in store.turns(state=state))
    return not pending and not runtime.trainer.training


def talk(http: httpx.Client, session: str, question: str, corrected: bool) -> None:
    """A judged conversation: a question, a reply the rule judge reads as a correction or as thanks, the end."""
    messages = [{"role": "user", "content": question}]
    answer = chat(http, session, messages)["choices"][0]["message"]
    reply = "That is wrong, try again." if corrected else "Great, thanks!"
    chat(http, session, messages + [{"role": "assistant", "content": answer.get("content") or ""},
                                    {"role": "user", "content": reply}])
    http.post(f"/v1/sessions/{session}/end").raise_for_status()


def ask(http: httpx.Client, **extra) -> dict:
    response = http.post("/v1/chat/completions", headers={"X-Turn-Type": "side"},
                         json={"model": "clawloop", "messages": PROBE, "temperature": 0.0, "max_tokens": 8,
                               "logprobs": True, **extra})
    response.raise_for_status()
    return response.json()


def served(answer: dict) -> tuple[list[str], list[float]]:
    content = answer["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def test_one_users_training_never_changes_what_another_is_served(tiny_model_path, tmp_path):
    torch.set_num_threads(2)
    config = per_user_config(tiny_model_path, tmp_path / "run")
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    a, b = owner_of(KEY_A), owner_of(KEY_B)
    with runtime:
        url = runtime.server.base_url
        engine = runtime.server.engine
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY_A}"}) as user_a, \
                httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY_B}"}) as user_b:
            b_before = ask(user_b)
            a_before = ask(user_a)
            assert served(a_before) == served(b_before)  # both start from the base model
            assert b_before["clawloop"]["policy_version"] == 0

            # B talks too, but never fills a batch (one sample of B's, batches of 2, no partial batches).
            talk(user_b, "b0", QUESTIONS[5], corrected=True)
            for i in range(4):
                talk(user_a, f"a{i}", f"{QUESTIONS[i]} {MARKER}", corrected=i % 2 == 0)
            deadline = time.time() + 300
            while engine.adapter_version(a) is None or runtime.trainer.policies.trainers[a].step < 2:
                assert time.time() < deadline, f"A's adapter was not published: {runtime.trainer.status()}"
                time.sleep(0.2)

            a_after = ask(user_a)
            b_after = ask(user_b)
            b_naming_a = ask(user_b, model=a, user=a)  # nothing in a request selects another user's adapter
            version_a = engine.adapter_version(a)
            assert a_after["clawloop"]["policy_version"] == version_a >= 1
            assert engine.adapter_version(b) is None
            assert b_after["clawloop"]["policy_version"] == 0 == b_naming_a["clawloop"]["policy_version"]
            assert served(b_after) == served(b_before) == served(b_naming_a)  # exactly, float for float
            assert served(a_after) != served(a_before)  # A's adapter moved what A is served

            status = user_a.get("/v1/status")
            assert status.status_code == 200

    store = Store(Path(config.run_dir) / "store.sqlite")
    try:
        steps = store.steps()
        assert steps and {s["owner"] for s in steps} == {a}
        versions = store.versions()
        assert versions and {v["owner"] for v in versions} == {a}
        assert store.ready_count(owner=b) == 1  # B's sample waits for B's own batch
        assert {v["version"] for v in versions} >= {version_a}
    finally:
        store.close()
    assert (Path(config.run_dir) / "users" / a / "versions").is_dir()
    assert not (Path(config.run_dir) / "users" / b).exists()
    assert not (Path(config.run_dir) / "versions").exists()  # nothing trained a shared policy

    # A restart with --resume serves A's adapter again, at its version, with the very same answer.
    runtime = build_runtime(config, resume=True, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    with runtime:
        with httpx.Client(base_url=runtime.server.base_url, timeout=120,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as user_a:
            resumed = ask(user_a)
    assert resumed["clawloop"]["policy_version"] == version_a and served(resumed) == served(a_after)

    # Forgetting A: A's rows, adapter versions and folder go, and none of A's text is left in the store's files;
    # B's sample is untouched, and the restarted server serves A the base model again.
    receipt = forget_user_of(config.run_dir, a)
    assert receipt["user_policy_removed"] and set(receipt["retired_versions"]) == {v["version"] for v in versions}
    assert not (Path(config.run_dir) / "users" / a).exists()
    for path in Path(config.run_dir).rglob("*"):  # the store, its log, every folder
        assert not path.is_file() or MARKER.encode() not in path.read_bytes(), path
    store = Store(Path(config.run_dir) / "store.sqlite")
    try:
        assert store.count_turns(owner=a) == {} and store.ready_count(owner=b) == 1
        assert {v["status"] for v in store.versions(owner=a)} == {"retired"}
    finally:
        store.close()
    runtime = build_runtime(config, resume=True, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    with runtime:
        with httpx.Client(base_url=runtime.server.base_url, timeout=120,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as user_a:
            again = ask(user_a)
        assert runtime.server.engine.adapter_version(a) is None
    assert again["clawloop"]["policy_version"] == 0 and served(again) == served(a_before)


def forget_user_of(run_dir: str, owner: str) -> dict:
    store = Store(Path(run_dir) / "store.sqlite")
    try:
        return forget_user(store, run_dir, owner)
    finally:
        store.close()


def test_per_user_needs_lora_keys_and_the_embedded_engine(tiny_model_path, tmp_path):
    with pytest.raises(ConfigError, match="lora"):
        per_user_config(tiny_model_path, tmp_path, lora=False)
    with pytest.raises(ConfigError, match="api_keys"):
        per_user_config(tiny_model_path, tmp_path, api_keys=[])
    with pytest.raises(ConfigError, match="teacher"):
        per_user_config(tiny_model_path, tmp_path, teacher="policy")
    # Fewer adapter slots than batch rows: a request could find every slot in use, failing its admission group.
    with pytest.raises(ConfigError, match="user_adapter_slots"):
        per_user_config(tiny_model_path, tmp_path, user_adapter_slots=2, max_batch_size=4)
    assert per_user_config(tiny_model_path, tmp_path, user_adapter_slots=4, max_batch_size=4).user_adapter_slots == 4


def test_a_user_forgotten_on_the_running_server_is_served_the_base_model_and_leaves_nothing(tiny_model_path,
                                                                                              tmp_path):
    torch.set_num_threads(2)
    config = per_user_config(tiny_model_path, tmp_path / "run", admin_key=ADMIN_KEY)
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    a, b = owner_of(KEY_A), owner_of(KEY_B)
    run_dir = Path(config.run_dir)
    with runtime:
        url = runtime.server.base_url
        engine = runtime.server.engine
        with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY_A}"}) as user_a, \
                httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY_B}"}) as user_b, \
                httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as admin:
            a_before, b_before = ask(user_a), ask(user_b)
            for i in range(4):
                talk(user_a, f"a{i}", f"{QUESTIONS[i]} {MARKER}", corrected=i % 2 == 0)
            talk(user_b, "b0", QUESTIONS[5], corrected=True)
            deadline = time.time() + 300
            while engine.adapter_version(a) is None or not settled(runtime, a):
                assert time.time() < deadline, f"A's training did not settle: {runtime.trainer.status()}"
                time.sleep(0.2)
            trained = ask(user_a)
            assert served(trained) != served(a_before)
            version_a = trained["clawloop"]["policy_version"]
            assert version_a == engine.adapter_version(a)

            # Rolling A back (to the base model, then to A's version again) changes only A's answers.
            assert admin.post("/v1/admin/rollback", json={"version": 0}).status_code == 400  # whose?
            assert admin.post("/v1/admin/rollback", json={"version": 0, "user": "k_" + "0" * 24}).status_code == 404
            assert admin.post("/v1/admin/rollback", json={"version": version_a, "user": b}).status_code == 404
            assert admin.post("/v1/admin/rollback", json={"version": 0, "user": a}).status_code == 200
            assert served(ask(user_a)) == served(a_before) and served(ask(user_b)) == served(b_before)
            back = admin.post("/v1/admin/rollback", json={"version": version_a, "user": a})
            assert back.status_code == 200, back.text
            again = ask(user_a)
            assert again["clawloop"]["policy_version"] == version_a and served(again) == served(trained)
            user_a.post("/v1/chat/completions", headers={"X-Session-Id": "a-open"},  # a session still open
                        json={"model": "clawloop", "max_tokens": 4,
                              "messages": [{"role": "user", "content": f"Hello. {MARKER}"}]}).raise_for_status()

            assert user_a.post("/v1/admin/forget", json={"user": a}).status_code == 401  # a user key cannot
            assert admin.post("/v1/admin/forget", json={"user": "../etc"}).status_code == 400
            other_writer = Store(run_dir / "store.sqlite")  # e.g. an offline command on the same run
            try:  # the forget cannot go on, so it lets go of nothing: A keeps their policy
                refused = admin.post("/v1/admin/forget", json={"user": a})
                assert refused.status_code == 409 and refused.json()["error"]["code"] == "store_in_use"
                assert engine.adapter_version(a) == version_a and a in runtime.trainer.policies.trainers
                assert served(ask(user_a)) == served(trained)
            finally:
                other_writer.close()
            done = admin.post("/v1/admin/forget", json={"user": a})
            assert done.status_code == 200, done.text
            receipt = done.json()
            assert receipt["user_policy_removed"] and receipt["sessions_ended"] == 1 and receipt["turn_ids"]
            assert MARKER not in done.text

            after = ask(user_a)
            assert after["clawloop"]["policy_version"] == 0 and served(after) == served(a_before)
            assert served(ask(user_b)) == served(b_before)
            assert engine.adapter_version(a) is None and a not in runtime.trainer.policies.trainers
            assert not (run_dir / "users" / a).exists()
            for path in run_dir.rglob("*"):  # the live store's file and log included
                assert not path.is_file() or MARKER.encode() not in path.read_bytes(), path
            assert runtime.server.store.ready_count(owner=b) == 1  # B's sample is untouched
            shown = admin.get("/dashboard/api/versions").json()  # the dashboard lists the receipt, no text
            (listed,) = shown["forget_receipts"]
            assert listed["owner"] == a and listed["retired_versions"] == receipt["retired_versions"]
            assert MARKER not in json.dumps(shown) and user_a.get("/dashboard/api/versions").status_code in (401, 403)
            talk(user_a, "a-new", QUESTIONS[6], corrected=False)  # the key keeps working: new data from here on
        receipts = list((run_dir / "receipts").glob("forget-*.json"))
        assert len(receipts) == 1
