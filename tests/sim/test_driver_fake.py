"""The driver speaks the clawloop HTTP protocol: checked against a recording OpenAI-compatible endpoint."""

from __future__ import annotations

from clawloop.sim.driver import Simulation, evaluate
from clawloop.sim.personas import get_persona

ENGLISH = "Bread is made from flour, water and salt."
FRENCH = "Le pain est fait avec de la farine, de l'eau et du sel."


def english_first_then_french(body, headers):
    """Answers English until the user has asked for French once, then French."""
    asked = any("french" in m["content"].lower() for m in body["messages"] if m["role"] == "user")
    return FRENCH if asked else ENGLISH


def test_session_flow_headers_and_ending_by_header(fake_openai):
    fake_openai.responder = english_first_then_french
    persona = get_persona("french")
    turns = []
    sim = Simulation(fake_openai.base_url, persona, seed=1, max_tokens=32, temperature=1.0, on_turn=turns.append)
    record = sim.run_session(turns=3)

    assert [t.reply_kind for t in record.turns] == ["correction", "thanks", "farewell"]
    assert turns == record.turns
    # A correction repeats the question; thanks moves to the next one.
    assert record.turns[0].question == record.turns[1].question
    assert record.turns[2].question != record.turns[1].question
    assert record.turns[2].question in record.turns[1].reply
    assert all(t.question in persona.train_questions for t in record.turns)

    reqs = fake_openai.chat_requests()
    assert len(reqs) == 4  # three answers + the closing request carrying the last reply
    assert {r["headers"]["x-session-id"] for r in reqs} == {record.session_id}
    assert all(r["headers"]["x-turn-type"] == "main" for r in reqs)
    assert ["x-session-done" in r["headers"] for r in reqs] == [False, False, False, True]
    assert reqs[-1]["headers"]["x-session-done"] == "true"
    assert reqs[-1]["body"]["max_tokens"] == 1
    assert all(r["body"]["max_tokens"] == 32 and r["body"]["temperature"] == 1.0 for r in reqs[:3])
    # Each request extends the previous conversation by the answer and the user's reply.
    for prev, nxt, turn in zip(reqs, reqs[1:], record.turns):
        assert nxt["body"]["messages"] == prev["body"]["messages"] + [
            {"role": "assistant", "content": turn.answer},
            {"role": "user", "content": turn.reply},
        ]


def test_session_can_end_through_the_endpoint(fake_openai):
    fake_openai.responder = english_first_then_french
    sim = Simulation(fake_openai.base_url + "/v1", get_persona("french"), seed=0, end_mode="endpoint")
    record = sim.run_session(turns=2)
    assert len(fake_openai.chat_requests()) == 2
    assert fake_openai.requests[-1]["path"] == f"/v1/sessions/{record.session_id}/end"
    assert not any("x-session-done" in r["headers"] for r in fake_openai.chat_requests())


def test_run_counts_interactions_and_is_reproducible(fake_openai):
    fake_openai.responder = english_first_then_french
    persona = get_persona("french")

    def transcript(seed):
        fake_openai.requests.clear()
        sessions = Simulation(fake_openai.base_url, persona, seed=seed).run(interactions=7)
        return sessions, [r["body"] for r in fake_openai.chat_requests()]

    sessions, bodies = transcript(5)
    assert [len(s.turns) for s in sessions] == [3, 3, 1]
    assert len({s.session_id for s in sessions}) == 3
    assert transcript(5)[1] == bodies  # same seed, same requests (questions, replies, sampling seeds)
    assert transcript(6)[1] != bodies


def test_evaluate_uses_side_turns_greedy_and_scores_with_checker_and_guard(fake_openai):
    persona = get_persona("french")
    loop = "C'est le pain. " * 8  # French, but degenerate
    answers = {q: (FRENCH if i % 3 == 0 else loop if i % 3 == 1 else ENGLISH)
               for i, q in enumerate(persona.heldout_questions)}
    fake_openai.responder = lambda body, headers: answers[body["messages"][0]["content"]]

    result = evaluate(fake_openai.base_url, persona)
    n = len(persona.heldout_questions)
    assert result.n == n
    assert result.score == sum(1 for i in range(n) if i % 3 == 0) / n
    assert result.satisfied_rate == sum(1 for i in range(n) if i % 3 != 2) / n
    assert result.guard_pass_rate == sum(1 for i in range(n) if i % 3 != 1) / n
    reqs = fake_openai.chat_requests()
    assert len(reqs) == n
    assert all(r["headers"]["x-turn-type"] == "side" for r in reqs)
    assert all(r["headers"]["x-session-done"] == "true" for r in reqs)
    assert all(r["body"]["temperature"] == 0.0 and r["body"]["max_tokens"] == 64 for r in reqs)
    assert len({r["headers"]["x-session-id"] for r in reqs}) == n
    assert not {r["body"]["messages"][0]["content"] for r in reqs} & set(persona.train_questions)
    assert result.summary()["score"] == result.score


def test_evaluate_with_instruction_appends_the_preference(fake_openai):
    persona = get_persona("inshort")
    fake_openai.responder = lambda body, headers: "In short, " + body["messages"][0]["content"].split("\n")[0]
    result = evaluate(fake_openai.base_url, persona, persona.heldout_questions[:2], instruct=True)
    assert result.score == 1.0 and result.instructed
    assert all(r["body"]["messages"][0]["content"].endswith(persona.preference)
               for r in fake_openai.chat_requests())


def test_concurrent_evaluation_keeps_question_order(fake_openai):
    persona = get_persona("brief")
    fake_openai.responder = lambda body, headers: body["messages"][0]["content"].replace("What is", "It is")
    seq = evaluate(fake_openai.base_url, persona)
    par = evaluate(fake_openai.base_url, persona, concurrency=4)
    assert [i.question for i in par.items] == list(persona.heldout_questions)
    assert [(i.answer, i.ok) for i in par.items] == [(i.answer, i.ok) for i in seq.items]
