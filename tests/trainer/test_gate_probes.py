"""What the publication gate probes: the shipped prompts and the run's recent distinct prompts, with the guard's
question rules wherever the question is known."""

from __future__ import annotations

from clawloop.gate.gate import PublicationGate, question_of
from clawloop.gate.probes import PROBES
from clawloop.store import Store, TurnRecord


def _turn(messages, prompt_ids, i):
    return TurnRecord(session_id=f"s{i}", messages=messages, prompt_ids=prompt_ids, response_ids=[5, 2],
                      logprobs=[-0.1, -0.2], temperature=1.0, top_p=1.0, policy_version=0, turn_index=0)


def test_a_recent_prompt_gives_the_guard_its_last_user_message_as_the_question():
    assert question_of([{"role": "user", "content": " What is a glacier? "}]) == "What is a glacier?"
    assert question_of([{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "What is a frog?"}]}]) == \
        "What is a frog?"
    # Later in a conversation the last message is the question ("Bye!" to it is off topic).
    assert question_of([{"role": "user", "content": "What is a frog?"}, {"role": "assistant", "content": "A."},
                        {"role": "user", "content": "Thanks! What is a lake?"}]) == "Thanks! What is a lake?"
    # A tool result or an image says nothing the guard can check the answer against.
    assert question_of([{"role": "user", "content": "Run it."}, {"role": "tool", "content": "ok"}]) is None
    assert question_of([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]) is None
    assert question_of([{"role": "user", "content": "   "}]) is None and question_of([]) is None


def test_recent_prompts_are_distinct_newest_first(tmp_path, tiny_tokenizer):
    store = Store(tmp_path / "store.sqlite")
    assert store.recent_prompts(3) == []  # a run with no turns yet
    asked = ["What is a frog?", "What is a lake?", "What is a frog?", "What is a whale?"]
    for i, q in enumerate(asked):
        messages = [{"role": "user", "content": q}]
        ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        store.add_turn(_turn(messages, list(ids["input_ids"] if hasattr(ids, "keys") else ids), i))
    recent = store.recent_prompts(3)
    assert [m[0]["content"] for _, _, m in recent] == ["What is a whale?", "What is a frog?", "What is a lake?"]
    assert [turn_id for turn_id, _, _ in recent] == [4, 3, 2]  # the older copy of the frog question is skipped

    gate = PublicationGate(tiny_tokenizer, recent_prompts=lambda: store.recent_prompts(3))
    probes = gate.probe_set()
    assert len(probes) == len(PROBES) + 3
    assert [(p.source, p.question) for p in probes[len(PROBES):]] == [
        ("recent:4", "What is a whale?"), ("recent:3", "What is a frog?"), ("recent:2", "What is a lake?")]
