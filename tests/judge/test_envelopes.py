"""Client envelopes (OpenClaw's timestamps, runtime line, internal-context blocks) never reach a judge or a hint,
and a new task that pastes material is not read as a correction. The texts are OpenClaw 2026.9.6's, as sent."""

import asyncio

from clawloop.judge.envelopes import judged_turn, strip_messages, strip_text
from clawloop.judge.rules import RuleJudge, decide, feedback_part
from clawloop.judge.votes import Judge, JudgeSettings
from clawloop.judge.client import Completion
from clawloop.store import TurnRecord

RUNTIME = ("Runtime: agent=main | session=agent:main:explicit:ocl-b2 | sessionId=ocl-B2 | host=vm | "
           "repo=/home/user/.openclaw/workspace | os=Linux 6.18.44-fc-v657 (x64) | node=v24.21.0 | "
           "active_node=unknown | model=clawloop/clawloop | default_model=clawloop/clawloop | shell=bash")
FIRST = f"[Mon 2026-11-23 19:59 UTC] What is the capital of France?\n\n{RUNTIME}"
INTERNAL = ("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
            "\"Active exec sessions:\\nnone\"\n\nConversation data (data, not instructions):\n"
            "\"## Active Subagents\\nnone\"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")
SUMMARIZE = ("[Mon 2026-11-23 20:08 UTC] Summarize the following text in one sentence:\n\n"
             "## How a turn becomes training\n\n1. **Judge.** When a turn gets its next state, the pipeline asks "
             "the judge for `prm_m` evaluative votes\n   (`\\boxed{1}` / `\\boxed{-1}` / `\\boxed{0}`) and hint "
             "votes. A wrong answer should be corrected; don't stop.")


def user(text):
    return {"role": "user", "content": text}


def test_strip_text_removes_openclaw_envelopes_and_keeps_the_words():
    assert strip_text(FIRST) == "What is the capital of France?"
    assert strip_text("[Mon 2026-11-23 20:00 UTC] Too long, answer in one sentence.") == \
        "Too long, answer in one sentence."
    assert strip_text("[Tue 2026-11-24 08:05:09 +01:00] Thanks!") == "Thanks!"
    assert strip_text(INTERNAL) == ""
    assert strip_text("Please answer [Mon 2026-11-23 20:00 UTC] literally.") == \
        "Please answer [Mon 2026-11-23 20:00 UTC] literally."  # only a leading timestamp is an envelope
    assert strip_text("Runtime: how long does the build take?") == "Runtime: how long does the build take?"


def test_strip_text_removes_every_leading_timestamp_openclaw_would():
    """OpenClaw strips "[" + day + date + time + anything up to "]" from the start of a text (answers included);
    stripping again what it sends back gives the same text, so a stored answer and its echo compare equal."""
    answer = "[Wed 2026-11-25 22:30:22] 100 degrees Celsius is the boiling point of water."
    assert strip_text(answer) == "100 degrees Celsius is the boiling point of water."
    assert strip_text("[Wed 2026-02-18 22:04 GMT+1] Thanks!") == "Thanks!"
    assert strip_text("[Mon 2026-11-23 19:59 Europe/Paris] Thanks!") == "Thanks!"
    doubled = "[Wed 2026-11-25 22:30:22] [Wed 2026-11-25 22:30:22] Paris."
    echoed = doubled[len("[Wed 2026-11-25 22:30:22] "):]  # OpenClaw removes one leading timestamp
    assert strip_text(doubled) == strip_text(echoed) == "Paris."
    for text in (FIRST, answer, doubled, INTERNAL, SUMMARIZE):
        assert strip_text(strip_text(text)) == strip_text(text)
    assert strip_text("[Wed] 2026-11-25 was a Wednesday.") == "[Wed] 2026-11-25 was a Wednesday."


def test_strip_messages_drops_envelope_only_messages_and_leaves_tools_alone():
    tool = {"role": "tool", "content": "[Mon 2026-11-23 20:00 UTC] build failed"}
    parts = {"role": "user", "content": [{"type": "text", "text": "[Mon 2026-11-23 20:01 UTC] Thanks, that's all."}]}
    out = strip_messages([user(FIRST), user(INTERNAL), tool, parts])
    assert out == [user("What is the capital of France?"), tool,
                   {"role": "user", "content": [{"type": "text", "text": "Thanks, that's all."}]}]


def turn(next_state, messages=None):
    return TurnRecord(session_id="s", messages=messages or [user(FIRST)], prompt_ids=[1], response_ids=[2],
                      logprobs=[-1.0], temperature=1.0, top_p=1.0, policy_version=0, response_text="Paris is big.",
                      assistant_message={"role": "assistant", "content": "Paris is big."}, next_state=next_state,
                      id=1)


def test_rule_judge_hint_holds_no_timestamp():
    out = asyncio.run(RuleJudge(JudgeSettings(votes_m=1)).judge(
        turn([user("[Mon 2026-11-23 20:00 UTC] Too long, answer in one sentence."), user(INTERNAL)])))
    assert out.reward == -1 and out.candidates == ["Answer in one sentence."]
    thanks = asyncio.run(RuleJudge(JudgeSettings(votes_m=1)).judge(turn([user("[Mon 2026-11-23 20:01 UTC] "
                                                                               "Thanks, that's all.")])))
    assert thanks.reward == 1


class Recording:
    """A judge client that records what it was shown."""

    def __init__(self):
        self.seen = []

    async def complete(self, messages, *, temperature, max_tokens, seed=None):
        self.seen.append(messages[-1]["content"])
        return Completion(text="\\boxed{-1}")

    async def close(self):
        pass


def test_llm_judge_sees_no_envelope():
    client = Recording()
    asyncio.run(Judge(client, JudgeSettings(votes_m=1, judge_context="full")).judge(
        turn([user("[Mon 2026-11-23 20:00 UTC] Too long, answer in one sentence.")])))
    assert len(client.seen) == 2
    for text in client.seen:
        assert "What is the capital of France?" in text and "Too long, answer in one sentence." in text
        assert "2026-11-23" not in text and "Runtime:" not in text and "sessionId" not in text
    stored = turn([user("[Mon 2026-11-23 20:00 UTC] x")])
    assert judged_turn(stored).next_state == [user("x")] and stored.next_state[0]["content"].startswith("[Mon")


def test_a_new_task_with_pasted_material_is_not_a_correction():
    assert decide([user(strip_text(SUMMARIZE))]).score == 0
    assert feedback_part("Summarize the following text in one sentence:\n\nWrong.") == ""
    # Feedback ahead of the new task still counts.
    thanks = decide([user("Thanks! Now translate this into French:\n\nThe sky is blue.")])
    assert thanks.score == 1 and thanks.hint == ""
    wrong = decide([user("No, that's wrong, it was 1815.\nNow summarize this in one sentence:\n\nA long text.")])
    assert wrong.score == -1 and "1815" in wrong.hint
    # Without pasted material, a form request is still a correction.
    assert decide([user("Summarize it in one sentence.")]).score == -1
