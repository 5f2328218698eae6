"""OpenClaw's message format: everything clawloop knows about what OpenClaw puts into the messages it sends.

Stock OpenClaw sends no session or turn-type headers, and it decorates the messages a person typed with text the
person never wrote. This module is the one place that knows its wording and shapes (measured with OpenClaw
2026.9.6; docs/openclaw.md has the evidence); the judge (``clawloop.judge.envelopes``), the sessions and the
chat route of the API, the gate's probes and ``clawloop openclaw-end`` ask it and keep no pattern of their own.

Envelopes, removed before a judge reads a turn and when answers are compared (``strip_text``):

* a timestamp before every user message (``[Mon 2026-11-23 19:50 UTC] Too long, answer in one sentence.``),
  which a model that sees it starts imitating at the start of its answers, and which OpenClaw then removes from
  the answer it shows and from the history it sends back. ``strip_text`` removes every leading timestamp, and
  matches at least what OpenClaw's own leading-timestamp rule matches, so it is idempotent and the stored answer
  and OpenClaw's echo of it strip to the same text;
* a runtime line in the first user message (``Runtime: agent=main | sessionId=<id> | host=...``), which also
  names OpenClaw's session (``runtime_session_id``);
* an internal-context block (``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> … <<<END_OPENCLAW_INTERNAL_CONTEXT>>>``:
  active exec sessions, subagents). OpenClaw appends a user message holding only such a block to each request and
  leaves it out of the history it sends next time (``is_ephemeral``, ``conversation_messages``); it escapes these
  markers inside real user text, so a message that is nothing but one such block is always OpenClaw's own;
* an answer retry: when an answer showed the user nothing (empty, ``NO_REPLY``, reasoning only, tool calls with no
  answer after them), OpenClaw asks again within the same turn with one more user message, without the timestamp
  envelope (``The previous attempt did not produce a user-visible answer. …``), which its next request leaves out
  of the history like the block above (``is_ephemeral``; ``asks_again`` tells such a request).

Requests that are not the conversation with the user:

* **compacted history**: when OpenClaw compacts a long conversation, the next request replaces the older history
  with one user message holding a summary (``COMPACTED_HISTORY_PREFIX``) and keeps the recent turns, so the
  earlier request is no longer a prefix of it; its last answer is still there (``is_compacted_history``);
* **housekeeping**: a pre-compaction memory flush, compaction summaries of older history and session titles
  (``housekeeping_kind`` names the kind, or returns ``""``). Each rule needs OpenClaw's exact wording in the place
  OpenClaw puts it, so a user conversation that merely talks about memory or summaries stays a main turn.
"""

from __future__ import annotations

import re
from typing import Any

INTERNAL_CONTEXT_BEGIN = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
INTERNAL_CONTEXT_END = "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"

MEMORY_FLUSH = "memory_flush"
COMPACTION_SUMMARY = "compaction_summary"
SESSION_TITLE = "session_title"

COMPACTED_HISTORY_PREFIX = "The conversation history before this point was compacted into the following summary:"

# "[Mon 2026-11-23 19:50 UTC] ", also with seconds, another zone ("GMT+1", "Europe/Paris") or an offset: a day name,
# a date and a time, then anything up to the closing bracket, as OpenClaw's own rule reads it. Repeated, so that
# text that starts with two of them strips as far as the text OpenClaw sends back after removing one.
_TIMESTAMP_RE = re.compile(r"^\s*(?:\[[A-Za-z]{3}[a-z]*,? \d{4}-\d{2}-\d{2}[ T]\d{1,2}:\d{2}[^\]]*\]\s*)+")
# "Runtime: agent=main | session=... | shell=bash" on a line of its own.
_RUNTIME_RE = re.compile(r"(?m)^[ \t]*Runtime: [\w.-]+=[^\n]*\|[^\n]*$\n?")
# The same line's "sessionId=<id>" field.
_RUNTIME_SESSION_RE = re.compile(r"(?m)^[ \t]*Runtime: .*?(?:^|[|\s])sessionId=([^\s|]+)")
# "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> ... <<<END_OPENCLAW_INTERNAL_CONTEXT>>>" (to the end when unclosed).
_INTERNAL_RE = re.compile(r"<<<BEGIN_([A-Z_]*INTERNAL_CONTEXT)>>>.*?(?:<<<END_\1>>>|\Z)", re.DOTALL)
# OpenClaw's three wordings of "ask again": after an attempt that showed nothing, after reasoning only, after tool
# calls with no answer. A person's message starts with the timestamp envelope, so it never matches.
_ANSWER_RETRY_RE = re.compile(r"The previous (?:assistant turn|attempt)\b[^.]*did not produce a user-visible answer\.")

# The memory-flush prompt is sent as the last user message without the timestamp envelope OpenClaw puts on
# every message a person typed; it always ends by naming the silent reply token.
_FLUSH_USER_RE = re.compile(r"^Pre-compaction memory flush\.\s.*\bNO_REPLY\b", re.DOTALL)
_FLUSH_SYSTEM = "Pre-compaction memory flush turn."  # in OpenClaw's system prompt during a flush
_SUMMARY_SYSTEM = "You are a context summarization assistant."
_TITLE_SYSTEM = "Generate a concise session title"
_TRANSCRIPT_RE = re.compile(r"<conversation>.*</conversation>", re.DOTALL)


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined by newlines (un-normalised requests)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


# ---- envelopes ---------------------------------------------------------------------------------------------
TRUNCATION_MARK = "\u2026"
"""What OpenClaw puts where it cut the middle out of a long message when it compacts a transcript ("…"); the cut
can fall inside a word ("Asianu…esYouth")."""


def strip_text(text: str) -> str:
    """``text`` without OpenClaw's envelopes (internal context, runtime line, leading timestamps); surrounding
    blank space trimmed."""
    text = _INTERNAL_RE.sub("", text)
    text = _RUNTIME_RE.sub("", text)
    text = _TIMESTAMP_RE.sub("", text)
    return text.strip()


def runtime_session_id(text: str) -> str:
    """The OpenClaw session id named by a runtime line in ``text`` (``sessionId=<id>``), or ``""``."""
    match = _RUNTIME_SESSION_RE.search(text)
    return match.group(1) if match else ""


def is_answer_retry(msg: dict[str, Any]) -> bool:
    """A user message that is OpenClaw asking again for an answer the user can see."""
    return msg.get("role") == "user" and _ANSWER_RETRY_RE.match(message_text(msg).strip()) is not None


def is_ephemeral(msg: dict[str, Any]) -> bool:
    """A user message that holds only OpenClaw's internal runtime-context block, or an answer retry."""
    if msg.get("role") != "user":
        return False
    text = message_text(msg).strip()
    return (text.startswith(INTERNAL_CONTEXT_BEGIN) and text.endswith(INTERNAL_CONTEXT_END)) or is_answer_retry(msg)


def asks_again(messages: list[dict[str, Any]]) -> bool:
    """True when the request is OpenClaw asking again, within one turn, for an answer the user can see: an answer
    retry among the messages after the last answer."""
    for msg in reversed(messages):
        if msg.get("role") == "assistant":
            return False
        if is_answer_retry(msg):
            return True
    return False


def conversation_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without ephemeral ones (the same list object when there are none)."""
    if not any(is_ephemeral(m) for m in messages):
        return messages
    return [m for m in messages if not is_ephemeral(m)]


# ---- requests that are not the conversation --------------------------------------------------------------
def is_compacted_history(messages: list[dict[str, Any]]) -> bool:
    """True when a user message before the last one is OpenClaw's summary of compacted history."""
    return any(m.get("role") == "user" and message_text(m).lstrip().startswith(COMPACTED_HISTORY_PREFIX)
               for m in messages[:-1])


def housekeeping_kind(messages: list[dict[str, Any]]) -> str:
    """The kind of OpenClaw housekeeping request this is, or ``""`` for a conversation turn."""
    systems = [message_text(m).strip() for m in messages if m.get("role") == "system"]
    rest = [m for m in conversation_messages(messages) if m.get("role") != "system"]
    last_user = message_text(rest[-1]).strip() if rest and rest[-1].get("role") == "user" else ""
    if last_user and _FLUSH_USER_RE.match(last_user):
        return MEMORY_FLUSH
    if any(_FLUSH_SYSTEM + " The session is near auto-compaction" in s for s in systems):
        return MEMORY_FLUSH  # a configured flush prompt replaces the user text, not this system section
    if any(s.startswith(_SUMMARY_SYSTEM) for s in systems) and _TRANSCRIPT_RE.search(last_user):
        return COMPACTION_SUMMARY
    if any(s.startswith(_TITLE_SYSTEM) for s in systems) and len(rest) == 1:
        return SESSION_TITLE
    return ""
