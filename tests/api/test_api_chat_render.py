"""Chat rendering with the real SmolLM2 tokenizer, tools in the prompt, tool-call parsing, log-prob token texts,
and request validation/normalisation (no server needed)."""

from __future__ import annotations

import json

import pytest

from clawloop.api.errors import APIError
from clawloop.api.schemas import parse_chat_request
from clawloop.api.token_texts import TokenTexts
from clawloop.renderers import (ChatRenderer, ToolCallStreamFilter, assistant_message, parse_answer,
                                template_default_system)
from clawloop.renderers.chat import tools_instruction

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def renderer(tiny_tokenizer):
    return ChatRenderer(tiny_tokenizer)


def test_plain_render_is_the_tokenizers_chatml(renderer, tiny_tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    out = renderer.render(messages)
    expected = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.text == expected
    assert out.text.endswith("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    assert out.ids == tiny_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert out.ids[-4:] == tiny_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert out.tools is None
    assert not renderer.native_tools  # SmolLM2's template ignores tools


def test_tools_go_into_the_system_message_with_the_call_format(renderer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    out = renderer.render(messages, [WEATHER, CLOCK], "auto")
    system = out.text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert json.dumps(WEATHER, sort_keys=True) in system
    assert json.dumps(CLOCK, sort_keys=True) in system
    assert '<tool_call>\n{"name": "<tool name>", "arguments": {' in system
    assert out.tools == [WEATHER, CLOCK]
    # Without a system message one is added (replacing the template's default one).
    out2 = renderer.render(messages[1:], [WEATHER], None)
    assert out2.text.startswith("<|im_start|>system\nYou have access to the following tools")
    assert "SmolLM" not in out2.text


def test_tool_choice_none_renders_no_tools_and_a_named_choice_only_that_tool(renderer):
    messages = [{"role": "user", "content": "hi"}]
    assert renderer.render(messages, [WEATHER], "none").text == renderer.render(messages).text
    assert renderer.render(messages, [WEATHER], "none").tools is None
    named = renderer.render(messages, [WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}})
    assert named.tools == [CLOCK]
    assert "get_weather" not in named.text
    # The prompt depends on the shown tools alone: re-rendering from (messages, shown tools) gives the same ids.
    assert renderer.render(messages, named.tools).ids == named.ids
    required = renderer.render(messages, [WEATHER], "required")
    assert renderer.render(messages, required.tools).ids == required.ids


def test_tool_history_is_rendered_as_text_the_model_can_read(renderer):
    messages = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 8C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun, 24C"},
    ]
    text = renderer.render(messages, [WEATHER]).text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
            '<|im_end|>') in text
    # Consecutive tool results become one user message of <tool_response> blocks.
    assert ("<|im_start|>user\n<tool_response>\nrain, 8C\n</tool_response>\n<tool_response>\nsun, 24C\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text


def test_the_templates_default_system_prompt_is_read_from_the_template(tiny_tokenizer):
    """SmolLM2's template writes its own system prompt when a conversation has none; a template that writes none,
    or one that refuses a system message, gives ''."""
    import copy

    assert template_default_system(tiny_tokenizer) == (
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}<assistant>"
    assert template_default_system(tok) == ""
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                         "{% endif %}{{ m.content }}{% endfor %}")
    assert template_default_system(tok) == ""


def test_a_template_that_knows_tools_receives_them_natively(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '|' }}{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% endif %}{{ '|' }}{% endfor %}assistant:")
    r = ChatRenderer(tok)
    assert r.native_tools
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "rain"}]
    assert r.render(messages, [WEATHER, CLOCK]).text == \
        "TOOLS:get_weather;get_time;|user:hi|assistant:[get_weather Oslo]|tool:rain|assistant:"


# ---------------------------------------------------------------------------------------------- parsing


def test_tool_calls_are_parsed_into_openai_shape():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = parse_answer(text, tools_active=True)
    assert parsed.content == "Let me check."
    (call,) = parsed.tool_calls
    assert call["id"].startswith("call_") and len(call["id"]) > 10
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    msg = assistant_message(parsed)
    assert msg["role"] == "assistant" and msg["tool_calls"] == [call]


def test_several_calls_only_calls_unclosed_last_block_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
            '</tool_call>\n<tool_call>{"name": "c", "arguments": {"y": [1, 2]}}')
    parsed = parse_answer(text, tools_active=True)
    assert parsed.content is None
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b", "c"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{}, {"x": 1}, {"y": [1, 2]}]
    assert len({c["id"] for c in parsed.tool_calls}) == 3


def test_unparseable_blocks_stay_in_the_content_and_nothing_is_parsed_without_tools():
    bad = "<tool_call>not json</tool_call> and <tool_call>{\"arguments\": {}}</tool_call>"
    parsed = parse_answer(bad, tools_active=True)
    assert parsed.tool_calls == [] and parsed.content == bad
    mixed = bad + '<tool_call>{"name": "ok"}</tool_call>'
    parsed = parse_answer(mixed, tools_active=True)
    assert [c["function"] for c in parsed.tool_calls] == [{"name": "ok", "arguments": "{}"}]
    assert parsed.content == bad.strip()
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert parse_answer(text, tools_active=False).content == text
    assert parse_answer(text, tools_active=False).tool_calls == []


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_stream_filter_never_leaks_markup_and_ends_with_the_same_answer(step):
    text = 'Sure <b>, checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    filt = ToolCallStreamFilter(tools_active=True)
    streamed = "".join(filt.feed(text[i:i + step]) for i in range(0, len(text), step))
    assert "<tool_call" not in streamed and "<tool_" not in streamed
    assert streamed.startswith("Sure <b>, checking.")
    rest, parsed = filt.finish()
    assert (streamed + rest).strip() == parse_answer(text, True).content == "Sure <b>, checking."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]


def test_stream_filter_releases_held_text_that_was_not_a_tool_call():
    filt = ToolCallStreamFilter(tools_active=True)
    out = filt.feed("a <tool") + filt.feed("box> b")
    rest, parsed = filt.finish()
    assert out + rest == "a <toolbox> b" and parsed.tool_calls == []
    filt = ToolCallStreamFilter(tools_active=True)
    out = filt.feed("x <tool_call>oops")
    rest, parsed = filt.finish()
    assert out + rest == "x <tool_call>oops" and parsed.content == "x <tool_call>oops"


def test_tools_instruction_lists_every_schema():
    text = tools_instruction([WEATHER, CLOCK])
    assert text.count("\n{") >= 2 and "get_weather" in text and "get_time" in text


# ------------------------------------------------------------------------------------------ token texts


def test_token_texts_give_exact_bytes_and_openai_strings(tiny_tokenizer):
    tt = TokenTexts(tiny_tokenizer)
    ids = tiny_tokenizer("héllo 日本 ok", add_special_tokens=False)["input_ids"]
    raw = b"".join(tt.get(i)[1] for i in ids)
    assert raw == "héllo 日本 ok".encode("utf-8")
    texts = [tt.get(i)[0] for i in ids]
    assert any("\\x" in t for t in texts)  # a token holding part of a multi-byte character
    assert tt.get(2) == ("<|im_end|>", b"<|im_end|>")
    entry = tt.entry(ids[0], -0.5)
    assert entry == {"token": "h", "logprob": -0.5, "bytes": [104]}


# ------------------------------------------------------------------------------------------- validation


def test_normalisation_of_roles_and_content_parts():
    req = parse_chat_request({"messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                     {"type": "text", "text": "here"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done", "extra": "ignored"},
    ]})
    assert req.messages == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "look\nhere", "dropped_parts": ["image_url"]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]


def test_request_fields_are_read_and_max_completion_tokens_wins():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0,
                              "top_p": 0.5, "max_tokens": 9, "max_completion_tokens": 4, "stop": "END", "seed": 3,
                              "n": 1, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
                              "top_logprobs": 2, "session_id": " s1 ", "turn_type": "SIDE", "session_done": "yes",
                              "presence_penalty": 0.1, "user": "u", "unknown_extra": {"a": 1}})
    assert (req.temperature, req.top_p, req.max_tokens, req.stop, req.seed) == (0.0, 0.5, 4, ["END"], 3)
    assert req.stream and req.include_usage and req.logprobs and req.top_logprobs == 2
    assert (req.session_id, req.turn_type, req.session_done) == ("s1", "side", True)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function",
                                                                       "function": {"name": "nope"}}},
     "tool_choice.function.name"),
])
def test_bad_fields_are_named_in_the_error(body, param):
    with pytest.raises(APIError) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and info.value.param == param
