"""What a client wraps around the user's words, removed before any judge reads them or a hint is written.

Agent front-ends decorate user messages with text the user never typed. OpenClaw, for one, starts every user
message with a timestamp (``[Mon 2026-11-23 19:50 UTC] Too long, answer in one sentence.``), appends a runtime
line to the first one (``Runtime: agent=main | session=... | host=...``), and may send a whole user message of
internal context between ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>`` and ``<<<END_OPENCLAW_INTERNAL_CONTEXT>>>``.
A judge that sees them mistakes them for the user's feedback (a rule judge copies the timestamp into the hint; an
LLM judge reads the runtime line as part of the request), so ``judged_turn`` gives the judges a copy of the turn
whose user messages hold only what the user wrote. Only user messages are touched: a tool's output is evidence
as it is, and the stored turn (what the policy saw and is trained on) is never changed.

The same ``strip_text`` is how session matching compares answers (``clawloop.api.sessions.canonical_message``).
A model that sees an envelope on every user message starts imitating it (``[Wed 2026-11-25 22:30:22] …`` at the
start of an answer), and OpenClaw removes it from the answer it shows and from the history it sends back, so the
answer that comes back differs from the one stored. ``strip_text`` is idempotent (it removes every leading
timestamp, and matches at least what OpenClaw's own leading-timestamp rule matches), so the stored answer and
OpenClaw's echo of it strip to the same text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

# "[Mon 2026-11-23 19:50 UTC] ", also with seconds, another zone ("GMT+1", "Europe/Paris") or an offset: a day name,
# a date and a time, then anything up to the closing bracket, as OpenClaw's own rule reads it. Repeated, so that
# text that starts with two of them strips as far as the text OpenClaw sends back after removing one.
_TIMESTAMP_RE = re.compile(r"^\s*(?:\[[A-Za-z]{3}[a-z]*,? \d{4}-\d{2}-\d{2}[ T]\d{1,2}:\d{2}[^\]]*\]\s*)+")
# "Runtime: agent=main | session=... | shell=bash" on a line of its own.
_RUNTIME_RE = re.compile(r"(?m)^[ \t]*Runtime: [\w.-]+=[^\n]*\|[^\n]*$\n?")
# "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ... <<<END_OPENCLAW_INTERNAL_CONTEXT>>>" (to the end when unclosed).
_INTERNAL_RE = re.compile(r"<<<BEGIN_([A-Z_]*INTERNAL_CONTEXT)>>>.*?(?:<<<END_\1>>>|\Z)", re.DOTALL)


def strip_text(text: str) -> str:
    """``text`` without client envelopes; surrounding blank space trimmed."""
    text = _INTERNAL_RE.sub("", text)
    text = _RUNTIME_RE.sub("", text)
    text = _TIMESTAMP_RE.sub("", text)
    return text.strip()


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
