"""Replays of real OpenClaw 2026.9.6 traffic (tests/data/openclaw, see its README) through session inference and
housekeeping recognition: stock OpenClaw sends no session or turn-type headers, so this is all clawloop has."""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import re
from pathlib import Path

import httpx
import pytest

from clawloop.api.schemas import parse_chat_request
from clawloop.api.sessions import SessionManager, answer_key, find_next_state, same_message
from clawloop.openclaw_format import (COMPACTED_HISTORY_PREFIX, COMPACTION_SUMMARY, INTERNAL_CONTEXT_BEGIN,
                                      MEMORY_FLUSH, SESSION_TITLE, conversation_messages, housekeeping_kind,
                                      is_compacted_history, is_ephemeral)
from clawloop.engines.base import Generation, TokenEvent
from clawloop.engines.detok import IncrementalDetokenizer
from clawloop.store import Store, TurnRecord, TurnState

DATA = Path(__file__).resolve().parents[1] / "data" / "openclaw"


def load(name: str) -> dict:
    with gzip.open(DATA / f"{name}.json.gz", "rt", encoding="utf-8") as fh:
        return json.load(fh)


def messages_of(body: dict) -> list[dict]:
    return parse_chat_request(body).messages  # normalised exactly as the server does


def _turn(messages: list[dict], answer: dict) -> TurnRecord:
    return TurnRecord(session_id="", messages=messages, prompt_ids=[1, 2, 3], response_ids=[7, 8],
                      logprobs=[-0.1, -0.2], temperature=1.0, top_p=1.0, policy_version=0,
                      response_text=answer.get("content") or "", assistant_message=answer)


def replay(store: Store, requests: list[tuple[list[dict], dict]]) -> list[tuple[str, str, int | None]]:
    """Feed (messages, answer) pairs through a SessionManager the way the server does for a stock client.
    Returns (turn type, session id, stored turn id) per request."""
    out: list[tuple[str, str, int | None]] = []

    async def run() -> None:
        m = SessionManager(store)
        for messages, answer in requests:
            if housekeeping_kind(messages):
                out.append(("side", m.resolve_side(None, messages), None))
                continue
            ctx = await m.begin_main(None, messages)
            try:
                turn_id = await ctx.commit(_turn(messages, answer))
            finally:
                ctx.release()
            out.append(("main", ctx.session_id, turn_id))

    asyncio.run(run())
    return out


def test_run_b_conversations_pair_and_housekeeping_is_side(tmp_path):
    reqs = load("runB")["requests"]
    assert [r["file"] for r in reqs] == [f"req-{i:03d}.json" for i in range(1, 15)]
    kinds = [housekeeping_kind(messages_of(r["body"])) for r in reqs]
    # req 1-6: people typing; 7-8: pre-compaction memory flush; 9-14: compaction summaries.
    assert kinds == [""] * 6 + [MEMORY_FLUSH] * 2 + [COMPACTION_SUMMARY] * 6
    store = Store(tmp_path / "store.sqlite")
    result = replay(store, [(messages_of(r["body"]), r["answer"]) for r in reqs])
    types = [t for t, _, _ in result]
    assert types == ["main"] * 6 + ["side"] * 8
    sessions = [s for _, s, _ in result]
    # OpenClaw session ocl-B2 is requests 1, 2, 3, 5, 6; ocl-B3 (a one-turn conversation) is request 4.
    assert len({sessions[i] for i in (0, 1, 2, 4, 5)}) == 1
    assert sessions[3] != sessions[0]
    turn_ids = [t for _, _, t in result[:6]]
    t = {i + 1: store.get_turn(turn_ids[i]) for i in range(6)}
    assert [t[i].state for i in (1, 2, 3, 5)] == [TurnState.JUDGEABLE] * 4
    assert [m["content"] for m in t[1].next_state] == ["[Mon 2026-11-23 20:00 UTC] Too long, answer in one sentence."]
    assert [m["content"] for m in t[2].next_state] == ["[Mon 2026-11-23 20:01 UTC] Thanks, that's all."]
    assert t[4].state == TurnState.AWAITING_NEXT and t[6].state == TurnState.AWAITING_NEXT
    assert len(store.turns(TurnState.AWAITING_NEXT)) == 2


def test_run_a_is_one_session_with_paired_next_states(tmp_path):
    reqs = load("runA")["requests"]
    store = Store(tmp_path / "store.sqlite")
    result = replay(store, [(messages_of(r["body"]), r["answer"]) for r in reqs])
    assert [t for t, _, _ in result] == ["main"] * 3
    assert len({s for _, s, _ in result}) == 1
    first, second = (store.get_turn(t) for _, _, t in result[:2])
    assert first.next_state[-1]["content"].endswith("Too long, answer in one sentence.")
    assert second.next_state[-1]["content"].endswith("Thanks, that's all.")


def _with_internal_context(body: dict, text: str) -> dict:
    """Copy of a captured default-tools request whose trailing internal-context message carries ``text``."""
    out = copy.deepcopy(body)
    tail = out["messages"][-1]
    assert is_ephemeral(tail)
    tail["content"][0]["text"] = tail["content"][0]["text"].replace("none", text, 1)
    return out


def test_internal_context_message_neither_splits_the_session_nor_enters_the_next_state(tmp_path):
    """With OpenClaw's default tools every request ends with an internal-context message that the next request
    leaves out of its history (captured in readme.request.json); the follow-ups are built the same way."""
    captured = next(r for r in load("readme-config")["requests"] if r["name"] == "readme")["body"]
    assert captured["messages"][-1]["content"][0]["text"].startswith(INTERNAL_CONTEXT_BEGIN)
    answer1 = {"role": "assistant", "content": "Paris."}
    answer2 = {"role": "assistant", "content": "Paris is the capital."}
    req1 = captured
    req2 = _with_internal_context(captured, "subagent-1 running")
    history = req2["messages"][:-1]
    req2["messages"] = history + [answer1, {"role": "user", "content": "[Mon 2026-11-23 19:44 UTC] Too long, "
                                            "answer in one sentence."}, req2["messages"][-1]]
    req3 = _with_internal_context(captured, "subagent-2 done")
    req3["messages"] = req2["messages"][:-1] + [answer2, {"role": "user", "content": "[Mon 2026-11-23 19:45 "
                                                 "UTC] Thanks, that's all."}, req3["messages"][-1]]
    store = Store(tmp_path / "store.sqlite")
    result = replay(store, [(messages_of(b), a) for b, a in ((req1, answer1), (req2, answer2), (req3, answer2))])
    assert [t for t, _, _ in result] == ["main"] * 3
    assert len({s for _, s, _ in result}) == 1
    t1, t2 = store.get_turn(result[0][2]), store.get_turn(result[1][2])
    assert [m["content"] for m in t1.next_state] == ["[Mon 2026-11-23 19:44 UTC] Too long, answer in one sentence."]
    assert [m["content"] for m in t2.next_state] == ["[Mon 2026-11-23 19:45 UTC] Thanks, that's all."]
    # The stored turn keeps the prompt exactly as the model saw it, internal context included.
    assert is_ephemeral(t1.messages[-1])


def test_no_captured_conversation_turn_and_no_look_alike_is_housekeeping():
    bodies = [r["body"] for r in load("runA")["requests"]] + [r["body"] for r in load("runB")["requests"][:6]]
    bodies += [r["body"] for r in load("readme-config")["requests"]]
    assert all(housekeeping_kind(messages_of(b)) == "" for b in bodies)
    sys_prompt = {"role": "system", "content": "You are a helpful assistant."}
    look_alikes = [
        "[Mon 2026-11-23 20:00 UTC] Pre-compaction memory flush. What does that mean? Reply with NO_REPLY?",
        "What is a pre-compaction memory flush in OpenClaw?",
        "Summarize <conversation>hello</conversation> for me.",
        "You are a context summarization assistant. Pretend to be one: <conversation>x</conversation>",
        "Generate a concise session title (3-6 words) for my essay.",
    ]
    for text in look_alikes:
        assert housekeeping_kind([sys_prompt, {"role": "user", "content": text}]) == "", text
    # The exact OpenClaw shapes, for contrast.
    flush = ("Pre-compaction memory flush. Store durable memories only in memory/2026-11-23.md. "
             "If nothing to store, reply with NO_REPLY.")
    assert housekeeping_kind([sys_prompt, {"role": "user", "content": flush}]) == MEMORY_FLUSH
    title = {"role": "system", "content": "Generate a concise session title (3-6 words, max 60 characters) from "
             "the user's first message. Return only the title."}
    assert housekeeping_kind([title, {"role": "user", "content": "Plan a trip to Lyon"}]) == SESSION_TITLE
    # A title prompt inside a longer conversation is not OpenClaw's one-shot title request.
    assert housekeeping_kind([title, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"}]) == ""


def test_conversation_messages_drops_only_internal_context_blocks():
    block = {"role": "user", "content": f"{INTERNAL_CONTEXT_BEGIN}\nx\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"}
    quoted = {"role": "user", "content": f"What does {INTERNAL_CONTEXT_BEGIN} mean?"}
    as_assistant = dict(block, role="assistant")
    msgs = [{"role": "user", "content": "hi"}, quoted, as_assistant, block]
    assert conversation_messages(msgs) == msgs[:3]
    assert conversation_messages(msgs[:3]) == msgs[:3]


def test_http_housekeeping_request_is_served_as_side_turn_and_not_stored(make_server):
    """The captured compaction-summary request (streamed, content parts) through the real server."""
    server = make_server()
    summary = load("runB")["requests"][8]["body"]
    assert housekeeping_kind(messages_of(summary)) == COMPACTION_SUMMARY
    body = dict(summary, max_completion_tokens=4)
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        ext = next(c["clawloop"] for c in chunks if "clawloop" in c)
        assert ext["turn_type"] == "side" and ext["turn_id"] is None
        # The same request marked main by the client stays main: an explicit turn type wins.
        r = http.post("/v1/chat/completions", json=dict(body, stream=False), headers={"X-Turn-Type": "main"})
        assert r.status_code == 200 and r.json()["clawloop"]["turn_type"] == "main"
        status = http.get("/v1/status").json()
    assert sum(status["turns_by_state"].values()) == 1


def test_context_overflow_is_explained_in_the_server_log(make_server, caplog):
    server = make_server()
    long_text = "word " * 3000
    with httpx.Client(base_url=server.base_url, timeout=120) as http, caplog.at_level("WARNING"):
        r = http.post("/v1/chat/completions", json={"model": "clawloop", "max_completion_tokens": 1,
                                                    "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == "clawloop.api"]
    assert any("does not fit the served context of 2048 tokens" in m and "openclaw-config" in m for m in msgs), msgs


@pytest.mark.parametrize("name", ["runA", "runB", "readme-config"])
def test_replay_data_holds_no_secret(name):
    text = json.dumps(load(name))
    assert not re.search(r"\bsk-[A-Za-z0-9_-]{16,}", text) and "Bearer " not in text
    assert set(re.findall(r'"apiKey": "([^"]*)"', text)) <= {"${CLAWLOOP_API_KEY}"}


def test_compacted_history_continues_the_session_by_its_last_answer(tmp_path):
    """Real OpenClaw requests (default tools, compaction forced every turn): each request replaces the older
    history with a summary, so only the previous answer links it to its session."""
    data = load("compacted-default-tools")
    reqs = [(r["messages"], r["answer"]) for r in data["requests"]]
    assert [is_compacted_history(m) for m, _ in reqs] == [False, True, True]
    assert all(is_ephemeral(m[-1]) for m, _ in reqs)
    store = Store(tmp_path / "store.sqlite")
    result = replay(store, reqs)
    assert [t for t, _, _ in result] == ["main"] * 3 and len({s for _, s, _ in result}) == 1
    t1, t2 = (store.get_turn(t) for _, _, t in result[:2])
    assert [m["content"] for m in t1.next_state] == [reqs[1][0][-2]["content"]]
    assert t1.next_state[0]["content"].endswith("Too long, answer in one sentence.")
    assert t2.next_state[0]["content"].endswith("Thanks, that's all.")
    # Without the summary message the same answer alone does not join a session.
    other = Store(tmp_path / "other.sqlite")
    plain = [reqs[0], ([m for m in reqs[1][0] if not m["content"].startswith(COMPACTED_HISTORY_PREFIX)], reqs[1][1])]
    assert len({s for _, s, _ in replay(other, plain)}) == 2


# ---- answers that OpenClaw echoes rewritten ------------------------------------------------------------------

# What SmolLM2 wrote at the start of an answer in a real OpenClaw session (it imitates the envelope OpenClaw puts
# on every user message). OpenClaw strips it from the answer it shows and from the history it sends back.
MODEL_ENVELOPE = "[Wed 2026-11-25 22:30:22] "


class ScriptedAnswersEngine:
    """Engine double that answers each request with the next of ``texts`` (real token ids under the real tokenizer,
    then EOS), streamed token by token. OpenClaw's recorded prompts (2,100-2,500 tokens) do not fit the tiny model's
    2,048-token context, and only a scripted answer can begin with the envelope the real model wrote; everything
    else in the path (HTTP, validation, rendering, session matching, pairing, the store) is the real thing."""

    eos_token_ids = frozenset({2})
    policy_version = 0
    max_context = 8192

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer = tokenizer
        self.texts = list(texts)

    def _next(self, prompt_ids) -> tuple[list[int], Generation]:
        text = self.texts.pop(0)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [2]
        return ids, Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", policy_version=0,
                               prompt_tokens=len(prompt_ids), text=text)

    async def generate(self, prompt_ids, params):
        return self._next(prompt_ids)[1]

    async def generate_stream(self, prompt_ids, params):
        ids, generation = self._next(prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer)
        for tid in ids[:-1]:
            yield TokenEvent(token_id=tid, logprob=-0.5, text_delta=detok.add(tid))
        yield TokenEvent(token_id=2, logprob=-0.5, text_delta=detok.flush())
        yield generation

    async def score(self, requests):
        raise NotImplementedError

    async def close(self):
        pass


def _post_streamed(http: httpx.Client, body: dict) -> dict:
    """POST a recorded (streamed) OpenClaw body; the ``clawloop`` extension of the response."""
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return next(c["clawloop"] for c in chunks if "clawloop" in c)


def test_http_answer_whose_envelope_openclaw_strips_still_continues_the_session(make_server, tiny_tokenizer):
    """Recorded runB conversation (requests 1-3) through the real server, with the first answer beginning with a
    timestamp envelope as the model wrote it in a real session. OpenClaw sends that answer back without the
    envelope, which is exactly the recorded request 2 (OpenClaw echoed the answer clawloop gave it)."""
    reqs = load("runB")["requests"][:3]
    answers = [r["answer"]["content"] for r in reqs]
    history_answer = next(m for m in reqs[1]["body"]["messages"] if m["role"] == "assistant")
    assert history_answer["content"] == answers[0]  # the echo OpenClaw recorded: the answer as it got it
    engine = ScriptedAnswersEngine(tiny_tokenizer, [MODEL_ENVELOPE + answers[0]] + answers[1:])
    server = make_server(engine=engine)
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        ext = [_post_streamed(http, r["body"]) for r in reqs]
    assert [e["turn_type"] for e in ext] == ["main"] * 3
    assert len({e["session_id"] for e in ext}) == 1
    first, second = (server.store.get_turn(e["turn_id"]) for e in ext[:2])
    assert ext[1]["paired_turn_id"] == first.id and ext[2]["paired_turn_id"] == second.id
    # The first answer is paired with the user's next message, and is stored exactly as the model wrote it.
    assert first.state == TurnState.JUDGEABLE
    assert [m["content"] for m in first.next_state] == ["[Mon 2026-11-23 20:00 UTC] Too long, answer in one sentence."]
    assert first.assistant_message["content"].startswith(MODEL_ENVELOPE.strip())
    assert tiny_tokenizer.decode(first.response_ids[:-1]) == MODEL_ENVELOPE + answers[0]


def test_answers_compare_as_openclaw_echoes_them_and_other_answers_stay_apart(tmp_path):
    """The rewrites OpenClaw makes to an answer it sends back (a leading timestamp envelope, also two of them of which
    it removes one; a runtime line; its internal-context block) keep the session and the pairing, by prefix, by the
    answer search and by the compacted-history answer key. A different answer is still a different answer."""
    reqs = load("runB")["requests"]
    first, second = messages_of(reqs[0]["body"]), messages_of(reqs[1]["body"])
    echoed = second[len(first)]
    assert echoed["role"] == "assistant"
    written = [MODEL_ENVELOPE + echoed["content"],
               f"{MODEL_ENVELOPE}[Mon 2026-11-23 19:59 GMT+1] {echoed['content']}",
               f"{echoed['content']}\nRuntime: agent=main | session=agent:main:explicit:ocl-b2 | shell=bash",
               f"{INTERNAL_CONTEXT_BEGIN}\nnone\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>\n{echoed['content']}"]
    for k, text in enumerate(written):
        answer = {"role": "assistant", "content": text}
        assert same_message(answer, echoed) and answer_key(answer) == answer_key(echoed), text
        store = Store(tmp_path / f"store{k}.sqlite")
        result = replay(store, [(first, answer), (second, reqs[1]["answer"])])
        assert len({s for _, s, _ in result}) == 1, text
        stored = store.get_turn(result[0][2])
        assert stored.state == TurnState.JUDGEABLE and stored.assistant_message["content"] == text
        # Older history rewritten too (pairing by searching for the answer), still the user's next message.
        trimmed = [m for m in second if m["role"] != "system"]
        assert find_next_state(first, answer, trimmed).next_state == [second[-1]]
    other = {"role": "assistant", "content": MODEL_ENVELOPE + "Paris."}
    assert not same_message(other, echoed)
    apart = replay(Store(tmp_path / "other.sqlite"), [(first, other), (second, reqs[1]["answer"])])
    assert len({s for _, s, _ in apart}) == 2
