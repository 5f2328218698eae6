"""Validation of ``POST /v1/chat/completions`` bodies into a ``ChatRequest``, and message normalisation.

Validation is written out by hand rather than generated from a model class, so that every mistake names the
offending field (OpenAI's ``param``) and becomes a 400, never a 422 or a 500. Parameters OpenAI defines but
clawloop does not use (penalties, ``logit_bias``, ``user``, ``response_format``, ...) and unknown extra fields
are accepted and ignored, because agents send them routinely.

Normalisation (the form messages are stored, hashed and rendered in):

* role ``developer`` becomes ``system``; legacy ``function`` becomes ``tool``; any other unknown role is a 400;
* content given as a list of parts becomes the text parts joined with newlines; non-text parts (images,
  audio, files) are dropped and listed under ``dropped_parts`` in the normalised message, so the stored record
  says what the model did not see;
* content ``null`` becomes ``""``; assistant ``tool_calls`` keep id, name and argument string;
* every normalised message has exactly the keys ``role`` and ``content`` plus, when present, ``name``,
  ``tool_calls``, ``tool_call_id`` and ``dropped_parts``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from clawloop.api import safejson
from clawloop.api.errors import bad_request
from clawloop.temperature import effective_temperature

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "tool"}
TURN_TYPES = ("main", "side")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
"""Longest stop string accepted: every new token is checked against the tail of the text as long as the longest
stop string, in the engine thread all users share (a 20,000-character one tripled a request's time)."""
MAX_TOP_LOGPROBS = 20
MAX_SESSION_ID_CHARS = 128
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:@+=-]+")
"""Session ids travel in headers and paths and are stored: ASCII letters, digits and ._:@+=- only."""


@dataclass
class ChatRequest:
    """A validated chat completion request (sampling settings not yet defaulted from the config)."""

    messages: list[dict[str, Any]]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    session_id: str | None = None
    turn_type: str | None = None
    session_done: bool = False


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _expect(value: Any, kinds: tuple[type, ...], param: str, what: str) -> Any:
    # bool is a subclass of int: never accept true/false where a number is expected.
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"Invalid type for '{param}': expected {what}, got a boolean.", param, "invalid_type")
    if not isinstance(value, kinds):
        raise bad_request(f"Invalid type for '{param}': expected {what}, got {_type_name(value)}.", param,
                          "invalid_type")
    return value


def _number(body: dict[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    _expect(value, (int, float), key, "a number")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float
        value = math.inf
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise bad_request(f"'{key}' must be in {bracket}{lo:g}, {hi:g}], got {value!r}.", key, "invalid_value")
    return value


def _temperature(body: dict[str, Any]) -> float | None:
    """``temperature`` in [0, 2]; a value below ``GREEDY_BELOW`` is greedy (0.0), as it is served, stored and
    trained: the turn records the temperature the answer was really sampled at."""
    value = _number(body, "temperature", 0.0, 2.0)
    return None if value is None else effective_temperature(value)


def _integer(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    _expect(value, (int,), key, "an integer")
    if value < lo or (hi is not None and value > hi):
        upper = "" if hi is None else f" and <= {hi}"
        raise bad_request(f"'{key}' must be >= {lo}{upper}, got {value}.", key, "invalid_value")
    return value


def _flag(value: Any, param: str) -> bool:
    """A boolean given as JSON true/false, 0/1 or a word (1/true/yes/on, 0/false/no/off)."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise bad_request(f"'{param}' must be a boolean (true/false, 1/0, yes/no, on/off).", param, "invalid_value")


def parse_flag_header(value: str | None, name: str) -> bool:
    return False if value is None else _flag(value, name)


def validate_session_id(value: Any, param: str) -> str:
    _expect(value, (str,), param, "a string")
    text = value.strip()
    if not text or len(text) > MAX_SESSION_ID_CHARS or not SESSION_ID_RE.fullmatch(text):
        raise bad_request(f"'{param}' must be 1-{MAX_SESSION_ID_CHARS} characters among ASCII letters, digits and "
                          "._:@+=-", param, "invalid_value")
    return text


def validate_turn_type(value: Any, param: str) -> str:
    _expect(value, (str,), param, "a string")
    text = value.strip().lower()
    if text not in TURN_TYPES:
        raise bad_request(f"'{param}' must be 'main' or 'side', got {value!r}.", param, "invalid_value")
    return text


# ---------------------------------------------------------------------------------------------- messages


def _content_text(content: Any, param: str) -> tuple[str, list[str]]:
    """(text, dropped part types) of a message's content."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts: list[str] = []
        dropped: list[str] = []
        for j, part in enumerate(content):
            p = f"{param}[{j}]"
            if isinstance(part, str):  # some clients send bare strings in the list
                texts.append(part)
                continue
            _expect(part, (dict,), p, "an object")
            kind = part.get("type")
            _expect(kind, (str,), f"{p}.type", "a string")
            if kind in ("text", "input_text", "output_text", "refusal"):
                key = "refusal" if kind == "refusal" else "text"
                texts.append(_expect(part.get(key), (str,), f"{p}.{key}", "a string"))
            else:
                dropped.append(kind)
        return "\n".join(texts), dropped
    raise bad_request(f"Invalid type for '{param}': expected a string or an array of content parts, got "
                      f"{_type_name(content)}.", param, "invalid_type")


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    _expect(value, (list,), param, "an array")
    calls = []
    for j, call in enumerate(value):
        p = f"{param}[{j}]"
        _expect(call, (dict,), p, "an object")
        fn = _expect(call.get("function"), (dict,), f"{p}.function", "an object")
        name = _expect(fn.get("name"), (str,), f"{p}.function.name", "a string")
        args = fn.get("arguments", "")
        if isinstance(args, dict):  # lenient: some clients send the object itself
            args = json.dumps(args, ensure_ascii=False)
        _expect(args, (str,), f"{p}.function.arguments", "a string")
        _check_arguments(args, f"{p}.function.arguments")
        call_id = call.get("id")
        if call_id is not None:
            _expect(call_id, (str,), f"{p}.id", "a string")
        calls.append({"id": call_id or "", "type": "function", "function": {"name": name, "arguments": args}})
    return calls


def _check_arguments(args: str, param: str) -> None:
    """Arguments are JSON text read again later (sessions, rendering): refuse what cannot be read safely."""
    try:
        safejson.loads(args)
    except safejson.JSONLimitError as exc:
        raise bad_request(f"Invalid '{param}': {exc}.", param, "invalid_value") from None
    except ValueError:
        pass  # not JSON at all: kept as text


def normalise_message(msg: Any, param: str) -> dict[str, Any]:
    _expect(msg, (dict,), param, "an object")
    role_raw = msg.get("role")
    if role_raw is None:
        raise bad_request(f"Missing required parameter: '{param}.role'.", f"{param}.role", "missing_required_parameter")
    _expect(role_raw, (str,), f"{param}.role", "a string")
    role = ROLES.get(role_raw)
    if role is None:
        raise bad_request(f"Invalid value for '{param}.role': {role_raw!r}. Supported roles: system, developer, user, "
                          "assistant, tool.", f"{param}.role", "invalid_value")
    if "content" not in msg and role != "assistant":
        raise bad_request(f"Missing required parameter: '{param}.content'.", f"{param}.content",
                          "missing_required_parameter")
    text, dropped = _content_text(msg.get("content"), f"{param}.content")
    out: dict[str, Any] = {"role": role, "content": text}
    name = msg.get("name")
    if name is not None:
        out["name"] = _expect(name, (str,), f"{param}.name", "a string")
    if role == "assistant" and msg.get("tool_calls") is not None:
        calls = _tool_calls(msg["tool_calls"], f"{param}.tool_calls")
        if calls:
            out["tool_calls"] = calls
    if role == "assistant" and msg.get("function_call") is not None:  # legacy single call
        fc = _expect(msg["function_call"], (dict,), f"{param}.function_call", "an object")
        out.setdefault("tool_calls", []).extend(_tool_calls([{"function": fc}], f"{param}.function_call"))
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None:
            out["tool_call_id"] = _expect(call_id, (str,), f"{param}.tool_call_id", "a string")
    if dropped:
        out["dropped_parts"] = dropped
    return out


def normalise_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    _expect(value, (list,), "messages", "an array")
    if not value:
        raise bad_request("'messages' must hold at least one message.", "messages", "empty_array")
    return [normalise_message(m, f"messages[{i}]") for i, m in enumerate(value)]


# ------------------------------------------------------------------------------------------------- tools


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    _expect(value, (list,), "tools", "an array")
    tools = []
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        _expect(tool, (dict,), p, "an object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise bad_request(f"'{p}.type' must be 'function', got {kind!r}.", f"{p}.type", "invalid_value")
        fn = _expect(tool.get("function"), (dict,), f"{p}.function", "an object")
        name = _expect(fn.get("name"), (str,), f"{p}.function.name", "a string")
        if not name.strip():
            raise bad_request(f"'{p}.function.name' must not be empty.", f"{p}.function.name", "invalid_value")
        clean: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            clean["description"] = _expect(fn["description"], (str,), f"{p}.function.description", "a string")
        if fn.get("parameters") is not None:
            clean["parameters"] = _expect(fn["parameters"], (dict,), f"{p}.function.parameters", "an object")
        if fn.get("strict") is not None:
            clean["strict"] = _expect(fn["strict"], (bool,), f"{p}.function.strict", "a boolean")
        tools.append({"type": "function", "function": clean})
    return tools or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {value!r}.",
                              "tool_choice", "invalid_value")
        if value == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but no 'tools' were given.", "tool_choice",
                              "invalid_value")
        return value
    _expect(value, (dict,), "tool_choice", "a string or an object")
    fn = _expect(value.get("function"), (dict,), "tool_choice.function", "an object")
    name = _expect(fn.get("name"), (str,), "tool_choice.function.name", "a string")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'.",
                          "tool_choice.function.name", "invalid_value")
    return {"type": "function", "function": {"name": name}}


# -------------------------------------------------------------------------------------------------- body


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded JSON body. Raises ``APIError`` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {_type_name(body)}.", None, "invalid_body")
    messages = normalise_messages(body.get("messages"))
    model = body.get("model")
    if model is not None:
        _expect(model, (str,), "model", "a string")
    n = _integer(body, "n", 1)
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1 (clawloop returns one choice per request), got {n}.", "n",
                          "unsupported_value")
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    max_tokens = _integer(body, "max_tokens", 1)
    max_completion_tokens = _integer(body, "max_completion_tokens", 1)
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    stop_raw = body.get("stop")
    stop: list[str] = []
    if stop_raw is not None:
        if isinstance(stop_raw, str):
            stop = [stop_raw]
        else:
            _expect(stop_raw, (list,), "stop", "a string or an array of strings")
            for j, s in enumerate(stop_raw):
                stop.append(_expect(s, (str,), f"stop[{j}]", "a string"))
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"'stop' holds at most {MAX_STOP_STRINGS} strings.", "stop", "invalid_value")
        if any(s == "" for s in stop):
            raise bad_request("'stop' strings must not be empty.", "stop", "invalid_value")
        if any(len(s) > MAX_STOP_CHARS for s in stop):
            raise bad_request(f"'stop' strings are at most {MAX_STOP_CHARS} characters long.", "stop",
                              "invalid_value")
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    stream = False if body.get("stream") is None else _expect(body["stream"], (bool,), "stream", "a boolean")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        _expect(options, (dict,), "stream_options", "an object")
        if options.get("include_usage") is not None:
            include_usage = _expect(options["include_usage"], (bool,), "stream_options.include_usage", "a boolean")
    logprobs_raw = body.get("logprobs")
    logprobs = False if logprobs_raw is None else _expect(logprobs_raw, (bool,), "logprobs", "a boolean")
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs", "invalid_value")
    # Accepted and ignored (type-checked so a wrong type is still a 400).
    for key in ("presence_penalty", "frequency_penalty"):
        _number(body, key, -2.0, 2.0)
    for key, kinds, what in (("logit_bias", (dict,), "an object"), ("user", (str,), "a string"),
                             ("parallel_tool_calls", (bool,), "a boolean"),
                             ("response_format", (dict,), "an object"), ("metadata", (dict,), "an object")):
        if body.get(key) is not None:
            _expect(body[key], kinds, key, what)
    session_id = body.get("session_id")
    turn_type = body.get("turn_type")
    return ChatRequest(
        messages=messages,
        model=model,
        tools=tools,
        tool_choice=tool_choice,
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        stream=stream,
        include_usage=include_usage and stream,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        session_id=None if session_id is None else validate_session_id(session_id, "session_id"),
        turn_type=None if turn_type is None else validate_turn_type(turn_type, "turn_type"),
        session_done=_flag(body.get("session_done"), "session_done"),
    )
