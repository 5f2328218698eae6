"""Where the gate's run prompts come from: the store's recent prompts spread across users and sessions, and its
corrected prompts (a hint or a -1 vote, trained into an accepted version), the same over HTTP for a remote
trainer."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.testclient import TestClient

from clawloop.api.trainer_routes import mount_trainer_routes
from clawloop.config import Config
from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.trainer.remote import RemoteStore


def _add(store, tokenizer, text, *, owner="", session="s"):
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return store.add_turn(TurnRecord(session_id=session, owner=owner, messages=messages, prompt_ids=ids,
                                     response_ids=[5, 2], logprobs=[-0.1, -0.2], temperature=1.0, top_p=1.0,
                                     policy_version=0, turn_index=0))


def _asked(found):
    return [messages[-1]["content"] for _, _, messages in found]


def test_one_user_cannot_fill_the_recent_prompts(tmp_path, tiny_tokenizer):
    store = Store(tmp_path / "store.sqlite")
    _add(store, tiny_tokenizer, "What is a lake?", owner="bob", session="b1")
    _add(store, tiny_tokenizer, "What is a whale?", owner="carol", session="c1")
    for i in range(20):
        _add(store, tiny_tokenizer, f"Question {i} from Alice?", owner="alice", session=f"a{i % 2}")
    found = _asked(store.recent_prompts(8))
    assert len(found) == 8 and "What is a lake?" in found and "What is a whale?" in found
    # The rule: owners take turns (newest first), each owner's sessions take turns, a session newest first.
    assert found == ["Question 19 from Alice?", "What is a whale?", "What is a lake?", "Question 18 from Alice?",
                     "Question 17 from Alice?", "Question 16 from Alice?", "Question 15 from Alice?",
                     "Question 14 from Alice?"]


def test_one_user_flooding_one_prompt_cannot_push_the_others_out(tmp_path, tiny_tokenizer):
    """Hundreds of copies of one prompt from one key: the others' prompts are still among those read, and the
    copies count once."""
    store = Store(tmp_path / "store.sqlite")
    for text in ("What is a lake?", "What is a whale?", "What is a cave?"):
        _add(store, tiny_tokenizer, text, owner="bob", session=text)
    for i in range(250):
        _add(store, tiny_tokenizer, "x", owner="alice", session=f"a{i}")
    assert sorted(_asked(store.recent_prompts(8))) == ["What is a cave?", "What is a lake?", "What is a whale?", "x"]
    assert _asked(store.recent_prompts(8, owner="bob")) == ["What is a cave?", "What is a whale?", "What is a lake?"]


def test_one_session_cannot_fill_a_users_share(tmp_path, tiny_tokenizer):
    store = Store(tmp_path / "store.sqlite")
    _add(store, tiny_tokenizer, "What is a lake?", session="quiet")
    for i in range(10):
        _add(store, tiny_tokenizer, f"Busy question {i}?", session="busy")
    assert _asked(store.recent_prompts(2)) == ["Busy question 9?", "What is a lake?"]


def _trained(store, turn_id, step, *, reward=-1.0, hints=()):
    """The turn's sample, trained by ``step`` (a step of its own)."""
    store.set_next_state(turn_id, [{"role": "user", "content": "No, that's wrong."}])
    store.claim_judgeable(1)
    store.put_sample(SampleRecord(turn_id=turn_id, reward=reward, kind="rl", hints=list(hints)))
    lease, samples = store.lease_samples(1)
    assert [s.turn_id for s in samples] == [turn_id]
    store.commit_step(lease, step, 0, {}, [turn_id])


def test_corrected_prompts_are_those_trained_into_an_accepted_version(tmp_path, tiny_tokenizer):
    store = Store(tmp_path / "store.sqlite")
    voted_down = _add(store, tiny_tokenizer, "What is a frog?", session="s1")
    hinted = _add(store, tiny_tokenizer, "What is a lake?", session="s2")
    liked = _add(store, tiny_tokenizer, "What is a whale?", session="s3")
    rejected = _add(store, tiny_tokenizer, "What is an owl?", session="s4")
    pending = _add(store, tiny_tokenizer, "What is a kettle?", session="s5")
    _trained(store, voted_down, 1)
    _trained(store, hinted, 2, reward=0.0, hints=["Say where lakes come from."])
    _trained(store, liked, 3, reward=1.0)
    store.record_version(1, 3, "accepted", {})
    _trained(store, rejected, 4)
    store.record_event("gate_rejected", {"steps": [4]}, step=4, version=1)
    store.record_version(2, 5, "accepted", {})  # a later version, which the rejected step is not part of
    _trained(store, pending, 6)  # trained, but no version holding it has been accepted yet
    assert _asked(store.recent_prompts(8, corrected=True)) == ["What is a lake?", "What is a frog?"]
    assert len(store.recent_prompts(8)) == 5


def test_the_http_route_and_the_remote_store_give_the_same_prompts(tmp_path, tiny_tokenizer):
    store = Store(tmp_path / "store.sqlite")
    frog = _add(store, tiny_tokenizer, "What is a frog?", owner="bob", session="b1")
    for i in range(5):
        _add(store, tiny_tokenizer, f"Question {i} from Alice?", owner="alice", session="a1")
    _trained(store, frog, 1)
    store.record_version(1, 1, "accepted", {})
    app = FastAPI()
    mount_trainer_routes(app, store, None, Config.from_dict(dict(admin_key="gate-key")))
    remote = RemoteStore("http://testserver", "gate-key")
    remote._client = TestClient(app, headers={"Authorization": "Bearer gate-key"})
    for n, corrected in ((3, False), (8, True), (0, False)):
        assert remote.recent_prompts(n, corrected=corrected) == store.recent_prompts(n, corrected=corrected)
    assert _asked(remote.recent_prompts(3)) == ["Question 4 from Alice?", "What is a frog?", "Question 3 from Alice?"]
