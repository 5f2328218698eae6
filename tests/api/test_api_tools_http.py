"""Tool calls over HTTP, plain and streamed, with the official client.

The tiny random model never writes a tool call by itself, so this file alone serves through
``ScriptedToolCallEngine``: a deterministic engine double that "generates" a fixed text (its real token ids
under the real tokenizer, then EOS) token by token. Everything else in the path (validation, rendering, parsing,
streaming, the store) is the real thing. Every other API test uses the real tiny-model engine.
"""

from __future__ import annotations

import json

import openai
import pytest

from clawloop.engines.base import Generation, SamplingParams, TokenEvent
from clawloop.engines.detok import IncrementalDetokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SCRIPT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


class ScriptedToolCallEngine:
    """Engine double: always answers ``text`` (tokenised for real), ending with EOS."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset({2})
        self.ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [2]
        self.text = text
        self.prompts: list[list[int]] = []

    policy_version = 0
    max_context = 2048

    def _generation(self, prompt_ids):
        return Generation(token_ids=list(self.ids), logprobs=[-0.25] * len(self.ids), finish_reason="stop",
                          policy_version=0, prompt_tokens=len(prompt_ids), text=self.text)

    async def generate(self, prompt_ids, params: SamplingParams):
        self.prompts.append(list(prompt_ids))
        return self._generation(prompt_ids)

    async def generate_stream(self, prompt_ids, params: SamplingParams):
        self.prompts.append(list(prompt_ids))
        detok = IncrementalDetokenizer(self.tokenizer)
        for tid in self.ids[:-1]:
            yield TokenEvent(token_id=tid, logprob=-0.25, text_delta=detok.add(tid))
        yield TokenEvent(token_id=2, logprob=-0.25, text_delta=detok.flush())
        yield self._generation(prompt_ids)

    async def score(self, requests):
        raise NotImplementedError

    async def close(self):
        pass


@pytest.fixture
def tool_server(make_server, tiny_tokenizer):
    engine = ScriptedToolCallEngine(tiny_tokenizer, SCRIPT)
    srv = make_server(engine=engine)
    return srv, engine, openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)


def test_tool_calls_come_back_parsed_and_the_turn_keeps_the_raw_ids(tool_server, tiny_tokenizer):
    srv, engine, client = tool_server
    messages = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    resp = client.chat.completions.create(model="clawloop", messages=messages, tools=[WEATHER])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls) and calls[0].id != calls[1].id
    # The tools were in the prompt the engine saw; the stored ids are the sampled ones, markup included.
    assert "get_weather" in tiny_tokenizer.decode(engine.prompts[-1])
    turn = srv.store.get_turn(resp.model_extra["clawloop"]["turn_id"])
    assert turn.response_ids == engine.ids and turn.finish_reason == "tool_calls"
    assert tiny_tokenizer.decode(turn.response_ids[:-1]) == SCRIPT
    assert turn.tools == [WEATHER]
    assert turn.assistant_message["tool_calls"][1]["function"]["arguments"] == '{"city": "Rome"}'
    assert srv.service.renderer.render(turn.messages, turn.tools).ids == turn.prompt_ids


def test_streamed_tool_calls_use_tool_call_deltas_and_hide_the_markup(tool_server):
    srv, engine, client = tool_server
    stream = client.chat.completions.create(model="clawloop", tools=[WEATHER], stream=True,
                                            messages=[{"role": "user", "content": "Weather?"}])
    content, calls, reasons = "", {}, []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert "<tool_call" not in content and content.strip() == "I will check."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_weather"]
    assert json.loads(calls[1]["arguments"]) == {"city": "Rome"}
    assert reasons[-1] == "tool_calls"


def test_tool_choice_none_shows_no_tools_and_parses_nothing(tool_server, tiny_tokenizer):
    srv, engine, client = tool_server
    resp = client.chat.completions.create(model="clawloop", tools=[WEATHER], tool_choice="none",
                                          messages=[{"role": "user", "content": "Weather?"}])
    assert "get_weather" not in tiny_tokenizer.decode(engine.prompts[-1])
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == SCRIPT


def test_a_tool_loop_pairs_the_tool_result_as_next_state(tool_server):
    srv, engine, client = tool_server
    h = {"X-Session-Id": "loop"}
    first = client.chat.completions.create(model="clawloop", tools=[WEATHER], extra_headers=h,
                                           messages=[{"role": "user", "content": "Weather?"}])
    msg = first.choices[0].message
    history = [{"role": "user", "content": "Weather?"}, msg.model_dump(exclude_none=True)]
    results = [{"role": "tool", "tool_call_id": c.id, "content": f"sunny {i}"} for i, c in enumerate(msg.tool_calls)]
    client.chat.completions.create(model="clawloop", tools=[WEATHER], extra_headers=h, messages=history + results)
    turn = srv.store.get_turn(first.model_extra["clawloop"]["turn_id"])
    assert turn.state == "judgeable"
    assert [m["content"] for m in turn.next_state] == ["sunny 0", "sunny 1"]
    assert all(m["role"] == "tool" for m in turn.next_state)
