"""Structured output against a real local HTTP endpoint (one that enforces response_format, one that rejects it,
one that takes vLLM's regex), and timed-out votes tried again only while the turn's deadline leaves time."""

import asyncio
import json
import threading

import pytest

from clawloop.config import Config
from clawloop.judge.client import HTTPJudgeClient
from clawloop.judge.scripted import Hang, ScriptedJudgeServer, Status
from clawloop.judge.parse import parse_eval, parse_hint
from clawloop.judge.structured import REGEXES, SCHEMAS, as_vote_text
from clawloop.judge.votes import Judge, JudgeSettings
from clawloop.judge.factory import build_judge
from clawloop.store import TurnRecord


def turn(reply="Too long. Answer in one sentence, please."):
    return TurnRecord(session_id="s", messages=[{"role": "user", "content": "Why is the sky blue?"}],
                      prompt_ids=[1], response_ids=[2], logprobs=[-1.0], temperature=1.0, top_p=1.0,
                      policy_version=0, response_text="Because of physics, which is a long story ...",
                      assistant_message={"role": "assistant", "content": "Because of physics ..."},
                      next_state=[{"role": "user", "content": reply}], id=7)


def is_hint_request(body):
    return "[HINT_START]" in body["messages"][0]["content"]


def enforcing(body):
    """Answers in the schema's JSON when asked for it, and with unparseable prose otherwise."""
    rf = body.get("response_format")
    if not rf:
        return "The answer seems too long, I would say it is bad."
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True
    schema = rf["json_schema"]["schema"]
    if is_hint_request(body):
        assert schema == SCHEMAS["hint"]
        return json.dumps({"reason": "The user wants brevity.", "decision": 1, "hint": "Answer in one sentence."})
    assert schema == SCHEMAS["eval"]
    return json.dumps({"reason": "The user asks for a change.", "score": -1})


def judge_for(server, **kw):
    client = HTTPJudgeClient(server.url, "m", timeout_s=10, retries=0, **kw)
    return Judge(client, JudgeSettings(votes_m=2))


def judge_turns(judge, n=1, **kw):
    """Judge ``n`` turns one after another on one event loop (the HTTP client lives on it), then close."""
    async def main():
        try:
            return [await judge.judge(turn(), **kw) for _ in range(n)]
        finally:
            await judge.client.close()

    return asyncio.run(main())


def test_a_json_schema_endpoint_gives_valid_votes():
    with ScriptedJudgeServer(enforcing) as server:
        judge = judge_for(server)
        [out] = judge_turns(judge)
    assert out.reward == -1 and out.candidates == ["Answer in one sentence."]
    assert all(v.score is not None for v in out.eval_votes + out.hint_votes)
    assert out.eval_votes[0].raw_text.endswith("\\boxed{-1}")
    assert all("response_format" in body for body in server.requests) and len(server.requests) == 4


def test_an_endpoint_that_rejects_response_format_is_asked_plainly_from_then_on():
    def rejecting(body):
        if "response_format" in body:
            return Status(400, "response_format is not supported by this server")
        return ("Change request. \\boxed{1} [HINT_START]Answer in one sentence.[HINT_END]" if is_hint_request(body)
                else "The user asks for a change. \\boxed{-1}")

    with ScriptedJudgeServer(rejecting) as server:
        judge = judge_for(server)
        first, second = judge_turns(judge, 2)
        rejected = sum("response_format" in b for b in server.requests)
    for out in (first, second):
        assert out.reward == -1 and out.candidates == ["Answer in one sentence."]
        assert all(v.score is not None for v in out.eval_votes + out.hint_votes)
    assert 1 <= rejected <= 4 and judge.client.structured == "off"  # at most the first turn's calls in flight
    assert not any("response_format" in b for b in server.requests[-4:])  # never sent again


def test_regex_mode_and_a_callers_own_constraint():
    seen = []

    def regex(body):
        seen.append(body)
        return "\\boxed{-1}" if not is_hint_request(body) else "\\boxed{1} [HINT_START]Answer briefly.[HINT_END]"

    with ScriptedJudgeServer(regex) as server:
        judge = judge_for(server, structured="regex")
        [out] = judge_turns(judge)
        assert out.reward == -1 and all("structured_outputs" in b and "regex" in b["structured_outputs"] for b in seen)
        seen.clear()
        own = {"structured_outputs": {"regex": "x"}}
        judge = judge_for(server, extra_body=own)
        judge_turns(judge)
    assert judge.client.structured == "off"
    assert all(b["structured_outputs"] == {"regex": "x"} and "response_format" not in b for b in seen)


def test_forced_json_schema_on_a_rejecting_endpoint_is_an_invalid_vote_not_a_hang():
    with ScriptedJudgeServer(lambda body: Status(400, "no") if "response_format" in body else "\\boxed{1}") as server:
        judge = judge_for(server, structured="json_schema")
        [out] = judge_turns(judge, want_hints=False)
    assert all(v.score is None and "structured output" in v.error for v in out.eval_votes)


def test_the_regexes_admit_exactly_parseable_votes():
    import re

    good_eval, good_hint = "The user thanks. \\boxed{1}", "Yes. \\boxed{1} [HINT_START]Answer in French.[HINT_END]"
    assert re.fullmatch(REGEXES["eval"], good_eval) and parse_eval(good_eval).score == 1
    assert re.fullmatch(REGEXES["hint"], good_hint) and parse_hint(good_hint).hint == "Answer in French."
    assert re.fullmatch(REGEXES["hint"], "No. \\boxed{-1}")
    for bad in ("no vote", "\\boxed{2}", "\\boxed{1} [HINT_START]cut off"):
        assert not re.fullmatch(REGEXES["eval"], bad)
        assert not re.fullmatch(REGEXES["hint"], bad)
    assert "{0," not in REGEXES["eval"] + REGEXES["hint"]  # no counted repeats


def test_as_vote_text_and_config():
    assert as_vote_text("eval", '{"reason": "ok", "score": 0}') == "ok\n\\boxed{0}"
    assert as_vote_text("hint", '{"reason": "", "decision": -1, "hint": "x"}') == "\\boxed{-1}"
    assert as_vote_text("eval", "plain \\boxed{1}") == "plain \\boxed{1}"
    config = Config.load(env={}, judge_url="http://127.0.0.1:9/v1", judge_structured_output="regex")
    assert build_judge(config).client.structured == "regex"
    with pytest.raises(Exception, match="judge_structured_output"):
        Config.load(env={}, judge_structured_output="grammar")


@pytest.mark.parametrize("kind, content", [
    ("eval", '{"reason": "\\\\boxed{1} would fit, but they rephrased", "score": "-1"}'),
    ("eval", '{"reason": "\\\\boxed{-1}", "score": true}'),
    ("eval", '{"reason": "no score at all \\\\boxed{0}"}'),
    ("hint", '{"reason": "\\\\boxed{1} [HINT_START]Be brief.[HINT_END]", "decision": "1", "hint": "x"}'),
])
def test_a_json_vote_that_breaks_the_schema_is_invalid_whatever_its_reason_quotes(kind, content):
    """An endpoint that ignores strict mode may answer a string score; the reason may quote a box. Read as raw
    text, that box would be taken as the vote, possibly the opposite one; the vote is invalid instead."""
    text = as_vote_text(kind, content)
    parsed = (parse_eval if kind == "eval" else parse_hint)(text)
    assert parsed.score is None and parsed.error


def hang_first(n):
    """A responder whose first ``n`` requests hang (time out at the client); later ones answer."""
    lock, count = threading.Lock(), [0]

    def respond(body):
        with lock:
            count[0] += 1
            mine = count[0]
        if mine <= n:
            return Hang(5)
        return "\\boxed{1} [HINT_START]Answer in one sentence.[HINT_END]" if is_hint_request(body) else "\\boxed{-1}"

    return respond


def test_a_timed_out_vote_is_tried_again_while_the_deadline_leaves_time():
    with ScriptedJudgeServer(hang_first(4)) as server:
        client = HTTPJudgeClient(server.url, "m", timeout_s=0.5, retries=0, structured="off")
        judge = Judge(client, JudgeSettings(votes_m=2, timeout_retries=1, min_retry_s=1.0))
        [out] = judge_turns(judge, deadline_s=20)
    assert len(server.requests) == 8  # every vote timed out once and was asked again
    assert out.reward == -1 and out.candidates == ["Answer in one sentence."]
    assert all(v.score is not None for v in out.eval_votes + out.hint_votes)


def test_no_retry_when_the_deadline_leaves_too_little_time():
    with ScriptedJudgeServer(hang_first(100)) as server:
        client = HTTPJudgeClient(server.url, "m", timeout_s=0.5, retries=0, structured="off")
        judge = Judge(client, JudgeSettings(votes_m=2, timeout_retries=3, min_retry_s=5.0))
        [out] = judge_turns(judge, deadline_s=3)
    assert len(server.requests) == 4  # one try each: 2.5 s left < 5 s needed for another
    assert all(v.score is None and "timed out" in v.error for v in out.eval_votes + out.hint_votes)
