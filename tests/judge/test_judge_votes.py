"""Judge prompts and one turn's votes, over a real local HTTP judge."""

import asyncio
import threading

from clawloop.judge.client import HTTPJudgeClient
from clawloop.judge.prompts import build_messages, flatten_messages
from clawloop.judge.scripted import Hang, ScriptedJudgeServer
from clawloop.judge.votes import Judge, JudgeSettings
from clawloop.store import TurnRecord

REQUEST = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "user", "content": "And in Lyon? Give it in Fahrenheit."},
]
NEXT_STATE = [
    {"role": "user", "content": "No, I asked for Fahrenheit, not Celsius."},
]


def make_turn(next_state=NEXT_STATE, answer="It is 20C in Lyon.") -> TurnRecord:
    return TurnRecord(session_id="s", messages=REQUEST, prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-1, -1],
                      temperature=0.6, top_p=1.0, policy_version=0, response_text=answer,
                      assistant_message={"role": "assistant", "content": answer}, next_state=next_state, id=7)


# ---- prompts --------------------------------------------------------------------------------------------

def test_context_modes():
    def user_text(mode):
        msgs = build_messages("eval", request_messages=REQUEST, answer="A", next_state=NEXT_STATE,
                              judge_context=mode)
        assert msgs[0]["role"] == "system" and "\\boxed{-1}" in msgs[0]["content"]
        return msgs[1]["content"]

    none, last, full = user_text("none"), user_text("last_user"), user_text("full")
    assert "Lyon" not in none and "## User request" not in none
    assert "## User request\nAnd in Lyon? Give it in Fahrenheit." in last and "Paris" not in last
    assert "[role: tool]\n18C, sunny" in full and "[tool call] weather" in full and "Paris" in full
    for text in (none, last, full):
        assert "## Assistant answer\nA" in text
        assert "[role: user]\nNo, I asked for Fahrenheit" in text


def test_next_state_keeps_every_message_and_role():
    next_state = [
        {"role": "tool", "name": "run_tests", "content": "2 failed"},
        {"role": "tool", "content": [{"type": "text", "text": "log: "}, {"type": "text", "text": "AssertionError"}]},
        {"role": "user", "content": "Fix the failing tests."},
    ]
    text = flatten_messages(next_state)
    assert text == ("[role: tool (run_tests)]\n2 failed\n\n[role: tool]\nlog: AssertionError\n\n"
                    "[role: user]\nFix the failing tests.")
    hint_msgs = build_messages("hint", request_messages=REQUEST, answer="A", next_state=next_state)
    assert "[HINT_START]" in hint_msgs[0]["content"]
    assert "## Next state (step t+1)\n" + text in hint_msgs[1]["content"]


def test_long_sections_are_clipped_keeping_both_ends():
    answer = "BEGIN " + "x" * 10000 + " END"
    msgs = build_messages("eval", request_messages=REQUEST, answer=answer, next_state=NEXT_STATE,
                          max_answer_chars=500)
    body = msgs[1]["content"]
    assert "BEGIN" in body and "END" in body and len(body) < 2000


# ---- votes ----------------------------------------------------------------------------------------------

def scripted(body):
    system = body["messages"][0]["content"]
    if "[HINT_START]" in system:  # hint prompt
        return "The user wanted Fahrenheit.\n\\boxed{1}\n[HINT_START]Give temperatures in Fahrenheit.[HINT_END]"
    return "The user asks for a change. \\boxed{-1}"


def test_judge_runs_all_votes_concurrently_and_records_them():
    gate = threading.Barrier(6, timeout=10)  # all 6 calls must be in flight together to get past it

    def together(body):
        gate.wait()
        return scripted(body)

    with ScriptedJudgeServer(together) as server:
        async def go():
            client = HTTPJudgeClient(server.url, "m", timeout_s=20, retries=0, concurrency=8)
            judge = Judge(client, JudgeSettings(votes_m=3, max_tokens=64))
            seen = []
            out = await judge.judge(make_turn(), attempt=2, on_vote=seen.append)
            await client.close()
            return out, seen

        out, seen = asyncio.run(go())
    assert out.reward == -1
    assert out.candidates == ["Give temperatures in Fahrenheit."]
    assert len(seen) == 6 and all(v.attempt == 2 and v.turn_id == 7 for v in seen)
    assert [v.index for v in out.eval_votes] == [0, 1, 2]
    assert all(v.score == 1 and v.hint == "Give temperatures in Fahrenheit." for v in out.hint_votes)
    assert all("\\boxed" in v.raw_text for v in seen)
    assert server.requests[0]["max_tokens"] == 64


def test_skipped_kinds_make_no_calls():
    with ScriptedJudgeServer(scripted) as server:
        async def go():
            client = HTTPJudgeClient(server.url, "m", timeout_s=5, retries=0)
            judge = Judge(client, JudgeSettings(votes_m=2))
            return await judge.judge(make_turn(), want_eval=False, want_hints=True)

        out = asyncio.run(go())
    assert out.eval_votes == [] and out.reward == 0 and len(out.hint_votes) == 2
    assert len(server.requests) == 2


def test_deadline_turns_running_votes_into_invalid_ones():
    def half_hang(body):
        if "[HINT_START]" in body["messages"][0]["content"]:
            return Hang(30)
        return "\\boxed{1}"

    with ScriptedJudgeServer(half_hang) as server:
        async def go():
            client = HTTPJudgeClient(server.url, "m", timeout_s=30, retries=0)
            judge = Judge(client, JudgeSettings(votes_m=2))
            seen = []
            out = await judge.judge(make_turn(), deadline_s=0.5, on_vote=seen.append)
            await client.close()
            return out, seen

        out, seen = asyncio.run(go())
    assert out.reward == 1 and out.candidates == []
    assert len(seen) == 4
    assert all(v.score is None and "deadline" in v.error for v in out.hint_votes)
