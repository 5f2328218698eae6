"""What clawloop knows about the traffic of agents that send no session or turn-type headers (stock OpenClaw).

Two questions, both answered from the request's messages alone (see docs/openclaw.md for the evidence):

* **Which messages are ephemeral?** OpenClaw appends a user message holding only an internal runtime-context block
  (``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> … <<<END_OPENCLAW_INTERNAL_CONTEXT>>>``: active exec sessions,
  subagents) to each request and leaves it out of the history it sends next time. ``conversation_messages``
  removes such messages, so session matching compares what the conversation really holds and the stored next
  state never contains them (they are not user feedback). OpenClaw escapes these markers inside real user
  text, so a message that is nothing but one such block is always OpenClaw's own.
* **Was the history compacted?** When OpenClaw compacts a long conversation, the next request replaces the older
  history with one user message holding a summary (``COMPACTED_HISTORY_PREFIX``) and keeps the recent turns, so
  the earlier request is no longer a prefix of it; its last answer is still there. ``is_compacted_history`` says
  when a request has this shape, so the session can be found by that answer instead.
* **Is the request housekeeping?** OpenClaw asks the model for a pre-compaction memory flush, for compaction
  summaries of older history and for session titles. Those answers are not the conversation with the user:
  ``housekeeping_kind`` names the kind (served as a side turn: never stored, never trained, no session state)
  or returns ``""``. Each rule needs OpenClaw's exact wording in the place OpenClaw puts it, so a user
  conversation that merely talks about memory or summaries stays a main turn.
"""

from __future__ import annotations

import re
from typing import Any

INTERNAL_CONTEXT_BEGIN = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
INTERNAL_CONTEXT_END = "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"

MEMORY_FLUSH = "memory_flush"
COMPACTION_SUMMARY = "compaction_summary"
SESSION_TITLE = "session_title"

# The memory-flush prompt is sent as the last user message without the timestamp envelope OpenClaw puts on
# every message a person typed; it always ends by naming the silent reply token.
_FLUSH_USER_RE = re.compile(r"^Pre-compaction memory flush\.\s.*\bNO_REPLY\b", re.DOTALL)
_FLUSH_SYSTEM = "Pre-compaction memory flush turn."  # in OpenClaw's system prompt during a flush
_SUMMARY_SYSTEM = "You are a context summarization assistant."
_TITLE_SYSTEM = "Generate a concise session title"
COMPACTED_HISTORY_PREFIX = "The conversation history before this point was compacted into the following summary:"
_TRANSCRIPT_RE = re.compile(r"<conversation>.*</conversation>", re.DOTALL)


def _text(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # un-normalised parts (replayed raw requests)
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def is_ephemeral(msg: dict[str, Any]) -> bool:
    """A user message that holds only OpenClaw's internal runtime-context block."""
    if msg.get("role") != "user":
        return False
    text = _text(msg).strip()
    return text.startswith(INTERNAL_CONTEXT_BEGIN) and text.endswith(INTERNAL_CONTEXT_END)


def conversation_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages without ephemeral ones (the same list object when there are none)."""
    if not any(is_ephemeral(m) for m in messages):
        return messages
    return [m for m in messages if not is_ephemeral(m)]


def is_compacted_history(messages: list[dict[str, Any]]) -> bool:
    """True when a user message before the last one is OpenClaw's summary of compacted history."""
    return any(m.get("role") == "user" and _text(m).lstrip().startswith(COMPACTED_HISTORY_PREFIX)
               for m in messages[:-1])


def housekeeping_kind(messages: list[dict[str, Any]]) -> str:
    """The kind of OpenClaw housekeeping request this is, or ``""`` for a conversation turn."""
    systems = [_text(m).strip() for m in messages if m.get("role") == "system"]
    rest = [m for m in conversation_messages(messages) if m.get("role") != "system"]
    last_user = _text(rest[-1]).strip() if rest and rest[-1].get("role") == "user" else ""
    if last_user and _FLUSH_USER_RE.match(last_user):
        return MEMORY_FLUSH
    if any(_FLUSH_SYSTEM + " The session is near auto-compaction" in s for s in systems):
        return MEMORY_FLUSH  # a configured flush prompt replaces the user text, not this system section
    if any(s.startswith(_SUMMARY_SYSTEM) for s in systems) and _TRANSCRIPT_RE.search(last_user):
        return COMPACTION_SUMMARY
    if any(s.startswith(_TITLE_SYSTEM) for s in systems) and len(rest) == 1:
        return SESSION_TITLE
    return ""
