"""Structured output for an HTTP judge: hold the model to a valid vote where the endpoint can.

A small judge model often writes a vote that cannot be parsed (no ``\\boxed{}``, a hint without its markers),
and every such vote is lost. An endpoint that supports constrained decoding can rule that out:

* ``json_schema`` — the OpenAI ``response_format`` with a strict JSON schema (OpenAI, vLLM, SGLang, llama.cpp
  and most hosted APIs): the evaluative vote is ``{"reason": str, "score": 1 | -1 | 0}``, the hint vote
  ``{"reason": str, "decision": 1 | -1, "hint": str}``. ``reason`` comes first so the model can think before it
  decides. ``as_vote_text`` turns such a reply back into the boxed text the parser and the store expect;
* ``regex`` — vLLM's ``structured_outputs.regex``: free text that must end in a well-formed vote.

``auto`` (the default) tries ``json_schema`` and, when the endpoint rejects it (HTTP 400/404/422/501), repeats the
call without it and remembers not to send it again. Which kind a request is follows from its system prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from clawloop.judge.prompts import EVAL_SYSTEM, HINT_SYSTEM

MODES = ("auto", "json_schema", "regex", "off")
REJECTED_STATUS = frozenset({400, 404, 422, 501})
"""Statuses with which an endpoint says it does not take the structured-output fields."""

_REASON = {"type": "string", "maxLength": 1200}
SCHEMAS: dict[str, dict[str, Any]] = {
    "eval": {"type": "object", "additionalProperties": False, "required": ["reason", "score"],
             "properties": {"reason": _REASON, "score": {"type": "integer", "enum": [1, -1, 0]}}},
    "hint": {"type": "object", "additionalProperties": False, "required": ["reason", "decision", "hint"],
             "properties": {"reason": _REASON, "decision": {"type": "integer", "enum": [1, -1]},
                            "hint": {"type": "string", "maxLength": 600}}},
}
# No counted repeats ({m,n}): vLLM may fail to compile them in time; max_tokens bounds the length anyway.
REGEXES: dict[str, str] = {
    "eval": r"[^\\]*\\boxed\{(1|-1|0)\}",
    "hint": r"[^\\\[]*(\\boxed\{-1\}|\\boxed\{1\} ?\[HINT_START\][^\[\]]+\[HINT_END\])",
}


def vote_kind(messages: Sequence[dict[str, Any]]) -> str | None:
    """``eval`` or ``hint`` for a request built by ``prompts.build_messages``; None for anything else."""
    system = messages[0].get("content") if messages and messages[0].get("role") == "system" else None
    return {EVAL_SYSTEM: "eval", HINT_SYSTEM: "hint"}.get(system) if isinstance(system, str) else None


def request_fields(mode: str, kind: str) -> dict[str, Any]:
    """Body fields that constrain a ``kind`` vote under ``mode`` (``json_schema`` or ``regex``)."""
    if mode == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"clawloop_{kind}_vote", "strict": True, "schema": SCHEMAS[kind]}}}
    if mode == "regex":
        return {"structured_outputs": {"regex": REGEXES[kind]}}
    return {}


def as_vote_text(kind: str, content: str) -> str:
    """A JSON vote (``SCHEMAS[kind]``) as the boxed text a free-form judge writes; other text unchanged (an endpoint
    may ignore ``response_format``, or a regex mode already produced the text). A JSON object that breaks the
    schema ("score": "-1", no score) is an invalid vote, its text kept without a box: read as it is, a box quoted
    in its reason ("… \\boxed{1} would fit, but …") would count as the vote."""
    try:
        data = json.loads(content)
    except (TypeError, ValueError):
        return content
    if not isinstance(data, dict):
        return content
    reason = str(data.get("reason", "")).strip()
    if kind == "eval" and type(data.get("score")) is int and data["score"] in (1, -1, 0):
        return f"{reason}\n\\boxed{{{data['score']}}}".lstrip()
    if kind == "hint" and type(data.get("decision")) is int and data["decision"] in (1, -1):
        hint = str(data.get("hint", "")).strip()
        if data["decision"] == 1 and hint:
            return f"{reason}\n\\boxed{{1}} [HINT_START]{hint}[HINT_END]".lstrip()
        return f"{reason}\n\\boxed{{-1}}".lstrip()
    return "invalid structured vote: " + re.sub(r"\\+boxed", "boxed", content)
