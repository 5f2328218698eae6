"""Property-based fuzzing of request bodies and headers against a live server (hypothesis, bounded).

Whatever arrives: never a 5xx, every refusal is an OpenAI-shaped error, and the server is healthy afterwards on
the same keep-alive connection."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.conftest import RawConnection, assert_openai_error

URL = "/v1/chat/completions"

# Any Unicode, lone surrogates included (json.dumps writes them as \\udXXX escapes).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
nasty_text = st.one_of(any_text, st.sampled_from(["<|im_start|>system\n", "<|im_end|>", "\x00", "é", "\ud800",
                                                   "{" * 80, "[" * 200 + "]" * 200, "  ", ""]))
numbers = st.one_of(st.integers(min_value=-(10**30), max_value=10**30), st.just(10**400), st.just(-(10**400)),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans())
scalars = st.one_of(st.none(), numbers, nasty_text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(nasty_text, inner, max_size=4)),
                           max_leaves=12)


def deep(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


tool_call = st.fixed_dictionaries({"id": nasty_text, "type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": nasty_text, "arguments": st.one_of(nasty_text, st.just(json.dumps(deep(900))), json_values)})})
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": nasty_text}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "tool", "assistant", "bogus"]),
                           "content": st.one_of(nasty_text, st.lists(st.one_of(nasty_text, json_values), max_size=3),
                                                json_values)},
                          optional={"name": nasty_text, "tool_call_id": nasty_text,
                                    "tool_calls": st.lists(tool_call, max_size=2)}),
    json_values)
body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=1, max_size=4), json_values)},
    optional={"model": scalars, "max_tokens": st.one_of(st.integers(-2, 3), numbers, nasty_text),
              "temperature": numbers, "top_p": numbers, "seed": numbers, "stream": st.one_of(st.booleans(), scalars),
              "stop": st.one_of(nasty_text, st.lists(nasty_text, max_size=5)), "logprobs": scalars,
              "top_logprobs": numbers, "session_id": nasty_text, "turn_type": nasty_text,
              "session_done": scalars, "tool_choice": json_values,
              "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                  {"name": nasty_text}, optional={"description": nasty_text, "parameters": json_values})}),
                  max_size=2),
              "metadata": st.one_of(json_values, st.just(deep(500)))})
FIELD_BYTES = [0x09, *range(0x20, 0x7F), *range(0x80, 0x100)]
latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=30)
headers = st.fixed_dictionaries({}, optional={
    # Any bytes HTTP allows in a header value (UTF-8 and other non-latin-1 text arrive this way).
    "X-Session-Id": st.one_of(latin1, st.lists(st.sampled_from(FIELD_BYTES), min_size=1, max_size=20).map(
        lambda bs: bytes(bs).strip() or b"x")),
    "X-Turn-Type": latin1, "X-Session-Done": latin1,
    "Content-Type": st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                     "application/x-www-form-urlencoded", "multipart/form-data", "", None]),
    "Origin": st.sampled_from(["http://evil.example", "null", "http://127.0.0.1:9", "https://localhost", "x"]),
    "Authorization": latin1,
})


def _force_short(value: dict) -> dict:
    """Keep generation to a few tokens: any valid max_tokens above 3 becomes 3."""
    if not isinstance(value.get("max_tokens"), (int, float)) or isinstance(value.get("max_tokens"), bool):
        return value
    if value["max_tokens"] > 3 and value["max_tokens"] == value["max_tokens"]:
        value["max_tokens"] = 3
    return value


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(payload=body, head=headers, session_in_path=st.one_of(st.none(), latin1))
def test_fuzzed_requests_never_get_a_5xx(shared_server, payload, head, session_in_path):
    payload = _force_short(payload)
    if "max_tokens" not in payload:
        payload["max_tokens"] = 2
    raw = json.dumps(payload, allow_nan=True).encode("utf-8", "surrogatepass")
    path = URL
    if session_in_path is not None:
        from urllib.parse import quote

        path = f"/sessions/{quote(session_in_path, safe='')}/v1/chat/completions"
    with RawConnection(shared_server.port) as conn:
        status, resp_headers, out = conn.request("POST", path, raw, head)
        assert status < 500, out
        if status >= 400:
            assert_openai_error(status, out)
        else:
            assert status == 200
            if resp_headers.get("content-type", "").startswith("text/event-stream"):
                assert out.rstrip().endswith(b"data: [DONE]")
            else:
                assert json.loads(out)["object"] == "chat.completion"
        status, _, out = conn.request("GET", "/healthz", headers={"Content-Type": None})
        assert status == 200 and json.loads(out)["status"] == "ok"
