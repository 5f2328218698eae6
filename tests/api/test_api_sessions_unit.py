"""Session pairing rules and the session manager on a real SQLite store (no HTTP)."""

from __future__ import annotations

import asyncio
import time

import pytest

from clawloop.api.sessions import OwnerClosed, SessionManager, find_next_state, is_trimmed_echo, prefix_keys
from clawloop.openclaw_format import is_answer_retry, is_ephemeral
from clawloop.store import Store, TurnRecord, TurnState

U1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "5"}
U2 = {"role": "user", "content": "No, that is wrong. Try again."}
SYS = {"role": "system", "content": "You are terse."}


def test_next_state_is_everything_after_the_stored_answer():
    tool_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2+2"}'}}]}
    tool_result = {"role": "tool", "tool_call_id": "call_x", "content": "4"}
    # Client echoes the call with different whitespace in the arguments and a different id: still the same.
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "calc", "arguments": '{"e":"2+2"}'}}]}
    p = find_next_state([SYS, U1], tool_call, [SYS, U1, echoed, tool_result])
    assert (p.how, p.next_state) == ("prefix", [tool_result])
    p = find_next_state([U1], A1, [U1, {"role": "assistant", "content": " 5 \n"}, U2, U1])
    assert (p.how, p.next_state) == ("prefix", [U2, U1])


def test_answer_found_after_rewritten_history_regenerated_fallback_and_empty():
    new_sys = {"role": "system", "content": "Today is Tuesday."}
    p = find_next_state([SYS, U1], A1, [new_sys, U1, A1, U2])
    assert (p.how, p.next_state) == ("search", [U2])
    p = find_next_state([SYS, U1], A1, [SYS, U1])
    assert (p.how, p.next_state, p.drop_reason) == ("regenerated", None, "regenerated")
    other = {"role": "assistant", "content": "something else"}
    p = find_next_state([U1], A1, [U1, other, U2, {"role": "tool", "content": "x"}])
    assert (p.how, p.next_state) == ("fallback", [U2, {"role": "tool", "content": "x"}])
    p = find_next_state([U1], A1, [U1, A1])
    assert (p.next_state, p.drop_reason) == (None, "empty_next_state")


def test_prefix_keys_ignore_call_ids_and_outer_whitespace_but_not_text():
    a = prefix_keys([U1, {"role": "assistant", "content": "hi "}])
    b = prefix_keys([U1, {"role": "assistant", "content": "hi"}])
    c = prefix_keys([U1, {"role": "assistant", "content": "hi!"}])
    assert a == b and a[0] != c[0]
    assert prefix_keys([SYS, U1])[1] == prefix_keys([U1])[1] and prefix_keys([SYS, U1])[0] != prefix_keys([U1])[0]


RETRY = {"role": "user", "content": "The previous attempt did not produce a user-visible answer. Continue from the "
                                    "current state and produce the visible answer now. Do not restart from scratch."}


def test_an_answer_the_client_cut_in_the_middle_keeps_its_session(tmp_path):
    """OpenClaw's compaction cuts the middle out of a long answer it sends back and marks the cut with "…", which
    can fall inside a word: the conversation stays one session and the turn is paired. Pieces the model never
    wrote, or only a mark, continue nothing."""
    written = "Paris is the capital of France and its largest city, on the Seine, with about two million people."
    cut = {"role": "assistant", "content": "Paris is the capital of Fra\u2026 two million people."}
    assert is_trimmed_echo(cut, {"role": "assistant", "content": written})
    for other in ("Paris is the capital of Fra\u2026 three million people.", "two million people\u2026Paris is",
                  "\u2026"):
        assert not is_trimmed_echo({"role": "assistant", "content": other}, {"role": "assistant", "content": written})
    store = Store(tmp_path / "store.sqlite")

    async def scenario():
        m = SessionManager(store)
        sid, t1 = await _answered(m, written)
        ctx = await m.begin_main(None, [SYS, U1, cut, U2])
        assert (ctx.session_id, ctx.how, ctx.paired_turn_id) == (sid, "request", t1)
        ctx.release()

    asyncio.run(scenario())
    store.close()


def test_an_answer_the_client_sends_back_trimmed_keeps_its_session_and_nothing_else_does(tmp_path):
    """OpenClaw removes a <think> block or a reply tag from an answer before sending it back, which no envelope rule
    covers: the conversation stays one session and the turn is paired. An answer with words the model never wrote,
    or none, continues nothing by its request, so two conversations with the same opening never take each
    other's turns."""
    written = "Paris <think>the user wants a city</think> is the capital."
    trimmed = {"role": "assistant", "content": "Paris  is the capital."}
    assert is_trimmed_echo(trimmed, {"role": "assistant", "content": written})
    assert not is_trimmed_echo({"role": "assistant", "content": "Lyon is the capital."},
                               {"role": "assistant", "content": written})
    store = Store(tmp_path / "store.sqlite")

    async def scenario():
        m = SessionManager(store)
        sid, t1 = await _answered(m, written)
        ctx = await m.begin_main(None, [SYS, U1, trimmed, U2])
        assert (ctx.session_id, ctx.how, ctx.paired_turn_id) == (sid, "request", t1)
        t2 = await ctx.commit(_turn([SYS, U1, trimmed, U2], "Paris."))
        ctx.release()
        # Another conversation with the same opening and its own answer; one leaving the answer out; one whose
        # system prompt differs: each opens a session of its own, and the pending turn stays pending.
        for other in ([SYS, U1, trimmed, U2, {"role": "assistant", "content": "Lyon, I think."}, U1],
                      [SYS, U1, trimmed, U2, U1],
                      [{"role": "system", "content": "Other agent."}, U1, trimmed, U2,
                       {"role": "assistant", "content": "Paris"}, U1]):
            ctx = await m.begin_main(None, other)
            assert ctx.how == "new" and ctx.paired_turn_id is None, other
            ctx.release()
        assert m.pending_turn_id(sid) == t2
        ctx = await m.begin_main(None, [SYS, U1, trimmed, U2, {"role": "assistant", "content": "Paris"}, U1])
        assert (ctx.session_id, ctx.how, ctx.paired_turn_id) == (sid, "request", t2)
        ctx.release()
        # Two conversations that opened alike, each answered: an echo that fits both answers continues neither,
        # one that fits only its own continues its own, and a tool call echoed without its reasoning text too.
        hello = [SYS, {"role": "user", "content": "Hi"}]
        call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
        answers = ["<think>greet</think> Hello! How can I help you today?", "Hi there! How can I help you today?"]
        ids = []
        for text in answers:
            ctx = await m.begin_main(None, hello)
            await ctx.commit(_turn(hello, text))
            ctx.release()
            ids.append(ctx.session_id)
        short = {"role": "assistant", "content": "Hello! How can I help you today?"}
        ctx = await m.begin_main(None, hello + [{"role": "assistant", "content": "How can I help you today?"}, U1])
        assert ctx.how == "new"
        ctx.release()
        ctx = await m.begin_main(None, hello + [short, U1])
        assert (ctx.session_id, ctx.how) == (ids[0], "request")
        calling = _turn(hello + [short, U1], "<think>look</think>")
        calling.assistant_message["tool_calls"] = [call]
        await ctx.commit(calling)
        ctx.release()
        echo = {"role": "assistant", "content": "", "tool_calls": [dict(call, id="other")]}
        ctx = await m.begin_main(None, hello + [short, U1, echo, {"role": "tool", "content": "a.txt"}])
        assert (ctx.session_id, ctx.how) == (ids[0], "request")
        ctx.release()
        # A request of ephemeral messages only is stored and keyed without a request key of its own.
        ctx = await m.begin_main(None, [RETRY])
        await ctx.commit(_turn([RETRY], "Hello."))
        ctx.release()
        return t1, m.stats

    t1, stats = asyncio.run(scenario())
    assert store.get_turn(t1).state == TurnState.JUDGEABLE and store.get_turn(t1).next_state == [U2]
    assert stats["pairing_request"] == 4 and stats["turns_stored"] == 6
    assert asyncio.run(SessionManager(store).restore()) == 2  # the second greeting and the ephemeral-only one


def test_openclaw_asking_again_for_a_visible_answer_stays_in_the_session(tmp_path):
    """An answer that showed the user nothing (here NO_REPLY): OpenClaw asks again within the same turn with one more
    user message, and its next request holds the second answer only. One session; the unseen answer is dropped as
    regenerated, the second is paired with the user's next message."""
    assert is_answer_retry(RETRY) and is_ephemeral(RETRY)
    for wording in ("The previous assistant turn recorded reasoning but did not produce a user-visible answer. "
                    "Continue from that partial turn and produce the visible answer now.",
                    "The previous assistant turn completed its tool calls but did not produce a user-visible answer."):
        assert is_answer_retry({"role": "user", "content": wording})
    typed = {"role": "user", "content": "[Mon 2026-11-23 19:50 UTC] " + RETRY["content"]}
    assert not is_answer_retry(typed) and not is_answer_retry({"role": "assistant", "content": RETRY["content"]})
    store = Store(tmp_path / "store.sqlite")

    async def scenario():
        m = SessionManager(store)
        ctx = await m.begin_main(None, [SYS, U1])
        t1 = await ctx.commit(_turn([SYS, U1], "NO_REPLY"))
        ctx.release()
        ctx = await m.begin_main(None, [SYS, U1, RETRY])
        sid = ctx.session_id
        assert (ctx.how, ctx.paired_turn_id) == ("again", None) and m.get(sid).turn_index == 1
        t2 = await ctx.commit(_turn([SYS, U1, RETRY], "4"))
        ctx.release()
        ctx = await m.begin_main(None, [SYS, U1, {"role": "assistant", "content": "4"}, U2])
        assert (ctx.session_id, ctx.how, ctx.paired_turn_id) == (sid, "prefix", t2)
        ctx.release()
        # Without the retry message the same request again is another conversation, not a retry.
        ctx = await m.begin_main(None, [SYS, U1])
        assert ctx.how == "new"
        ctx.release()
        return t1, t2

    t1, t2 = asyncio.run(scenario())
    assert (store.get_turn(t1).state, store.get_turn(t1).reason) == (TurnState.DROPPED, "regenerated")
    assert store.get_turn(t2).next_state == [U2]


async def _answered(m, written):
    """A new session whose first turn answered ``U1`` with ``written``: (its id, the turn's id)."""
    ctx = await m.begin_main(None, [SYS, U1])
    turn_id = await ctx.commit(_turn([SYS, U1], written))
    ctx.release()
    return ctx.session_id, turn_id


def _turn(messages, answer_text):
    return TurnRecord(session_id="", messages=messages, prompt_ids=[1, 2, 3], response_ids=[7, 8],
                      logprobs=[-0.1, -0.2], temperature=1.0, top_p=1.0, policy_version=0,
                      response_text=answer_text, assistant_message={"role": "assistant", "content": answer_text})


def test_manager_pairs_restores_and_ends(tmp_path):
    store = Store(tmp_path / "store.sqlite")
    judgeable: list[int] = []

    async def scenario():
        m = SessionManager(store, on_judgeable=judgeable.append)
        ctx = await m.begin_main(None, [U1])
        assert ctx.how == "new" and ctx.paired_turn_id is None
        t1 = await ctx.commit(_turn([U1], "5"))
        ctx.release()
        sid = ctx.session_id
        # A stock client sends the history back: matched by prefix, the stored turn gets its next state.
        ctx = await m.begin_main(None, [U1, A1, U2])
        assert (ctx.session_id, ctx.how, ctx.paired_turn_id) == (sid, "prefix", t1)
        t2 = await ctx.commit(_turn([U1, A1, U2], "4"))
        ctx.release()
        return sid, t1, t2

    sid, t1, t2 = asyncio.run(scenario())
    assert judgeable == [t1]
    assert store.get_turn(t1).state == TurnState.JUDGEABLE and store.get_turn(t1).next_state == [U2]
    assert store.get_turn(t2).turn_index == 1

    async def after_restart():
        m = SessionManager(store)
        assert await m.restore() == 1
        history = [U1, A1, U2, {"role": "assistant", "content": "4"}, {"role": "user", "content": "thanks"}]
        ctx = await m.begin_main(None, history)
        assert (ctx.session_id, ctx.paired_turn_id) == (sid, t2)
        t3 = await ctx.commit(_turn(history, "bye"))
        ctx.release()
        known, dropped = await m.end(sid)
        assert (known, dropped) == (True, t3)
        assert await m.end(sid) == (False, None)
        return t3

    t3 = asyncio.run(after_restart())
    assert store.get_turn(t2).next_state == [{"role": "user", "content": "thanks"}]
    assert store.get_turn(t3).state == TurnState.DROPPED and store.get_turn(t3).reason == "no_next_state"


def test_lru_eviction_ends_the_least_recently_used_session(tmp_path):
    store = Store(tmp_path / "store.sqlite")

    async def scenario():
        m = SessionManager(store, max_sessions=2)
        ids = {}
        for name in ("a", "b", "c"):
            ctx = await m.begin_main(name, [{"role": "user", "content": name}])
            ids[name] = await ctx.commit(_turn([{"role": "user", "content": name}], name))
            ctx.release()
        assert m.get("a") is None and m.get("b") is not None and m.get("c") is not None
        return ids

    ids = asyncio.run(scenario())
    assert store.get_turn(ids["a"]).reason == "no_next_state"
    assert store.get_turn(ids["b"]).state == TurnState.AWAITING_NEXT


def test_a_request_on_its_way_when_a_forget_begins_stores_nothing(tmp_path):
    """A request past the route's check (reading its body, rendering its template) when the user's forget begins:
    the forget does not wait for it (a body sent slowly would hold every forget up), and the request is refused
    when it reaches its session, during the forget or after it, so no turn of the user is stored after their
    records were deleted."""
    owner = "k_" + "a" * 24
    store = Store(tmp_path / "store.sqlite")

    async def scenario() -> None:
        sm = SessionManager(store)
        during = sm.arrival(owner)
        after = sm.arrival(owner)
        async with sm.owner_closed(owner) as ended:  # entered at once: nothing on its way is waited for
            assert ended == 0 and sm.is_closed(owner)
            with pytest.raises(OwnerClosed):
                await sm.begin_main("s1", [U1], owner=owner, arrived=during)
        assert not sm.is_closed(owner)
        with pytest.raises(OwnerClosed):  # its body arrived only once the forget was over
            await sm.begin_main("s2", [U1], owner=owner, arrived=after)
        assert sm.live_count(owner) == 0
        ctx = await sm.begin_main("s3", [U1], owner=owner, arrived=sm.arrival(owner))  # a new request is served
        ctx.release()

    asyncio.run(scenario())
    assert [t for t in store.turns() if t.owner == owner] == []


def test_a_turn_whose_client_left_while_it_was_written_is_dropped_not_left_waiting(tmp_path):
    """The stream is cancelled (the client disconnected) while its turn is in the store's write: the write
    finishes in its thread, and the turn, whose answer never reached the client, is dropped with that reason
    rather than left awaiting a next state with no session to bring one."""
    class BusyStore(Store):
        def add_turn(self, turn):
            time.sleep(0.3)  # another writer holds the file
            return super().add_turn(turn)

    store = BusyStore(tmp_path / "store.sqlite")

    async def scenario() -> None:
        sm = SessionManager(store)
        ctx = await sm.begin_main(None, [U1], owner="k_a")
        turn = TurnRecord(session_id="", messages=[U1], prompt_ids=[1], response_ids=[2], logprobs=[-1.0],
                          temperature=1.0, top_p=1.0, policy_version=0, assistant_message=A1)
        commit = asyncio.ensure_future(ctx.commit(turn))
        await asyncio.sleep(0.05)
        commit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await commit
        ctx.release()
        await sm.stop()  # waits for the write and the drop
        assert len(sm) == 0

    asyncio.run(scenario())
    assert [(t.state, t.reason) for t in store.turns()] == [(TurnState.DROPPED, "client_closed_request")]


def test_the_idle_sweep_passes_a_session_a_request_took_meanwhile(tmp_path):
    """The sweep lists idle sessions, then ends them one after another; a session a request takes in between (a
    stream its client may hold open for long) is busy, not idle: the sweep goes on without waiting for it."""
    store = Store(tmp_path / "store.sqlite")
    now = [0.0]

    async def scenario():
        m = SessionManager(store, idle_timeout_s=10.0, clock=lambda: now[0])
        first, _ = await _answered(m, "The first answer.")
        second, _ = await _answered(m, "The second answer.")
        now[0] = 100.0
        end_locked = m._end_locked
        taken = []

        async def end_then_a_request_arrives(s, why):
            if not taken:  # while the first one is ended, a request takes the other one
                other = m.get(second if s.id == first else first)
                await other.lock.acquire()
                taken.append(other)
            return await end_locked(s, why)

        m._end_locked = end_then_a_request_arrives
        assert await asyncio.wait_for(m.sweep_idle(), 10) == 1
        assert taken[0].lock.locked() and not taken[0].ended
        taken[0].lock.release()

    asyncio.run(scenario())
    store.close()
