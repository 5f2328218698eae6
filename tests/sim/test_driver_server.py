"""The driver against a real clawloop server (tiny model, real HTTP, real store)."""

from __future__ import annotations

import pytest

from clawloop.config import Config
from clawloop.serve import Server
from clawloop.sim.driver import Simulation, evaluate
from clawloop.sim.personas import get_persona
from clawloop.store import TurnState


@pytest.fixture
def server(tmp_path, tiny_engine):
    config = Config.load(env={}, model="tiny", port=0, run_dir=str(tmp_path / "run"), default_max_tokens=8,
                         num_threads=2, max_batch_size=8)
    srv = Server(config, engine=tiny_engine).start()
    yield srv
    srv.stop()


def test_two_sessions_are_stored_paired_and_ended(server):
    persona = get_persona("brief")
    sim = Simulation(server.base_url, persona, seed=0, max_tokens=8, temperature=1.0)
    sessions = [sim.run_session(turns=2), sim.run_session(turns=2)]

    assert len({s.session_id for s in sessions}) == 2
    for record in sessions:
        stored = server.store.turns(session_id=record.session_id)
        # Two answered turns plus the closing request that delivered the last reply.
        assert len(stored) == 3
        answered, closing = stored[:2], stored[2]
        for turn, sim_turn in zip(answered, record.turns):
            assert turn.response_text == sim_turn.answer
            assert turn.id == sim_turn.turn_id
            assert turn.state == TurnState.JUDGEABLE  # paired with its next state: the user's reply
            assert turn.next_state == [{"role": "user", "content": sim_turn.reply}]
        assert closing.state == TurnState.DROPPED and closing.reason == "no_next_state"
        assert server.sessions.get(record.session_id) is None  # the session ended


def test_session_ended_through_the_endpoint_drops_only_the_last_turn(server):
    sim = Simulation(server.base_url, get_persona("inshort"), seed=1, max_tokens=8, end_mode="endpoint")
    record = sim.run_session(turns=2)
    stored = server.store.turns(session_id=record.session_id)
    assert [t.state for t in stored] == [TurnState.JUDGEABLE, TurnState.DROPPED]
    assert stored[1].reason == "no_next_state"
    assert server.sessions.get(record.session_id) is None


def test_evaluation_never_stores_a_trainable_turn(server):
    persona = get_persona("french")
    result = evaluate(server.base_url, persona, persona.heldout_questions[:3], max_tokens=8)
    assert result.n == 3 and all(item.answer is not None for item in result.items)
    assert server.store.turns() == []
    # Greedy: the same question gives the same answer.
    again = evaluate(server.base_url, persona, persona.heldout_questions[:3], max_tokens=8)
    assert [i.answer for i in again.items] == [i.answer for i in result.items]
