"""What a client wraps around the user's words, removed before any judge reads them or a hint is written.

Agent front-ends decorate user messages with text the user never typed: OpenClaw a timestamp, a runtime line and
internal-context blocks (their shapes are ``clawloop.openclaw_format``'s, which ``strip_text`` is). A judge that
sees them mistakes them for the user's feedback (a rule judge copies the timestamp into the hint; an LLM judge
reads the runtime line as part of the request), so ``judged_turn`` gives the judges a copy of the turn whose user
messages hold only what the user wrote. Only user messages are touched: a tool's output is evidence as it is, and
the stored turn (what the policy saw and is trained on) is never changed.

The same ``strip_text`` is how session matching compares answers (``clawloop.api.sessions.canonical_message``), so
the judge and the sessions read a message the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from clawloop.openclaw_format import strip_text

__all__ = ["judged_turn", "strip_message", "strip_messages", "strip_text"]


def strip_message(message: dict[str, Any]) -> dict[str, Any] | None:
    """A user message without envelopes (None when nothing of the user's is left); other roles unchanged."""
    if message.get("role") != "user":
        return message
    content = message.get("content")
    if isinstance(content, str):
        text = strip_text(content)
        return {**message, "content": text} if text else None
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = strip_text(part["text"])
                if text:
                    parts.append({**part, "text": text})
            else:
                parts.append(part)
        return {**message, "content": parts} if parts else None
    return message


def strip_messages(messages: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages without envelopes; user messages that held nothing else are left out."""
    out = []
    for message in messages or []:
        stripped = strip_message(message)
        if stripped is not None:
            out.append(stripped)
    return out


def judged_turn(turn: Any) -> Any:
    """A copy of ``turn`` (a ``TurnRecord``) whose request and next state are what the user wrote."""
    return dataclasses.replace(turn, messages=strip_messages(turn.messages),
                               next_state=strip_messages(turn.next_state) if turn.next_state is not None else None)
