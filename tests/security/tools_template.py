"""A tools-aware chat template (Qwen2.5's, the kind a real set-up serves) on the tiny model's tokenizer, and a
live server that renders with it.

The tiny tokenizer's own template (SmolLM2's) knows no tools, so clawloop writes them into the system message as
one string; a template like this one receives the tools and the call arguments as objects and writes them out
itself (``tojson``), keys included. Both use ``<|im_start|>``/``<|im_end|>`` (ids 1 and 2 of the tiny tokenizer).

* ``tools_tokenizer`` (session): a copy of the tiny tokenizer carrying ``QWEN_TOOLS_TEMPLATE``.
* ``tools_server`` (module): a server of the tiny model rendering with ``tools_tokenizer``, no key.
* ``marker_counts(ids)``: (start markers, end markers) in a list of ids.
"""

from __future__ import annotations

import copy

import pytest

from clawloop.config import Config
from clawloop.serve import Server
from tests.api.conftest import TEST_SETTINGS

IM_START, IM_END = 1, 2

QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided \
with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def marker_counts(ids: list[int]) -> tuple[int, int]:
    return ids.count(IM_START), ids.count(IM_END)


@pytest.fixture(scope="session")
def tools_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory, tiny_engine, tools_tokenizer):
    config = Config.load(env={}, **{**TEST_SETTINGS, "run_dir": str(tmp_path_factory.mktemp("tools"))})
    srv = Server(config, engine=tiny_engine, tokenizer=tools_tokenizer).start()
    yield srv
    srv.stop()
