"""A chat template that refuses a request's messages is the request's fault: a 400 in OpenAI's shape, not a 500.

Real templates raise on messages they cannot render (Qwen3's refuses a system message that is not first, others
insist that roles alternate). Which messages a client sends is up to the client, so the refusal is a 400 naming
``messages`` with code ``template_refused``, and the server goes on serving.
"""

from __future__ import annotations

import copy

import httpx
import pytest

from clawloop.config import Config
from clawloop.serve import Server
from tests.api.conftest import TEST_SETTINGS

STRICT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory, tiny_engine, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = STRICT_TEMPLATE
    config = Config.load(env={}, **{**TEST_SETTINGS, "run_dir": str(tmp_path_factory.mktemp("strict"))})
    srv = Server(config, engine=tiny_engine, tokenizer=tokenizer).start()
    yield srv
    srv.stop()


def test_a_template_refusal_is_a_400_and_the_server_goes_on(strict_server):
    body = {"model": "clawloop", "max_tokens": 2, "temperature": 0.0,
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late system"}]}
    with httpx.Client(base_url=strict_server.base_url, timeout=120) as http:
        refused = http.post("/v1/chat/completions", json=body)
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
        fine = http.post("/v1/chat/completions", json={**body, "messages": body["messages"][:1]})
    for reply in (refused, streamed):
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "template_refused")
        assert "System message must be at the beginning" in error["message"]
    assert fine.status_code == 200
    assert strict_server.store.turns() and len(strict_server.store.turns()) == 1
